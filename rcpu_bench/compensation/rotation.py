"""The rotation of RCPU: the polar factor Q of M = Y Zᵀ, Q = argmax_{QᵀQ=I} tr(QᵀM) (paper eq. procrustes_sol).

With M = U Σ Vᵀ, every maximiser is Q = U_r V_rᵀ + U⊥ P V⊥ᵀ (r = rank M, P any orthogonal matrix on
the null spaces), and max tr(QᵀM) = tr(Σ), the numerator of the scaled solution (eq. scaled_sol).

Solvers (``solver=``):

* ``eigh``: eigendecomposition of the Gram MᵀM = V Λ Vᵀ in float64 (several times faster than a
  general SVD on a GPU), U_r = M V_r / ‖M V_r‖ column by column, then Newton–Schulz
  steps until ‖QᵀQ − I‖_F is within ``tolerance`` of M's dtype (a float32 M: float32's, which the float64 Q
  usually meets unpolished), and refinement steps (``_refine``) that remove the
  Gram matrix's squared conditioning from Q's error. Three checks, each within ``tolerance``:
  orthogonality; backward error ‖QᵀM − MᵀQ‖_F / 2‖M‖_F (QᵀM is symmetric for the polar factor
  only); optimality tr(QᵀM) ≥ (1 − tol) Σᵢ‖M vᵢ‖, where Σᵢ‖M vᵢ‖ ≥ tr(Σ) for any orthonormal basis
  {vᵢ}: an upper bound computed without an SVD. A failed check raises. The symmetric products MᵀM and
  QᵀQ are formed from their upper block triangles (half the flops); at n = 4096 on 2 CPU threads the
  eigh itself is about half the time, the products of U_r, Q, the polish and the checks the other half.
* ``svd``: an accurate float64 SVD (LAPACK on the CPU, ``gesvd`` on CUDA: the default CUDA driver
  loses orthogonality), with the same null-space completion.
* ``auto`` (default): the cheapest solver of the device and size that passes the checks
  (:func:`auto_solver`): on the CPU the ``svd`` below n = ``CPU_SVD_BELOW`` and ``eigh`` from there. The
  crossover depends on the CPU; eigh / SVD time, full-rank and o_proj-like rank-13n/16 M, 2 idle threads:
  0.91–1.06 at n = 1024, 0.82–1.00 at 2048 and 0.77–0.84 at 4096 (27–30 s against 35–36 s) on a Zen 3
  (``benchmarks/README.md``); 0.81–1.00, 0.78–0.95 and 0.74–0.85 on a Xeon (before the upper-triangle
  products). On CUDA ``eigh`` (0.11 s against 1.6–5.3 s for the SVD at 4096², float64, on an H200).
  ``eigh`` falls back to the ``svd`` when a check fails, recorded as ``eigh+svd-fallback`` with the reason.
  ``info["solver"]`` records which ran. A float32 SVD is not
  used even for a float32 M: its rank cut n·eps32·σ₁ drops genuine singular directions (e.g. a
  random-init o_proj at 1/20 of LLaMA-7B's width, σ down to 1.4e-5·σ₁ < 2.3e-5·σ₁), whose completion
  then moves Q W_K by up to 8 % of its largest entry.
* ``official``: the official code's numerics on purpose (float32 M, ``torch.linalg.svd`` with the
  default driver, Q = U Vᵀ with whatever completion the SVD gives). Its orthogonality error is
  recorded, not checked (``orthogonality_unchecked`` says why), because the float32 CUDA SVD breaks it.

:func:`polar_columns` solves the same problem for a tall B (n × k, n ≥ k): U = argmax_{UᵀU=I_k} tr(UᵀB)
= B (BᵀB)^{-1/2}, with the same solvers and checks on a k × k problem, for B of full column rank
(``compensators.rotate`` uses it for pruned heads).

Rank-deficient M (fewer calibration tokens than kept columns, or M = A W_Kᵀ with rank W_K ≤ k <
d_out, e.g. pruned heads): Q W_K is unique when rank M = rank W_K, because then W_K's columns lie in
the span of V_r. Otherwise (e.g. few calibration tokens) we choose, among the optimal Q, the one
closest to the identity, i.e. the least change to the pretrained weights on the unseen subspace:
argmin ‖Q − I‖_F = U_r V_rᵀ + U⊥ P V⊥ᵀ with P = polar(U⊥ᵀ V⊥).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from rcpu_bench.statistics.activations import gram_of

SOLVERS = ("auto", "eigh", "svd", "official")
# The order n from which "auto" runs eigh rather than the SVD on the CPU (module docstring; measured idle).
CPU_SVD_BELOW = 2048
# ‖QᵀQ − I‖_F of a correctly computed Q, measured in float64, divided by n·eps(dtype), on CPU for random
# full-rank, rank-deficient (rank 13n/16) and condition-1e4 M, n = 16…1024: LAPACK SVD U Vᵀ 0.97–1.9
# (float64) and 0.69–1.7 (float32); eigh + Newton–Schulz 0.19–0.24; a float64 Q rounded to float32 ≤ 0.093;
# optimality gaps ≤ 0.21. c = 5 leaves a margin of 2.5 over the worst. The float32 CUDA SVD of the official
# code was measured at ‖QᵀQ − I‖_F = 0.0669 for n = 4096, i.e. 137·n·eps(float32): rightly refused.
TOLERANCE_FACTOR = 5.0
# Newton–Schulz from ‖E₀‖ ≤ 1/2 reaches float64 rounding in 6 steps (‖Eₖ₊₁‖ ≤ ‖Eₖ‖², see ``_polish``).
MAX_POLISH_STEPS = 8
# Refinement steps of the eigh solution against the asymmetry of QᵀM (``_refine``); each is quadratic.
MAX_REFINEMENTS = 3
# An eigenvalue of MᵀM within this factor of eigh's null-space cut k·eps·λ_max is not resolved: the SVD
# is used at once. Measured (n = 120, σ log-spaced down to 10^-c): c ≤ 5 (λ_min ≥ 3700 × cut) passes with one
# polish step, c = 5.5–6 (370–37 × cut) after 2–3 steps and refinements, c = 6.5 (4 × cut) fails once in 4,
# c ≥ 7 (below the cut, taken as null) always fails. At n = 4096 (a 7B down_proj from 4,096 tokens, 2 threads)
# the failed polish and refinements cost about 3x the SVD that followed (a 128 s solve in all).
UNRESOLVED = 10.0


def tolerance(n: int, dtype: torch.dtype) -> float:
    """The largest accepted ‖QᵀQ − I‖_F (and relative optimality gap) of an n × n Q in ``dtype``: c·n·eps."""
    return TOLERANCE_FACTOR * max(n, 1) * torch.finfo(dtype).eps


def orthogonality_error(q: Tensor) -> float:
    """‖QᵀQ − I‖_F computed in float64, so that it measures Q and not the rounding of the check."""
    gram = gram_of(q.to(torch.float64))
    gram.diagonal().sub_(1)
    return float(gram.norm())


@dataclass
class Rotation:
    """The polar factor Q (compute dtype), tr(QᵀM) (= tr Σ at the optimum) and diagnostics for the record."""

    q: Tensor
    trace: float
    info: dict[str, float | str] = field(default_factory=dict)


def polar(m: Tensor, solver: str = "auto") -> Rotation:
    """Q = argmax_{QᵀQ=I} tr(QᵀM) for a square M, in M's dtype, by the chosen ``solver`` (see the module doc)."""
    _check_solver(solver)
    if m.ndim != 2 or m.shape[0] != m.shape[1]:
        raise ValueError(f"M must be square, got shape {tuple(m.shape)}")
    if solver == "official":
        return _official(m)
    rotation = _solve(m, solver, complete=True)
    assert rotation is not None  # a square M is completed, never refused
    return rotation


