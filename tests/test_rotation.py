"""The rotation solvers against an SVD-based reference built here, independently, in float64.

Reference: M = U Σ Vᵀ by torch.linalg.svd with a known rank r; Q_ref = U_r V_rᵀ + U⊥ P V⊥ᵀ with
P = polar(U⊥ᵀ V⊥) (the optimal Q closest to the identity), P from a second SVD.
"""

from __future__ import annotations

import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_config, tiny_model, tokens

from rcpu_bench.compensation import compensators as C
from rcpu_bench.compensation import rotation as R
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.methods import RECIPES, label_of
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.registry import PluginContractError
from rcpu_bench.statistics.activations import ActivationStats

F64, F32 = torch.float64, torch.float32
EPS64 = torch.finfo(F64).eps


def random_orthogonal(n: int, g: torch.Generator) -> torch.Tensor:
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=F64))
    return q * torch.sign(torch.diagonal(r))


def make_m(n: int, rank: int, log10_cond: float, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """M = U diag(σ) Vᵀ: σ log-spaced from 1 to 10^-log10_cond over ``rank`` values, zero beyond; returns (M, U, V)."""
    g = torch.Generator().manual_seed(seed)
    u, v = random_orthogonal(n, g), random_orthogonal(n, g)
    sigma = torch.zeros(n, dtype=F64)
    sigma[:rank] = torch.logspace(0, -log10_cond, rank, dtype=F64)
    return (u * sigma) @ v.T, u, v


def reference(m: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(Q_ref, σ_min of U⊥ᵀV⊥): the optimal Q closest to I, from torch.linalg.svd in float64."""
    u, _, vh = torch.linalg.svd(m.to(F64))
    v = vh.T
    q = u[:, :rank] @ v[:, :rank].T
    if rank == m.shape[0]:
        return q, torch.tensor(1.0, dtype=F64)
    cross = u[:, rank:].T @ v[:, rank:]
    a, s, bh = torch.linalg.svd(cross)
    return q + u[:, rank:] @ (a @ bh) @ v[:, rank:].T, s.min()


def orth_error(q: torch.Tensor) -> float:
    q = q.to(F64)
    return float((q.T @ q - torch.eye(q.shape[1], dtype=F64)).norm())


# --- the tolerance --------------------------------------------------------------------------------

def test_tolerance_is_c_n_eps():
    assert R.tolerance(4096, F32) == pytest.approx(R.TOLERANCE_FACTOR * 4096 * 2.0**-23)
    assert R.tolerance(10, F64) == pytest.approx(R.TOLERANCE_FACTOR * 10 * 2.0**-52)
    assert R.tolerance(4096, F32) < 0.0669  # the float32 CUDA SVD measured by a user is refused


# --- polar factor against the reference ------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.data(), st.floats(0, 10), st.integers(0, 10_000), st.sampled_from(["auto", "svd"]))
def test_polar_matches_the_svd_reference(n, data, log10_cond, seed, solver):
    """Random, rank-deficient and ill-conditioned M (condition up to 1e10): optimal, orthogonal, Q = Q_ref."""
    rank = data.draw(st.integers(0, n))
    m, _, _ = make_m(n, rank, log10_cond, seed)
    q_ref, cross_min = reference(m, rank)
    out = R.polar(m, solver)
    tol = R.tolerance(n, F64)
    assert orth_error(out.q) <= tol and out.info["orthogonality_error"] == pytest.approx(orth_error(out.q), abs=1e-15)
    nuclear = float(torch.linalg.svdvals(m).sum())
    assert out.trace == pytest.approx(float((out.q * m).sum()), rel=1e-12, abs=1e-300)
    assert nuclear - out.trace <= 10 * tol * max(nuclear, 1e-300)
    # Backward stable like the SVD (asymmetry of QᵀM checked), so Q is off by ~eps·σ₁/(σᵢ+σⱼ) on the range
    # and its completion by ~eps/σ_min(U⊥ᵀV⊥).
    sigma_min = 10.0**-log10_cond if rank else 1.0
    bound = 100 * n * EPS64 * (1 / sigma_min + 1 / float(cross_min))
    if float(cross_min) > 1e-6:
        assert float((out.q - q_ref).norm()) <= bound
    distance, ref_distance = (float((q - torch.eye(n, dtype=F64)).norm()) for q in (out.q, q_ref))
    assert distance <= ref_distance + bound


@settings(max_examples=60, deadline=None)
@given(st.integers(2, 14), st.data(), st.floats(0, 1), st.integers(0, 10_000))
def test_eigh_completion_without_a_complete_qr_is_the_references(n, data, log10_cond, seed):
    """Rank-deficient M through eigh: U⊥ from V⊥ projected off U_r (``_complement``) gives the SVD reference's Q."""
    rank = data.draw(st.integers(0, n - 1))
    m, _, _ = make_m(n, rank, log10_cond, seed)
    q_ref, cross_min = reference(m, rank)
    out = R.polar(m, "eigh")
    assert out.info["solver"] == "eigh" and orth_error(out.q) <= R.tolerance(n, F64)
    if float(cross_min) > 1e-6:
        sigma_min = 10.0**-log10_cond if rank else 1.0
        assert float((out.q - q_ref).norm()) <= 100 * n * EPS64 * (1 / sigma_min + 1 / float(cross_min))


def make_tall(n: int, k: int, rank: int, log10_cond: float, seed: int) -> torch.Tensor:
    """B = U_k diag(σ) V (n × k): σ log-spaced from 1 to 10^-log10_cond over ``rank`` values, zero beyond."""
    g = torch.Generator().manual_seed(seed)
    u, v = random_orthogonal(n, g)[:, :k], random_orthogonal(k, g)
    sigma = torch.zeros(k, dtype=F64)
    sigma[:rank] = torch.logspace(0, -log10_cond, rank, dtype=F64)
    return (u * sigma) @ v.T


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 14), st.data(), st.floats(0, 6), st.integers(0, 10_000), st.sampled_from(["auto", "eigh", "svd"]))
def test_polar_columns_is_b_times_inverse_root_of_its_gram(k, data, log10_cond, seed, solver):
    """Tall B of full column rank: U = B (BᵀB)^{-1/2} = U_B V_Bᵀ of the thin float64 SVD, checked and optimal."""
    n = data.draw(st.integers(k, 2 * k + 3))
    b = make_tall(n, k, k, log10_cond, seed)
    left, sigma, right = torch.linalg.svd(b, full_matrices=False)
    out = R.polar_columns(b, solver)
    assert out is not None and out.q.shape == (n, k) and ("det_sign" in out.info) == (n == k)
    assert orth_error(out.q) <= R.tolerance(n, F64)
    assert out.trace == pytest.approx(float(sigma.sum()), rel=10 * R.tolerance(n, F64))
    bound = 100 * n * EPS64 * 10.0**log10_cond
    assert float((out.q - left @ right).norm()) <= bound


