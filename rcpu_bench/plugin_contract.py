"""What a registered method must do: the tiny trial problem its parameters are checked on before real work, and the
checks of what each kind returns (shapes, finiteness, an orthogonal rotation where one is claimed, a JSON report)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from rcpu_bench import strict_json
from rcpu_bench.compensation.rotation import tolerance as orthogonality_tolerance
from rcpu_bench.finite import count_non_finite
from rcpu_bench.hookspecs import Kind, Needs
from rcpu_bench.selection.select import UnitMap
from rcpu_bench.statistics.activations import ActivationStats


def trial_problem(kind: Kind, needs: Needs, group_size: int = 1) -> tuple[Any, ...]:
    """W (3 × 4) and the statistics of 32 random tokens; compensators also get K = {0, 2}, pruned {1, 3}, selectors
    units of 2 columns (in groups of ``group_size``) and one to prune; allocations get 4 layers and ratio 0.2.

    The statistics are the least that the declared need allows: moments and ‖Y‖², plus S and C_D over the
    pruned columns for "output_cross", C alone for "cross", G alone for "gram"."""
    if kind == "allocation":
        return (4, 0.2)
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(3, 4, generator=generator)
    x = torch.randn(32, 4, generator=generator, dtype=torch.float64)
    kept, pruned = torch.tensor([0, 2]), torch.tensor([1, 3])
    stats = ActivationStats.from_activations(x, with_gram=needs == "gram", outputs=x @ weight.double().T,
                                             with_cross=needs == "cross",
                                             dropped=pruned if needs == "output_cross" else None)
    extra = {"compensator": (kept, pruned), "selector": (UnitMap(2, group_size=group_size), 1)}
    return (weight, stats, *extra.get(kind, ()))


def check_scores(scores: Any, weight: torch.Tensor, *_: Any) -> str | None:
    if not isinstance(scores, torch.Tensor) or scores.shape != (weight.shape[1],):
        return f"returned {describe(scores)}, expected a tensor of shape ({weight.shape[1]},)"
    if not torch.isfinite(scores).all():
        return "returned NaN or infinite scores"
    return None


def check_selection(selection: Any, weight: torch.Tensor, _stats: Any, units: UnitMap, n_prune: int) -> str | None:
    if not (isinstance(getattr(selection, "kept", None), torch.Tensor)
            and isinstance(getattr(selection, "pruned", None), torch.Tensor)):
        return f"returned {describe(selection)}, expected a Selection"
    n_units = weight.shape[1] // units.unit_size
    together = torch.cat([selection.kept, selection.pruned]).cpu().sort().values
    if len(selection.pruned) != n_prune or not torch.equal(together, torch.arange(n_units)):
        return (f"returned kept {selection.kept.tolist()} and pruned {selection.pruned.tolist()}; expected {n_prune} "
                f"pruned and the rest kept, a partition of the {n_units} units")
    return None


def check_allocation(ratios: Any, n_layers: int, ratio: float) -> str | None:
    if callable(ratios):  # a hookspecs.ModelAllocation: the pipeline checks what it returns
        return None
    if not isinstance(ratios, torch.Tensor) or ratios.shape != (n_layers,):
        return f"returned {describe(ratios)}, expected a tensor of shape ({n_layers},)"
    if not (torch.isfinite(ratios).all() and (ratios >= 0).all() and (ratios < 1).all()):
        return f"returned ratios {ratios.tolist()} outside [0, 1)"
    if abs(float(ratios.double().mean()) - ratio) > 1e-9:
        return f"returned ratios of mean {float(ratios.double().mean())!r}, expected the target {ratio!r}"
    return None


def check_compensation(result: Any, weight: torch.Tensor, _stats: Any, kept: torch.Tensor, *_: Any) -> str | None:
    expected = (weight.shape[0], len(kept))
    if not hasattr(result, "weight") or not isinstance(result.weight, torch.Tensor):
        return f"returned {describe(result)}, expected a Compensation"
    if tuple(result.weight.shape) != expected:
        return f"returned a weight of shape {tuple(result.weight.shape)}, expected {expected}"
    if result.bias is not None and tuple(result.bias.shape) != (weight.shape[0],):
        return f"returned a bias of shape {tuple(result.bias.shape)}, expected ({weight.shape[0]},)"
    if count_non_finite(result.weight) or (result.bias is not None and count_non_finite(result.bias)):
        return "returned NaN or infinite weights"
    info = getattr(result, "info", {})
    if not isinstance(info, dict) or (bad := strict_json.problem(info, "info")):
        return f"returned {'info' if isinstance(info, dict) else describe(info)} that cannot be recorded: " + (
            bad if isinstance(info, dict) else f"expected a dict of {strict_json.ALLOWED}")
    return check_orthogonality(info, weight.shape[0], result.weight.dtype)


def check_orthogonality(info: dict[str, Any], d_out: int, weight_dtype: torch.dtype) -> str | None:
    """A reported info["orthogonality_error"] declares Q (d_out × d_out) orthogonal: it must be within
    ``rcpu_bench.compensation.rotation.tolerance(d_out, dtype)``, dtype = info["compute_dtype"] or the weight's, unless
    info["orthogonality_unchecked"] states why not (an explicit opt-out, kept in the record)."""
    error = info.get("orthogonality_error")
    if error is None:
        return None
    unchecked = info.get("orthogonality_unchecked")
    if unchecked is not None:
        return None if isinstance(unchecked, str) and unchecked else (
            f"set orthogonality_unchecked={unchecked!r}; it must be a non-empty string saying why")
    name = info.get("compute_dtype")
    dtype = weight_dtype if name is None else getattr(torch, name, None) if isinstance(name, str) else None
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        return f"declared compute_dtype={name!r}; expected a floating torch dtype name such as 'float32'"
    tol = orthogonality_tolerance(d_out, dtype)
    if not error <= tol:
        return f"declared an orthogonal update but ‖QᵀQ − I‖_F = {error:.3g} > {tol:.3g} (n={d_out}, {dtype})"
    return None


def check_report(report: Any, model: torch.nn.Module, *_: Any) -> str | None:
    if not isinstance(report, dict):
        return f"returned {describe(report)}, expected a report dict"
    bad = strict_json.problem(report, "report")
    return None if bad is None else f"returned a report that cannot be recorded: {bad}"


CHECKS: dict[str, Callable[..., str | None]] = {"scorer": check_scores, "selector": check_selection,
                                                 "compensator": check_compensation, "model-method": check_report,
                                                 "allocation": check_allocation}


def describe(obj: Any) -> str:
    return f"a tensor of shape {tuple(obj.shape)}" if isinstance(obj, torch.Tensor) else type(obj).__name__
