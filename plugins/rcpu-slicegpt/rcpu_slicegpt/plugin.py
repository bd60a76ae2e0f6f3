"""The rcpu-bench plugin: registers the whole-model method ``slicegpt``."""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Literal

from torch import Tensor, nn

from rcpu_bench import hookimpl
from rcpu_bench.model import parameter_count
from rcpu_slicegpt.persistence import load_sliced, save_sliced
from rcpu_slicegpt.reference import reference_status, slice_with_reference
from rcpu_slicegpt.slicing import check_supported, choose_dim, slice_model

BUDGETS = ("hidden", "params")


def budget_request(model: nn.Module, ratio: float, budget: str) -> dict[str, Any]:
    """``ratio`` as a slicing request: the hidden fraction s = ratio, or a parameter budget ⌊(1 − ratio)·N_dense⌋."""
    if budget not in BUDGETS:
        raise ValueError(f"budget={budget!r}; allowed: {', '.join(BUDGETS)}")
    if budget == "hidden":
        return {"sparsity": ratio}
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not 0 <= ratio < 1:
        raise ValueError(f"ratio {ratio!r} is outside [0, 1): it is the fraction of parameters removed")
    return {"target_params": math.floor((1 - Fraction(str(ratio))) * parameter_count(model))}


def slicegpt(model: nn.Module, calib_ids: Tensor, *, ratio: float, budget: Literal["hidden", "params"] = "hidden",
             round_to: int = 8, batch_size: int = 8, slice_head: bool = False,
             center_embeddings: bool = False) -> dict[str, Any]:
    """SliceGPT: rotate the residual stream to its principal components and slice it (PCA, deterministic).

    budget="hidden": ratio is the sliced fraction of the hidden size; budget="params": ratio is the fraction
    of the dense model's parameters removed (the largest d′ that meets it, shortcuts included).
    """
    request = budget_request(model, ratio, budget)
    usable, reason = reference_status()
    if usable:
        dim = choose_dim(model, round_to=round_to, **request)
        report = slice_with_reference(model, calib_ids, dim, batch_size=batch_size)
    else:
        report = slice_model(model, calib_ids, round_to=round_to, batch_size=batch_size, slice_head=slice_head,
                             center_embeddings=center_embeddings, **request)
    return {**report, "budget": budget, "ratio": ratio, "implementation_reason": reason}


def check(model: nn.Module, /, *, ratio: float) -> None:
    """Before any weights load: refuse a model SliceGPT does not support (every ratio in [0, 1) slices)."""
    check_supported(model)


@hookimpl
def register_model_methods(register):
    register("slicegpt", slicegpt, save=save_sliced, load=load_sliced, check=check)