@settings(max_examples=30, deadline=None)
@given(st.integers(2, 12), st.data(), st.integers(0, 10_000), st.sampled_from(["auto", "eigh", "svd"]))
def test_polar_columns_refuses_a_rank_deficient_b(k, data, seed, solver):
    """rank B < k: the maximiser is not unique, so no U is chosen here (None, for the caller's square problem)."""
    n, rank = data.draw(st.integers(k, 2 * k)), data.draw(st.integers(0, k - 1))
    assert R.polar_columns(make_tall(n, k, rank, 1.0, seed), solver) is None


def test_polar_columns_rejects_wide_b_and_the_official_solver():
    with pytest.raises(ValueError, match=r"tall.*\(2, 3\)"):
        R.polar_columns(torch.ones(2, 3, dtype=F64))
    with pytest.raises(ValueError, match="official"):
        R.polar_columns(torch.ones(3, 2, dtype=F64), "official")


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 10), st.data(), st.integers(0, 10_000))
def test_completion_is_the_optimal_q_closest_to_identity(n, data, seed):
    """Among optimal Q = U_r V_rᵀ + U⊥ P V⊥ᵀ (P orthogonal), ours has the smallest ‖Q − I‖_F."""
    rank = data.draw(st.integers(0, n - 1))
    m, u, v = make_m(n, rank, 1.0, seed)
    out = R.polar(m)
    g = torch.Generator().manual_seed(seed + 1)
    distance = float((out.q - torch.eye(n, dtype=F64)).norm())
    for _ in range(10):
        other = u[:, :rank] @ v[:, :rank].T + u[:, rank:] @ random_orthogonal(n - rank, g) @ v[:, rank:].T
        assert float((other * m).sum()) == pytest.approx(out.trace, rel=1e-12, abs=1e-12)  # also optimal
        assert distance <= float((other - torch.eye(n, dtype=F64)).norm()) + 1e-12