def polar_columns(b: Tensor, solver: str = "auto") -> Rotation | None:
    """U = argmax_{UᵀU=I_k} tr(UᵀB) = B (BᵀB)^{-1/2} for a tall B (n × k, n ≥ k) of full column rank.

    The same solvers and checks as :func:`polar` on the k × k problem (eigh of BᵀB, or the thin SVD);
    ``info`` has no ``det_sign`` (U is not square). None when rank B < k: the maximiser is then not
    unique and the caller decides the completion (``compensators.rotate`` solves the square problem).
    """
    _check_solver(solver)
    if solver == "official":
        raise ValueError("solver='official' reproduces the official square SVD of M: use polar(M)")
    if b.ndim != 2 or b.shape[0] < b.shape[1]:
        raise ValueError(f"B must be tall (n × k, n ≥ k), got shape {tuple(b.shape)}")
    return _solve(b, solver, complete=False)


def _check_solver(solver: str) -> None:
    if solver not in SOLVERS:
        raise ValueError(f"unknown rotation solver {solver!r}; allowed: {', '.join(SOLVERS)}")


def _solve(m: Tensor, solver: str, complete: bool) -> Rotation | None:
    """The checked polar factor of M (n × k) by eigh or the SVD; the closest-to-identity completion of a
    rank-deficient square M when ``complete``, else None for rank M < k."""
    m64 = m.to(torch.float64)
    if solver == "svd" or (solver == "auto" and auto_solver(m) == "svd"):
        return _svd_rotation(m64, m, "svd", complete)
    solved = _eigh_polar(m64, complete, tolerance(m.shape[0], m.dtype))
    if solved is None:
        return None
    if isinstance(solved, str):
        failure = solved
    else:
        q64, upper, steps, error, asymmetry = solved
        rotation = _finish(q64, upper, m, "eigh", error)
        rotation.info["polish_steps"] = float(steps)
        rotation.info["asymmetry"] = asymmetry
        checked = _failed_check(rotation, m)
        if checked is None:
            return rotation
        failure = checked
    if solver == "eigh":
        raise RuntimeError(f"the eigh rotation solver failed its check: {failure}; use solver='svd' or 'auto'")
    fallback = _svd_rotation(m64, m, "eigh+svd-fallback", complete)
    if fallback is not None:
        fallback.info["fallback_reason"] = failure
    return fallback


