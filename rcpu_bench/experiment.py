"""One pruning experiment end to end: load, calibrate, prune, evaluate, record (and optionally save).

The layer of "one run": ``rcpu-bench prune`` runs one :class:`Experiment`, a matrix (:mod:`rcpu_bench.matrix`)
runs one per cell; either way the result is a :class:`rcpu_bench.records.Record`. The experiment-level options
(revision, dtype, device, evaluation batch size, ...) are declared once, as :class:`Experiment`'s fields
(:func:`rcpu_bench.declaration.option`, the mechanism of the pruning options): the flags of the commands that take
them (:func:`add_flags`), the matrix keys and the reference table (:func:`markdown_table`) derive from them.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from rcpu_bench import data
from rcpu_bench.atomic_file import claimed
from rcpu_bench.compensation import diagnostics
from rcpu_bench.declaration import Option, add_argument, declared, option
from rcpu_bench.declaration import markdown_table as options_table
from rcpu_bench.evaluation import EVAL_BATCH_SIZE, perplexity
from rcpu_bench.evaluation.generation import text_sample
from rcpu_bench.evaluation.speed import inference_speed
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import (
    DEFAULT_DEVICE,
    DEFAULT_DTYPE,
    DTYPES,
    LoadedModel,
    check_device,
    check_revision,
    load_config,
    load_model,
    load_tokenizer,
    model_skeleton,
    model_source,
    parameter_count,
    resolve_device,
    resolve_dtype,
)
from rcpu_bench.model.manifest import check_saved_model
from rcpu_bench.model.persistence import save_pruned
from rcpu_bench.paths import check_new_dir, default_model
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import selection_units
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.records import LayerTiming, Parameters, Perplexity, Record, Timing, environment, library_versions
from rcpu_bench.registry import Registry

DEFAULT_CALIB = "tinystories:128x128"
DEFAULT_PPL_PROFILES = ("rcpu128",)
# Measurements a run may leave out of its record (the matrix key ``skip``): the perplexity on the calibration windows
# (the λ rule's input, so λ-grid cells keep it), the inference speed, and the greedy text sample.
SKIPPABLE = ("calibration-ppl", "speed", "sample")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Inputs:
    """What :meth:`Experiment.check_inputs` read of a model without its weights: its weightless (meta) skeleton and
    its tokenizer."""

    skeleton: nn.Module
    tokenizer: Any


@dataclass
class Experiment:
    """What to prune and how to evaluate it; every field lands in the result record."""

    model: str = field(default_factory=default_model)
    prune: PruneConfig = field(default_factory=PruneConfig)
    calib: str = DEFAULT_CALIB
    ppl_profiles: tuple[str, ...] = DEFAULT_PPL_PROFILES
    revision: str | None = option("text", None, "hub revision (branch, tag or commit) to pin; recorded")
    trust_remote_code: bool = option("flag", False, "run Python code shipped with the model (transformers' "
                                     "trust_remote_code); without it such a model is refused with an error, never "
                                     "prompted for")
    dtype: str = option("text", DEFAULT_DTYPE, f"the model's dtype: {', '.join(DTYPES)} (the paper uses float32)",
                        library_check=resolve_dtype)
    device: str = option("text", DEFAULT_DEVICE, "cpu, cuda or cuda:N (does not change results, nor enter cell ids)",
                         library_check=resolve_device)
    eval_batch_size: int = option("count", EVAL_BATCH_SIZE, "sequences per evaluation forward pass: perplexity, "
                                  "lm-eval, timing (does not change perplexity or accuracy; speed's recorded figures "
                                  "are measured at 1)")
    data_dir: str | None = None
    save_dir: str | None = None
    skip: tuple[str, ...] = ()  # of SKIPPABLE

    def validate(self, registry: Registry, *, here: bool = True) -> None:
        """Every check before the model is loaded, each a one-line ValueError or OSError naming the bad value: the
        options (:meth:`check_options`), the inputs (:meth:`check_inputs`) and the budgets the model's shape decides
        (:meth:`check_budget`). ``here=False`` (the experiment runs elsewhere, on a Ray worker) checks the device's
        name, not that it exists."""
        self.check_options(registry)
        self.check_budget(self.check_inputs(here=here), registry)

    def check_options(self, registry: Registry) -> None:
        """Names and ranges: the pruning options against the registry, the measurements left out, dtype, device and
        batch size, and a save a whole-model method cannot do."""
        self.prune.validate(registry)
        unknown = [item for item in self.skip if item not in SKIPPABLE]
        if unknown:
            raise ValueError(f"skip {', '.join(map(repr, unknown))}: not a measurement a run can leave out; allowed: "
                             f"{', '.join(SKIPPABLE)}")
        for name in ("dtype", "device", "eval_batch_size"):
            BY_NAME[name].check(getattr(self, name))
        method = self.prune.model_method
        if self.save_dir and method and registry.get("model-method", method).save is None:
            raise ValueError(f"the model method {method!r} registered no save function; drop --save")

    def check_inputs(self, *, here: bool = True) -> Inputs:
        """What the run reads and writes, without loading weights: the device (``here``), the revision, the model's
        files (a saved directory against its manifest's checksums) and config, the calibration windows and the
        diagnostics' held-out windows its tokenizer cuts from the source, the profiles' data and the --save
        destination; returns the model's weightless skeleton and its tokenizer."""
        if here:
            check_device(self.device)
        check_revision(self.model, self.revision)
        check_saved_model(self.model)
        config, commit = load_config(self.model, self.revision,
                                     prune=() if self.prune.model_method else self.prune.prune,
                                     trust_remote_code=self.trust_remote_code)
        tokenizer = load_tokenizer(model_source(self.model), commit or self.revision,
                                   trust_remote_code=self.trust_remote_code)
        data.calibration_data(self.calib, tokenizer, data_dir=self.data_dir,
                              max_positions=config.max_position_embeddings)
        if self.prune.holdout:
            data.holdout_windows(self.calib, tokenizer, self.prune.holdout, data_dir=self.data_dir)
        for profile in self.ppl_profiles:
            perplexity.profile_source(profile, self.data_dir)
        if self.save_dir:
            check_new_dir(self.save_dir, "--save directory")
        return Inputs(model_skeleton(config, self.trust_remote_code), tokenizer)

    def check_budget(self, inputs: Inputs, registry: Registry) -> None:
        """The budgets the model's shape decides (``PruneConfig.check_budget``: units per layer under the allocation,
        round_to, a whole-model method's own check), a model allocation's own check (the search's cost bound and
        cache space) with the held-out windows it will draw; a module the ratio prunes nothing of is a warning."""
        skeleton = inputs.skeleton
        self.prune.check_budget(skeleton, registry)
        geometries = layer_geometries(skeleton)
        for module in self.prune.unpruned_modules(geometries):
            n, what = selection_units(geometries[0], module, self.prune.gqa_rule)
            log.warning(f"ratio={self.prune.ratio} prunes none of the {n} {what} of {module} in any layer "
                        f"(⌊ρ·n⌋ = 0, rounding={self.prune.rounding!r}): only the other modules are pruned")
        allocated = self._check_model_allocation(registry, skeleton)
        if allocated:
            asked = f"allocation {self.prune.allocation!r} with {self.prune.allocation_params} ({allocated:,} windows)"
            asked = f"holdout={self.prune.holdout} and {asked}" if self.prune.holdout else asked
            data.holdout_windows(self.calib, inputs.tokenizer, self.prune.holdout + allocated, data_dir=self.data_dir,
                                 asked=asked)

    def _check_model_allocation(self, registry: Registry, skeleton: Any) -> int:
        """A model allocation's own check on the model's shapes, where it has one (``hookspecs.ModelAllocation``:
        the search's cost bound and cache space): the held-out windows it will draw (0 for any other allocation)."""
        if self.prune.model_method is not None or self.prune.structure != "uniform":
            return 0
        allocation = registry.allocation(self.prune.allocation)(len(layer_geometries(skeleton)), self.prune.ratio,
                                                                **self.prune.allocation_params)
        check = getattr(allocation, "check", None)
        if not callable(allocation) or check is None:
            return 0
        skeleton.to(resolve_dtype(self.dtype))  # weightless: the run's dtype sizes what it writes
        return int(check(skeleton, self.prune, data.parse_calib(self.calib).seqlen))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


OPTIONS: tuple[Option, ...] = declared(Experiment)
BY_NAME: dict[str, Option] = {declared_option.name: declared_option for declared_option in OPTIONS}
MODEL = ("revision", "trust_remote_code", "dtype", "device")  # what every command that loads a model takes


def add_flags(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """The flags of the options ``names``; counts are parsed as integers and checked where they are used."""
    for name in names:
        add_argument(parser, BY_NAME[name], checked_later=True)


def markdown_table() -> str:
    """The reference table of the experiment-level options as command-line flags."""
    return options_table(OPTIONS)


def run_experiment(experiment: Experiment, *, registry: Registry | None = None, progress: bool = True,
                   load: Callable[..., LoadedModel] = load_model,
                   evaluate: Callable[[Any, Any], dict[str, Any]] | None = None,
                   reuse_capture: Callable[[Callable[[], Any]], Any] | None = None,
                   keep_record: Callable[[Record], None] | None = None, validated: bool = False) -> Record:
    """Run one experiment and return its result record.

    ``load`` (load_model's signature) supplies the dense model, which the run prunes in place, so it must
    return a model of its own: the matrix runner passes a cache that reads each model once and hands out copies.
    ``evaluate(model, tokenizer)`` evaluates the pruned model further; its fields join the record
    (:meth:`Record.add`: the matrix runner's zero-shot accuracy). ``reuse_capture`` goes to prune_model: the
    matrix runner's cache of layer-0 inputs (rcpu_bench.matrix.reuse). ``keep_record(record)`` is called with the
    finished record before the model is saved (prune's ``--out``), so a failing save loses no record. The save
    directory is claimed for the whole run (``atomic_file.claimed``): a second run saving there is refused before its
    work, not after it. ``validated=True``: the caller has run ``experiment.validate`` (a matrix: each cell's options
    when it expanded, the inputs of each setting and each cell's budgets before the first cell ran), so it is not run
    again.
    """
    registry = registry or default_registry()
    if not validated:
        experiment.validate(registry)
    with claimed(experiment.save_dir) if experiment.save_dir else contextlib.nullcontext():
        return _run(experiment, registry, progress, load, evaluate, reuse_capture, keep_record)


def _run(experiment: Experiment, registry: Registry, progress: bool, load: Callable[..., LoadedModel],
         evaluate: Callable[[Any, Any], dict[str, Any]] | None,
         reuse_capture: Callable[[Callable[[], Any]], Any] | None,
         keep_record: Callable[[Record], None] | None) -> Record:
    """The run of a validated experiment (:func:`run_experiment`)."""
    started = time.perf_counter()
    # With offloading the model stays in CPU memory and each layer visits the device while it is pruned.
    home = "cpu" if experiment.prune.offload else experiment.device
    loaded = load(experiment.model, dtype=experiment.dtype, device=home, revision=experiment.revision,
                  trust_remote_code=experiment.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    calib = data.calibration_data(experiment.calib, tokenizer, data_dir=experiment.data_dir,
                                  max_positions=model.config.max_position_embeddings)
    holdout = experiment.prune.holdout
    holdout_ids = (data.holdout_windows(experiment.calib, tokenizer, holdout, data_dir=experiment.data_dir)
                   if holdout else None)
    params_before = parameter_count(model)
    # A saved model's card shows its perplexity beside the dense model's, measured here before pruning (not with
    # --offload: the dense model then does not fit the device whole).
    with_dense = experiment.save_dir and not experiment.prune.offload
    dense_ppl = tuple(Perplexity.from_json(perplexity.perplexity(
        model, tokenizer, profile, batch_size=experiment.eval_batch_size, data_dir=experiment.data_dir)).summary()
        for profile in experiment.ppl_profiles) if with_dense else None
    report = prune_model(model, calib.tokens, experiment.prune, registry=registry, device=experiment.device,
                         progress=progress, holdout_ids=holdout_ids, reuse_capture=reuse_capture,
                         validated=True, holdout_source=lambda n: data.holdout_windows(
                             experiment.calib, tokenizer, n, data_dir=experiment.data_dir))
    params_after = parameter_count(model)
    model.to(experiment.device)
    calib_nll, calib_targets = (perplexity.sequence_nll(model, list(calib.tokens),
                                                        batch_size=experiment.eval_batch_size, desc="ppl calibration")
                                if "calibration-ppl" not in experiment.skip else (None, None))
    ppl = tuple(Perplexity.from_json(perplexity.perplexity(model, tokenizer, profile,
                                                           batch_size=experiment.eval_batch_size,
                                                           data_dir=experiment.data_dir))
                for profile in experiment.ppl_profiles)
    record = Record(
        experiment=experiment.to_dict(),
        model_provenance=loaded.provenance,
        calibration=calib.provenance.as_dict(),
        versions=library_versions(),
        environment=environment(experiment.device),
        parameters=Parameters(params_before, params_after, 1 - params_after / params_before,
                              _unpruned(experiment.prune.prune, report.layers)),
        perplexity=ppl,
        # On the calibration windows themselves: the paper's rule for choosing the ridge λ (appendix bestlam).
        calibration_ppl=math.exp(calib_nll / calib_targets) if calib_targets else None,
        timing=Timing(time.perf_counter() - started, report.seconds,
                      tuple(LayerTiming(layer["layer"], layer["seconds"]) for layer in report.layers)),
        layers=[{k: v for k, v in layer.items() if k != "seconds"} for layer in report.layers],
        peak_memory_bytes=report.peak_memory_bytes,
        # Inference speed beside the size, and greedy text to read before / after pruning.
        inference=inference_speed(model) if "speed" not in experiment.skip else None,
        sample=text_sample(model, tokenizer) if "sample" not in experiment.skip else None,
        generalisation=diagnostics.summary(report.layers, holdout) if holdout else None,
        method_report=report.method_report,
        dense_perplexity=dense_ppl,
    )
    if evaluate:
        record.add(evaluate(model, tokenizer))
    if keep_record:
        keep_record(record)
    if experiment.save_dir and experiment.prune.model_method:
        registry.get("model-method", experiment.prune.model_method).save(
            model, experiment.save_dir, tokenizer=tokenizer, report=report.method_report)
    elif experiment.save_dir:
        save_pruned(model, experiment.save_dir, tokenizer=tokenizer, method=experiment.prune.to_dict(),
                    provenance=loaded.provenance, record=record)
    return record


def _unpruned(modules: tuple[str, ...], layers: list[dict[str, Any]]) -> tuple[str, ...] | None:
    """The modules asked to be pruned that lost no unit in any layer (the ratio's ⌊ρ·n⌋ is 0 under the GQA rule),
    which the tables mark; None when every module lost units (or a whole-model method reported no layers)."""
    unpruned = tuple(m for m in modules if layers and all(layer[m]["units_pruned"] == 0 for layer in layers
                                                          if m in layer))
    return unpruned or None