@pytest.fixture
def auto_is_eigh(monkeypatch):
    """'auto' as on CUDA or for large M on the CPU: eigh with the SVD fallback (R.auto_solver)."""
    monkeypatch.setattr(R, "CPU_SVD_BELOW", 0)


def test_auto_on_the_cpu_is_eigh_from_the_size_threshold(monkeypatch):
    """Below CPU_SVD_BELOW the SVD runs, from it eigh; both give the SVD's Q to float64 accuracy."""
    m, _, _ = make_m(48, 40, 3.0, seed=2)
    reference = R.polar(m, "svd").q
    for threshold, solver in ((49, "svd"), (48, "eigh")):
        monkeypatch.setattr(R, "CPU_SVD_BELOW", threshold)
        out = R.polar(m)
        assert out.info["solver"] == solver
        assert float((out.q - reference).abs().max()) <= 1e-10


def test_auto_is_the_float64_svd_on_the_cpu():
    m, _, _ = make_m(64, 52, 3.0, seed=1)
    for dtype in (F64, F32):
        out = R.polar(m.to(dtype))
        assert out.info["solver"] == "svd" and out.q.dtype == dtype
        assert out.info["orthogonality_error"] <= R.tolerance(64, dtype)
        assert out.info["optimality_gap"] <= R.tolerance(64, dtype)


def test_float32_m_keeps_singular_directions_below_the_float32_rank_cut():
    """σ down to 5e-6·σ₁ (< n·eps32 = 2.3e-5, > u32·‖M‖_F): real for the float32 M, so Q = U Vᵀ, not a completion."""
    g = torch.Generator().manual_seed(4)
    u, v = random_orthogonal(192, g), random_orthogonal(192, g)
    m = (u * torch.logspace(0, -5.3, 192, dtype=F64)) @ v.T
    m32 = m.to(F32)
    left, _, right = torch.linalg.svd(m32.to(F64))  # full rank: the polar factor U Vᵀ is unique
    assert float((R.polar(m32).q.to(F64) - left @ right).abs().max()) <= 1e-5
    assert float((R.polar(m32.to(F64)).q - left @ right).abs().max()) <= 1e-9


@pytest.mark.usefixtures("auto_is_eigh")
def test_zero_m_gives_the_identity():
    out = R.polar(torch.zeros(5, 5, dtype=F64))
    torch.testing.assert_close(out.q, torch.eye(5, dtype=F64))
    assert out.info["solver"] == "eigh"


@pytest.mark.usefixtures("auto_is_eigh")
def test_eigh_path_is_used_when_it_passes_its_checks():
    m, _, _ = make_m(64, 52, 3.0, seed=1)
    out = R.polar(m)
    assert out.info["solver"] == "eigh" and out.info["optimality_gap"] <= R.tolerance(64, F64)
    assert out.info["polish_steps"] >= 0 and out.info["asymmetry"] <= R.tolerance(64, F64)
    a = out.q.T @ m
    assert float((a - a.T).norm()) / (2 * float(m.norm())) == pytest.approx(out.info["asymmetry"], rel=1e-6)


@pytest.mark.usefixtures("auto_is_eigh")
def test_ill_conditioned_m_falls_back_to_svd_and_records_why():
    """σ down to 1e-10·σ₁ cannot be resolved from MᵀM in float64: the check fails, the SVD is used, recorded."""
    m, _, _ = make_m(30, 30, 10.0, seed=2)
    out = R.polar(m)
    assert out.info["solver"] == "eigh+svd-fallback" and ("not resolved" in out.info["fallback_reason"]
                                                          or " > " in out.info["fallback_reason"])
    torch.testing.assert_close(out.q, reference(m, 30)[0], rtol=0, atol=1e-4)
    with pytest.raises(RuntimeError, match="eigh rotation solver failed its check"):
        R.polar(m, "eigh")