def _svd_rotation(m64: Tensor, m: Tensor, solver: str, complete: bool) -> Rotation | None:
    """``_svd_polar`` finished as a Rotation recorded under ``solver``; None where it refuses (rank M < k)."""
    solved = _svd_polar(m64, m.dtype, complete)
    return None if solved is None else _finish(*solved, m, solver)


def auto_solver(m: Tensor) -> str:
    """What ``solver="auto"`` runs for M (n × k): the SVD on the CPU below k = ``CPU_SVD_BELOW``, else eigh."""
    return "svd" if m.device.type == "cpu" and m.shape[1] < CPU_SVD_BELOW else "eigh"


def _failed_check(rotation: Rotation, m: Tensor) -> str | None:
    """Why the eigh solution fails a check (orthogonality, backward error, optimality), or None."""
    tol = tolerance(m.shape[0], m.dtype)
    for key, what in (("orthogonality_error", "‖QᵀQ − I‖_F"), ("asymmetry", "‖QᵀM − MᵀQ‖_F / 2‖M‖_F"),
                      ("optimality_gap", "relative optimality gap")):
        value = float(rotation.info[key])
        if not value <= tol:
            return f"{what} = {value:.3g} > {tol:.3g}"
    return None


def _eigh_polar(m: Tensor, complete: bool, target: float) -> tuple[Tensor, Tensor, int, float, float] | str | None:
    """Polar factor of M (n × k) from MᵀM = V Λ Vᵀ: Q = U_r V_rᵀ + completion, U_r = M V_r normalised, then polished
    and refined until orthogonality and backward error are within ``target``: the ``tolerance`` of the dtype M was
    given in (a float32 M, passed here as float64, gets float32's: its checks apply it to Q rounded to float32).

    Returns (Q, upper bound Σᵢ‖M vᵢ‖ of tr Σ, Newton–Schulz steps, ‖QᵀQ − I‖_F, backward error
    ‖QᵀM − MᵀQ‖_F / 2‖M‖_F), in float64; None when rank M < k and not ``complete``; the reason, without
    polishing, when an eigenvalue lies less than a factor ``UNRESOLVED`` above the null-space cut. Eigenvalues
    at or below float64 eigh's resolution k·eps·λ_max span the numerical null space (of the float64 M, also
    when M was formed in float32: its small singular values are real for the matrix given); one just above it
    is not resolved (an ill-conditioned M whose spectrum runs through the cut, e.g. from about as many
    calibration tokens as outputs), and the polish and refinements that would follow fail the checks at
    several times the cost of the SVD. MᵀM is
    formed as its upper block triangle only (eigh reads that triangle). (A float32 eigh, about half the time,
    cannot resolve σ below √(n·eps32)·σ₁ ≈ 0.02·σ₁ at n = 4096: it failed the float32 checks on o_proj- and
    full-rank-like M.)
    """
    k = m.shape[1]
    evals, v = torch.linalg.eigh(gram_of(m, full=False), UPLO="U")  # ascending
    cut = k * torch.finfo(m.dtype).eps * float(evals[-1])
    near = int(((evals > cut) & (evals < cut * UNRESOLVED)).sum())
    if near:
        return (f"{near} eigenvalue(s) of MᵀM within a factor {UNRESOLVED:g} above the null-space cut "
                f"{cut:.3g} (κ(M)² ≈ 1/(k·eps)): not resolved by eigh")
    mv = m @ v
    norms = mv.norm(dim=0)
    rank = int((evals > cut).sum()) if evals[-1] > 0 else 0
    if rank < k and not complete:
        return None
    first = k - rank
    u_r = mv[:, first:].div_(norms[first:])
    q = u_r @ v[:, first:].T
    if rank < k:
        q += _closest_completion(_complement(u_r, v[:, :first]), v[:, :first])
    q, steps, error = _polish(q, target)
    asymmetry = _asymmetry(q, m)
    for _ in range(MAX_REFINEMENTS):
        if asymmetry <= target:
            break
        q, more, error = _polish(_refine(q, m, v, norms, first), target)
        steps, asymmetry = steps + more, _asymmetry(q, m)
    return q, norms.sum(), steps, error, asymmetry


