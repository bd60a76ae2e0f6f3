"""Hook specifications: the contract between rcpu-bench and its plugins (built-in or third-party).

A plugin is a module or object with ``@hookimpl`` functions, exposed through the ``rcpu_bench``
entry-point group. Each hook receives a ``register`` callable::

    register(name, fn, *, needs="moments", description=None)

``fn`` is called as ``fn(weight, stats, **params)`` for scorers (returning d_in column scores) and
``fn(weight, stats, kept, pruned, **params)`` for compensators (returning a ``Compensation``).
``fn(model, calib_ids, *, ratio, **params)`` for whole-model methods (transforming the model in place
and returning a report dict). Keyword-only arguments with defaults are the method's parameters. ``needs`` declares the cheapest
statistic the method requires: "moments" (Σx, Σ|x|, Σx²) or "gram" (also G = Σ x xᵀ).
"""

import pluggy

hookspec = pluggy.HookspecMarker("rcpu_bench")
hookimpl = pluggy.HookimplMarker("rcpu_bench")


@hookspec
def register_scorers(register):
    """Register column scorers: ``register("name", fn, needs=..., description=...)``."""


@hookspec
def register_compensators(register):
    """Register compensators: ``register("name", fn, needs=..., description=...)``."""


@hookspec
def register_model_methods(register):
    """Register whole-model methods (e.g. SliceGPT): ``register("name", fn, save=..., load=...)``.

    A model method changes the model's structure beyond what ``save_pruned`` describes, so it brings its
    own ``save(model, directory, *, tokenizer, report)``, which must also write an ``rcpu_manifest.json``
    with ``{"format": ..., "model_method": name}``, and ``load(directory, *, dtype, device)``.
    """