@pytest.mark.usefixtures("auto_is_eigh")
def test_spectrum_through_the_null_cut_goes_to_the_svd_without_polishing():
    """σ log-spaced down to 1e-8·σ₁ (n = 60): eigenvalues of MᵀM run through eigh's cut 60·eps·λ₁, so some lie
    just above it, neither null nor resolved: the SVD is taken at once (no polish, the reason recorded)."""
    m, _, _ = make_m(60, 60, 8.0, seed=5)
    evals = torch.linalg.eigvalsh(m.T @ m)
    cut = 60 * EPS64 * float(evals[-1])
    assert bool(((evals > cut) & (evals < R.UNRESOLVED * cut)).any())
    out = R.polar(m)
    assert out.info["solver"] == "eigh+svd-fallback" and "not resolved" in out.info["fallback_reason"]
    assert "polish_steps" not in out.info
    torch.testing.assert_close(out.q, R.polar(m, "svd").q, rtol=0, atol=1e-12)
    with pytest.raises(RuntimeError, match="not resolved by eigh"):
        R.polar(m, "eigh")


def test_float32_m_gives_an_orthogonal_float32_q():
    m, _, _ = make_m(256, 208, 2.0, seed=3)
    out = R.polar(m.to(F32))
    assert out.q.dtype == F32 and out.info["orthogonality_error"] <= R.tolerance(256, F32)
    assert out.info["orthogonality_error"] == pytest.approx(orth_error(out.q), rel=1e-6)
    assert float((out.q.to(F64) - reference(m, 208)[0]).norm()) <= 1e-3


@pytest.mark.usefixtures("auto_is_eigh")
@settings(max_examples=40, deadline=None)
@given(st.integers(8, 64), st.floats(0, 2), st.integers(0, 10_000))
def test_float32_m_is_polished_to_float32s_tolerance_only(n, log10_cond, seed):
    """A float32 M (condition ≤ 100): eigh's float64 Q already meets float32's checks (initial error
    ~κ²·n·eps64 ≪ c·n·eps32), so no Newton–Schulz step runs, and the float32 Q is the float64 polar
    factor of that M up to rounding Q to float32 (‖·‖_F ≤ √n·eps32)."""
    m32 = make_m(n, n, log10_cond, seed)[0].to(F32)
    out = R.polar(m32)
    tol = R.tolerance(n, F32)
    assert out.info["solver"] == "eigh" and out.info["polish_steps"] == 0
    assert out.q.dtype == F32 and orth_error(out.q) <= tol and out.info["asymmetry"] <= tol
    q_ref, _ = reference(m32.to(F64), n)
    bound = n**0.5 * torch.finfo(F32).eps + 100 * n * EPS64 * 10 ** (2 * log10_cond)
    assert float((out.q.to(F64) - q_ref).norm()) <= bound


def test_newton_schulz_squares_the_error_each_step():
    """E' = −¾E² + ¼E³, so ‖E'‖ ≤ ‖E‖² (down to rounding); _polish stops at its target."""
    g = torch.Generator().manual_seed(4)
    start = random_orthogonal(40, g) + 1e-3 * torch.randn(40, 40, generator=g, dtype=F64)
    q, errors = start, [orth_error(start)]
    for _ in range(2):
        q = q - 0.5 * q @ (q.T @ q - torch.eye(40, dtype=F64))
        errors.append(orth_error(q))
    assert errors[1] <= errors[0] ** 2 and errors[2] <= max(errors[1] ** 2, 40 * EPS64)
    polished, steps, error = R._polish(start, target=R.tolerance(40, F64))
    assert orth_error(polished) == pytest.approx(error, abs=1e-15) and error <= R.tolerance(40, F64) and 1 <= steps <= 3


def test_bad_solver_and_shape_are_rejected():
    with pytest.raises(ValueError, match="'qr'.*allowed: auto, eigh, svd, official"):
        R.polar(torch.eye(3, dtype=F64), "qr")
    with pytest.raises(ValueError, match=r"square.*\(2, 3\)"):
        R.polar(torch.ones(2, 3, dtype=F64))


# --- compensators: the default path keeps today's weights -----------------------------------------