def _asymmetry(q: Tensor, m: Tensor) -> float:
    """‖QᵀM − MᵀQ‖_F / (2‖M‖_F): zero exactly for the polar factor (QᵀM = H symmetric), a backward error."""
    a = q.T @ m
    norm = float(m.norm())
    return float((a - a.T).norm()) / (2 * norm) if norm > 0 else 0.0


def _refine(q: Tensor, m: Tensor, v: Tensor, norms: Tensor, first: int) -> Tensor:
    """One correction Q ← Q (I + Ω) toward the polar factor, from the computed asymmetry of QᵀM.

    If Q = Q* e^{−Ω} with H = Q*ᵀM = V diag(σ) Vᵀ, then skew(QᵀM) ≈ (ΩH + HΩ)/2, so in the eigenbasis
    Ω̃ᵢⱼ = 2 S̃ᵢⱼ / (σᵢ + σⱼ), S̃ = Vᵀ skew(QᵀM) V (σᵢ = ‖M vᵢ‖). The null-null block is left alone (it
    holds the closest-to-identity completion). The residual is computed to ~eps‖M‖, so this removes the
    Gram matrix's squared conditioning from Q's error, like one step of iterative refinement.
    """
    a = q.T @ m
    skew = v.T @ ((a - a.T) / 2) @ v
    omega = 2 * skew / (norms[:, None] + norms[None, :]).clamp_min(torch.finfo(m.dtype).tiny)
    omega[:first, :first] = 0
    return q + (q @ v) @ omega @ v.T


def _complement(u_r: Tensor, v_perp: Tensor) -> Tensor:
    """An orthonormal basis U⊥ of span(U_r)⊥ (n × (n − r)), from V⊥ instead of a complete QR of U_r.

    B = (I − U_r U_rᵀ) V⊥, projected twice (Gram–Schmidt twice keeps B ⊥ U_r to rounding), equals
    U⊥ (U⊥ᵀ V⊥) and spans span(U_r)⊥ when U⊥ᵀ V⊥ is nonsingular; its polar factor L Rᵀ (thin SVD) is then
    such a basis. (When it is singular, i.e. V⊥ meets span(U_r), it is not orthogonal to U_r: the polish
    and checks that follow repair Q or refuse it for the SVD.) Cost: 4·n·r·(n − r) and an n × (n − r) SVD,
    against a complete QR (0.9 s against 2.0 s at n = 4096, r = 13n/16, 2 threads).
    """
    b = v_perp - u_r @ (u_r.T @ v_perp)
    b -= u_r @ (u_r.T @ b)
    left, _, right = _accurate_svd(b, full_matrices=False)
    return left @ right


def _closest_completion(u_perp: Tensor, v_perp: Tensor) -> Tensor:
    """U⊥ P V⊥ᵀ with P = polar(U⊥ᵀ V⊥) = argmax tr(U⊥ P V⊥ᵀ): the optimal Q closest to I in Frobenius norm.

    ‖Q − I‖_F² = 2n − 2 tr Q and tr(U_r V_rᵀ) is fixed, so the null-space part maximises tr(P V⊥ᵀU⊥).
    """
    left, _, right = _accurate_svd(u_perp.T @ v_perp)
    return u_perp @ (left @ right) @ v_perp.T


