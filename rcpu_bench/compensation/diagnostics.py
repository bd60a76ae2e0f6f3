"""Does a compensator generalise? Calibration vs held-out reconstruction error and degrees of freedom.

Notation of the paper (§2): W (d_out × d_in), inputs X (d_in × N), dense output Y = W X, kept columns K.
A compensator returns W̃ (d_out × |K|) and possibly a bias b. With G = X Xᵀ and s = Σx summed over the N
tokens of a window set, its reconstruction error on that set follows from the statistics alone
(``compensators.Problem.error``)::

    ‖Y − W̃ X_K − b1ᵀ‖_F² = tr(W_D G_DD W_Dᵀ) − 2⟨Δ, W_D G_DK⟩ + tr(Δ G_KK Δᵀ) − 2 bᵀ(W s − W̃ s_K) + N‖b‖²

with Δ = W̃ − W_K (no cancellation against ‖Y‖²), and the *relative* error divides it by ‖Y‖_F², streamed
from the module's outputs in the statistics pass (``--gram-precision mixed``; tr(W G Wᵀ) for statistics
without outputs). Both sets' statistics hold G (the pipeline's need "gram"; C too where the flop model
finds it cheaper, ``statistics/flops.py``). With the calibration G this is the in-sample
error the compensator was fitted on; with the G of held-out windows (``data.holdout_windows``: disjoint
from every calibration window) it is the out-of-sample error. Held-out inputs are defined exactly as the
calibration ones: layer l sees the outputs of the already pruned and compensated layers 0…l−1 (sequential
statistics; one-shot statistics: the dense model's), and both modules' G come from one pass of the dense
layer l, as in the pruning pipeline.

Degrees of freedom of the update, per module (paper §1 and §3: a rotation "reduces the update's degrees
of freedom" against least squares). Each compensator declares its rule when it registers (``register(name, fn,
dof=rule)``, a :data:`DegreesOfFreedom`); the built-in rules:

* ridge: d_out · Σᵢ σᵢ² / (σᵢ² + λ), σᵢ² the eigenvalues of G_KK — the effective degrees of freedom
  tr(X_Kᵀ(X_K X_Kᵀ + λI)⁻¹X_K) of ridge regression, per output row, for d_out rows. G is a *sum* over
  calibration tokens (not a mean), the normalisation under which λ has the paper's meaning (eq. err_A);
  at λ = 0 it is d_out · rank(G_KK), eigenvalues below |K|·eps·max counted as zero.
* procrustes: d_out(d_out − 1)/2, the dimension of the orthogonal group O(d_out);
  scaled-procrustes: one more (the scale).
* none: 0; flap-bias: d_out (the bias); slimllm: 2·d_out (a scale and a bias per output row); olica: r·(d_out + |K|
  − r), the dimension of the d_out × |K| matrices of rank r.
A compensator registered without a rule has its degrees of freedom recorded as None.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from rcpu_bench.compensation.compensators import Compensation, Problem
from rcpu_bench.statistics.activations import ActivationStats


def relative_error(weight: Tensor, stats: ActivationStats, kept: Tensor, new_weight: Tensor,
                   bias: Tensor | None = None) -> float:
    """‖Y − W̃ X_K − b1ᵀ‖_F² / ‖Y‖_F² over the tokens summarised by ``stats`` (module docstring)."""
    problem = Problem(weight, stats, kept)
    y_norm2 = float(problem.y_norm2)
    if not y_norm2 > 0:
        raise ValueError("‖Y‖_F² = 0 on these tokens: the module's dense output is zero, "
                         "its relative error is undefined")
    return problem.error(new_weight, bias) / y_norm2


def ridge_degrees_of_freedom(gkk: Tensor, lam: float, d_out: int) -> float:
    """d_out · Σᵢ σᵢ²/(σᵢ² + λ), σᵢ² the eigenvalues of G_KK (a sum over tokens); d_out · rank(G_KK) at λ = 0."""
    if lam < 0:
        raise ValueError(f"ridge lam={lam} must be >= 0")
    eigenvalues = torch.linalg.eigvalsh(gkk.to(torch.float64)).clamp_min(0)
    if lam == 0:
        tolerance = len(eigenvalues) * torch.finfo(torch.float64).eps * eigenvalues.max()
        return float(d_out * (eigenvalues > tolerance).sum())
    return float(d_out * (eigenvalues / (eigenvalues + lam)).sum())


def rotation_degrees_of_freedom(d_out: int, scaled: bool = False) -> int:
    """d_out(d_out − 1)/2, the dimension of O(d_out); plus one for the scale of scaled Procrustes."""
    return d_out * (d_out - 1) // 2 + int(scaled)


DegreesOfFreedom = Callable[[Tensor, ActivationStats, Tensor, Compensation], float]
"""A compensator's rule: (dense W, calibration statistics, kept columns K, its compensation) → degrees of freedom."""


def ridge_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    """Ridge's rule at the λ it used (``compensation.info["lambda"]``)."""
    return ridge_degrees_of_freedom(Problem(weight, stats, kept).gkk, float(compensation.info["lambda"]),
                                    weight.shape[0])


def rotation_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    return rotation_degrees_of_freedom(weight.shape[0])


def scaled_rotation_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    return rotation_degrees_of_freedom(weight.shape[0], scaled=True)


def no_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    return 0


def bias_dof(weight: Tensor, stats: ActivationStats, kept: Tensor, compensation: Compensation) -> float:
    """A bias per output row: d_out."""
    return weight.shape[0]


def module_generalisation(weight: Tensor, calibration: ActivationStats, holdout: ActivationStats, kept: Tensor,
                          compensation: Compensation, dof: DegreesOfFreedom | None) -> dict[str, float | None]:
    """Calibration and held-out relative errors of one compensated module, and its degrees of freedom.

    ``weight`` is the dense W (before pruning), ``kept`` its kept input columns, ``compensation`` what the
    compensator returned from the ``calibration`` statistics, ``dof`` its declared rule (None: not declared);
    ``holdout`` are the held-out windows' statistics.
    """
    errors = {name: relative_error(weight, stats, kept, compensation.weight, compensation.bias)
              for name, stats in (("calibration_error", calibration), ("holdout_error", holdout))}
    freedom = None if dof is None else float(dof(weight, calibration, kept, compensation))
    return {**errors, "degrees_of_freedom": freedom}


def summary(layers: list[dict[str, Any]], holdout_windows: int) -> dict[str, Any]:
    """``record["generalisation"]`` from the pruning report's layers (each module's ``generalisation`` entry).

    Means are over every (layer, module); the total degrees of freedom is None if any module has no rule.
    """
    rows = [{"layer": layer["layer"], "module": module, **layer[module]["generalisation"]}
            for layer in layers for module in ("attention", "mlp") if "generalisation" in layer.get(module, {})]
    if not rows:
        raise ValueError("no module reported held-out diagnostics: was the model pruned with holdout > 0?")
    dof = [row["degrees_of_freedom"] for row in rows]
    return {"holdout_windows": holdout_windows, "layers": rows,
            "calibration_error_mean": math.fsum(r["calibration_error"] for r in rows) / len(rows),
            "holdout_error_mean": math.fsum(r["holdout_error"] for r in rows) / len(rows),
            "degrees_of_freedom_total": None if None in dof else math.fsum(dof)}