def problem(d_out: int, d_in: int, n_tokens: int, n_drop: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(d_out, d_in, generator=g, dtype=F64)
    x = torch.randn(d_in, n_tokens, generator=g, dtype=F64) * (torch.rand(d_in, 1, generator=g, dtype=F64) + 0.5)
    perm = torch.randperm(d_in, generator=g)
    return w, x, perm[n_drop:].sort().values, perm[:n_drop].sort().values


def svd_today(w, x, kept) -> torch.Tensor:
    """Today's (and the paper's) Q = U Vᵀ of M = Y Zᵀ from the materialised matrices."""
    u, _, vh = torch.linalg.svd((w @ x) @ (w[:, kept] @ x[kept]).T)
    return u @ vh


# full rank; d_out > k (rank M = rank W_K = k < d_out, pruned heads); d_out = k; o_proj-like square.
UNIQUE = [(12, 20, 200, 5), (16, 12, 120, 4), (10, 14, 100, 4), (48, 48, 300, 9)]


@pytest.mark.parametrize("shape", UNIQUE, ids=str)
@pytest.mark.parametrize("solver", ["auto", "eigh", "svd"])
def test_default_path_gives_todays_weights(shape, solver):
    w, x, kept, pruned = problem(*shape, seed=sum(shape))
    stats = ActivationStats.from_activations(x.T)
    expected = svd_today(w, x, kept) @ w[:, kept]
    for fn in (C.procrustes, C.scaled_procrustes):
        out = fn(w, stats, kept, pruned, solver=solver)
        assert out.info["span"] == ("kept columns" if len(kept) < w.shape[0] else "outputs")
        want = expected * (out.info["scale"] if fn is C.scaled_procrustes else 1.0)
        assert float((out.weight - want).norm()) <= 1e-10 * float(want.norm())
    zk = w[:, kept] @ x[kept]
    scale = float(torch.linalg.svdvals((w @ x) @ zk.T).sum()) / float((zk * zk).sum())
    assert C.scaled_procrustes(w, stats, kept, pruned, solver=solver).info["scale"] == pytest.approx(scale, rel=1e-11)


@pytest.mark.parametrize("d_out,d_in,n_tokens,n_drop", [(12, 16, 6, 3), (8, 10, 3, 2), (20, 12, 5, 4)])
def test_few_tokens_give_the_closest_to_identity_rotation(d_out, d_in, n_tokens, n_drop):
    """N < k: rank M = N < rank W_K, so Q W_K depends on the completion: the reference's, closest to I."""
    w, x, kept, pruned = problem(d_out, d_in, n_tokens, n_drop, seed=d_out + n_tokens)
    m = (w @ x) @ (w[:, kept] @ x[kept]).T
    q_ref, _ = reference(m, n_tokens)
    for solver in ("auto", "eigh"):
        out = C.procrustes(w, ActivationStats.from_activations(x.T), kept, pruned, solver=solver)
        assert out.info["solver"] == {"auto": "svd", "eigh": "eigh"}[solver]  # auto on the CPU: the SVD
        torch.testing.assert_close(out.weight, q_ref @ w[:, kept], rtol=0, atol=1e-9 * float(w.abs().max()))


@pytest.mark.parametrize("solver", ["auto", "eigh", "svd"])
def test_rank_deficient_kept_span_solves_the_square_problem(solver):
    """k < d_out and N ≥ k tokens, but only 5 distinct ones: rank B = 5 < k, so Q W_K depends on the completion;
    the square M is solved (span 'outputs') and gives the reference's closest-to-identity Q."""
    w, x, kept, pruned = problem(12, 10, 5, 2, seed=3)
    x = x.repeat(1, 4)  # N = 20 ≥ k = 8, rank 5
    m = (w @ x) @ (w[:, kept] @ x[kept]).T
    out = C.procrustes(w, ActivationStats.from_activations(x.T), kept, pruned, solver=solver)
    assert out.info["span"] == "outputs"
    torch.testing.assert_close(out.weight, reference(m, 5)[0] @ w[:, kept], rtol=0, atol=1e-9 * float(w.abs().max()))


def test_float32_at_llama_like_rank_deficiency_passes_the_contract():
    """o_proj-like: d_out = 128 > k = 104 kept columns, float32 compute, through the registry's check."""
    w, x, kept, pruned = problem(128, 128, 400, 24, seed=5)
    stats = ActivationStats.from_activations(x.T)
    out = default_registry().compensator("scaled-procrustes")(w, stats, kept, pruned, dtype="float32")
    assert out.info["solver"] == "svd" and out.info["compute_dtype"] == "float32"  # auto on the CPU
    assert out.info["orthogonality_error"] <= R.tolerance(128, F32)
    want = svd_today(w, x, kept) @ w[:, kept] * out.info["scale"]
    assert float((out.weight - want).norm()) <= 1e-4 * float(want.norm())


def test_records_keep_the_solver_name_as_json():
    w, x, kept, pruned = problem(6, 8, 40, 2, seed=6)
    out = default_registry().compensator("procrustes")(w, ActivationStats.from_activations(x.T), kept, pruned,
                                                       solver="svd")
    info = json.loads(json.dumps(out.info))
    assert info["solver"] == "svd" and info["compute_dtype"] == "float64" and info["det_sign"] in (-1.0, 1.0)


# --- the official numerics and the contract's explicit opt-out ------------------------------------

def test_official_solver_is_the_float32_svd_and_records_its_error():
    w, x, kept, pruned = problem(10, 12, 60, 3, seed=7)
    stats = ActivationStats.from_activations(x.T)
    out = default_registry().compensator("procrustes")(w, stats, kept, pruned, dtype="float32", solver="official")
    m32 = (w @ stats.gram)[:, kept].float() @ w[:, kept].float().T
    u, _, vh = torch.linalg.svd(m32, full_matrices=False)
    torch.testing.assert_close(out.weight, (u @ vh) @ w[:, kept].float(), check_dtype=False, rtol=0, atol=1e-6)
    assert out.info["solver"] == "official" and out.info["orthogonality_unchecked"]
    assert out.info["orthogonality_error"] == pytest.approx(orth_error(u @ vh), rel=1e-6)
    with pytest.raises(ValueError, match="solver='official'.*dtype='float32'"):
        C.procrustes(w, stats, kept, pruned, solver="official")


def _fake(info):
    def compensate(weight, stats, kept, pruned):
        return C.Compensation(weight[:, kept].clone(), None, dict(info))
    return compensate


@pytest.mark.parametrize("info,problem_text", [
    ({"orthogonality_error": 1e-3, "compute_dtype": "float64"}, "0.001 >"),
    ({"orthogonality_error": 0.0669, "compute_dtype": "float32"}, "0.0669 >"),
    ({"orthogonality_error": 0.0669, "orthogonality_unchecked": ""}, "non-empty string"),
    ({"orthogonality_error": 0.0, "compute_dtype": "int8"}, "compute_dtype='int8'"),
    ({"orthogonality_error": 0.0669, "orthogonality_unchecked": "reproducing X on purpose"}, None),
    ({"orthogonality_error": 1e-5, "compute_dtype": "float32"}, None),
])
def test_contract_tolerance_scales_with_dtype_and_opt_out_is_explicit(info, problem_text):
    from rcpu_bench.registry import Method

    method = Method("compensator", "fake", _fake(info), "tests")
    x = torch.randn(40, 6, dtype=F64)
    args = (torch.randn(64, 6), ActivationStats.from_activations(x), torch.tensor([0, 1, 2]), torch.tensor([3, 4, 5]))
    if problem_text is None:
        assert method(*args).info == info
    else:
        with pytest.raises(PluginContractError, match=problem_text.replace("(", r"\(")):
            method(*args)


def test_official_alias_labels_its_records_and_no_other():
    official = PruneConfig(**RECIPES["rcpu-official"].prune).to_dict()
    assert label_of(official) == "RCPU (Rot., official numerics)"
    for fields, label in [({}, "RCPU (Rot.)"), ({"compensator_params": {"dtype": "float32"}}, "RCPU (Rot.)"),
                          ({"scorer_params": {"activation": "mean-abs"}}, "RCPU (Rot.)"),
                          ({"compensator": "scaled-procrustes"}, "RCPU (Rot.+Scale)")]:
        assert label_of(PruneConfig(**{"scorer": "variance", "compensator": "procrustes", **fields}).to_dict()) == label


def test_official_alias_prunes_a_model_and_records_the_unchecked_error():
    model = tiny_model(tiny_config())
    config = PruneConfig(ratio=0.5, **RECIPES["rcpu-official"].prune)
    config.validate(default_registry())
    report = prune_model(model, tokens(model.config.vocab_size, batch=4, length=16), config, progress=False,
                         registry=default_registry())
    modules = [m["info"] for layer in report.layers for m in layer.values() if isinstance(m, dict)
               and "solver" in m.get("info", {})]
    assert modules and all(m["solver"] == "official" and m["orthogonality_unchecked"] for m in modules)
    json.dumps(report.layers)