def _polish(q: Tensor, target: float) -> tuple[Tensor, int, float]:
    """Newton–Schulz steps Q ← Q (I − E/2), E = QᵀQ − I, until ‖E‖_F ≤ target; returns (Q, steps, ‖E‖_F).

    Stopping rule: E' = −¾E² + ¼E³ exactly, so ‖E'‖ ≤ ‖E‖² whenever ‖E‖ ≤ 1 (quadratic convergence to
    the polar factor of Q); the steps stop at the target, when ‖E‖_F ≥ 1 (no guarantee: left to the
    checks), when rounding stops the decrease, or after MAX_POLISH_STEPS.
    """
    previous = float("inf")
    for step in range(MAX_POLISH_STEPS + 1):
        e = gram_of(q)
        e.diagonal().sub_(1)
        error = float(e.norm())
        if error <= target or not error < min(1.0, previous) or step == MAX_POLISH_STEPS:
            return q, step, error
        q = torch.addmm(q, q, e, alpha=-0.5)
        previous = error
    raise AssertionError("unreachable")


def _accurate_svd(m: Tensor, full_matrices: bool = True) -> tuple[Tensor, Tensor, Tensor]:
    """U, Σ, Vᵀ by an accurate driver: LAPACK on the CPU, ``gesvd`` on CUDA (the default there is not)."""
    return torch.linalg.svd(m, full_matrices=full_matrices, driver="gesvd" if m.is_cuda else None)


def _svd_polar(m: Tensor, given: torch.dtype = torch.float64, complete: bool = True) -> tuple[Tensor, Tensor] | None:
    """Q = U_r V_rᵀ + the closest completion, from the float64 SVD of M (n × k); returns (Q, tr Σ) in float64,
    or None when rank M < k and not ``complete``.

    r = #{σᵢ > max(k·eps·σ₁, u·‖M‖_F)}, u the unit roundoff of the dtype M was ``given`` in: rounding M to
    that dtype moves each σᵢ by at most ‖E‖₂ ≤ u‖M‖_F (Weyl), so smaller σᵢ may be rounding alone, larger
    ones are M's (a float32 SVD's cut n·eps32·σ₁ would drop some of those, the module docstring's example).
    """
    k = m.shape[1]
    u, sigma, vh = _accurate_svd(m, full_matrices=complete)
    cut = max(k * torch.finfo(m.dtype).eps * float(sigma[0]), torch.finfo(given).eps / 2 * float(m.norm()))
    rank = int((sigma > cut).sum()) if sigma[0] > 0 else 0
    if rank < k and not complete:
        return None
    q = u[:, :rank] @ vh[:rank]
    if rank < k:
        q += _closest_completion(u[:, rank:], vh[rank:].T)
    return q, sigma.sum()


def _finish(q64: Tensor, upper: Tensor, m: Tensor, solver: str, error64: float | None = None) -> Rotation:
    """Cast Q to M's dtype and record its orthogonality, optimality gap, determinant sign and solver.

    ``error64``: ‖QᵀQ − I‖_F of the float64 Q when already known (it is Q's own when M is float64).
    """
    q = q64.to(m.dtype)
    trace = float(q.to(torch.float64).reshape(-1) @ m.to(torch.float64).reshape(-1))
    gap = (float(upper) - trace) / float(upper) if upper > 0 else 0.0
    error = error64 if error64 is not None and m.dtype == torch.float64 else orthogonality_error(q)
    info: dict[str, float | str] = {"solver": solver, "orthogonality_error": error, "optimality_gap": gap}
    if q.shape[0] == q.shape[1]:
        info["det_sign"] = _det_sign(q)
    return Rotation(q, trace, info)


def _det_sign(q: Tensor) -> float:
    """sign det Q, from a float32 LU: |det Q| = 1 for an orthogonal Q, far from 0 at any precision."""
    return float(torch.linalg.slogdet(q.to(torch.float32)).sign)


def _official(m: Tensor) -> Rotation:
    """The official code's Q = U Vᵀ from ``torch.linalg.svd(M)`` (default driver) in M's dtype; trace = tr Σ."""
    u, sigma, vh = torch.linalg.svd(m, full_matrices=False)
    q = u @ vh
    return Rotation(q, float(sigma.sum()), {
        "solver": "official", "orthogonality_error": orthogonality_error(q), "det_sign": _det_sign(q),
        "orthogonality_unchecked": "official numerics reproduced on purpose (torch.linalg.svd of M, default "
                                   "driver); the error is recorded, not checked"})
