"""Every statistics path (G, C = Σ y xᵀ, both; S = Σ y yᵀ with C_D = Σ y x_Dᵀ for a selection fixed
before the pass) gives the float64 reference's compensated weights, and the collected set is the flop model's
minimum.

References are computed here from explicit activations X (d_in × N) in float64: Y = W X, Z = W_K X_K.
Stated tolerances: a float64 module's statistics give the reference to 1e-9 (relative to max|W̃|); a
float32 module's mixed-precision statistics (float32 products summed in float64, y the module's float32
output) to 1e-4 on these well-conditioned problems (N ≥ 4·d_in tokens): float32 rounding (6e-8) times the
conditioning of G_KK and M.
"""

from __future__ import annotations

import copy
import math
from unittest import mock

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_models import tiny_config, tiny_model, tokens
from torch import nn

import rcpu_bench.statistics.activations as stats_module
import rcpu_bench.statistics.flops as flops_module
from rcpu_bench import hookspecs
from rcpu_bench.compensation import compensators as C
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.statistics.activations import ActivationStats, collect_input_stats
from rcpu_bench.statistics.flops import cheapest_statistics, expected_kept, statistics_flops

F64 = torch.float64
UNIT_ROUNDOFF_F32 = 2.0**-24
MIXED_TOLERANCE = 1e-4
FLOAT64_TOLERANCE = 1e-9
LAM = 1e-2
PATHS = {"procrustes": ({"cross"}, {"gram"}, {"gram", "cross"}, {"dropped_cross"}),
         "ridge": ({"gram"}, {"gram", "cross"}),
         "scaled-procrustes": ({"gram"}, {"gram", "cross"})}


def reference(compensator: str, W: torch.Tensor, X: torch.Tensor, K: torch.Tensor) -> torch.Tensor:
    """W̃_K from explicit float64 activations: the paper's closed forms, by SVD and explicit solves."""
    Y, XK, WK = W @ X, X[K], W[:, K]
    Z = WK @ XK
    if compensator == "ridge":
        A = XK @ XK.T + LAM * torch.eye(len(K), dtype=F64)
        return torch.linalg.solve(A, (Y @ XK.T + LAM * WK).T).T
    u, sigma, vh = torch.linalg.svd(Y @ Z.T)
    Q = u @ vh
    scale = float(sigma.sum() / Z.square().sum()) if compensator == "scaled-procrustes" else 1.0
    return scale * Q @ WK


def problem(d_out: int, d_in: int, seed: int, dtype: torch.dtype):
    """A linear module with a bias, 4·d_in tokens of inputs, and a random kept set of about 3/4 of the columns."""
    g = torch.Generator().manual_seed(seed)
    module = nn.Linear(d_in, d_out, bias=True, dtype=dtype)
    with torch.no_grad():
        module.weight.copy_(torch.randn(d_out, d_in, generator=g, dtype=F64))
        module.bias.copy_(torch.randn(d_out, generator=g, dtype=F64))
    x = (torch.randn(4 * d_in, d_in, generator=g, dtype=F64) + 0.3).to(dtype)  # tokens × d_in
    K = torch.randperm(d_in, generator=g)[: max(1, 3 * d_in // 4)].sort().values
    D = torch.tensor(sorted(set(range(d_in)) - set(K.tolist())), dtype=torch.long)
    return module, x, K, D


def collected(module: nn.Linear, x: torch.Tensor, kinds: set[str], dropped: torch.Tensor | None = None
              ) -> ActivationStats:
    """Statistics of ``kinds`` streamed by the forward hook over two batches, in mixed precision (S and C_D over
    the ``dropped`` columns for "dropped_cross")."""
    with torch.no_grad(), collect_input_stats(
            {"m": module}, with_gram="gram" in kinds, with_cross="cross" in kinds,
            dropped={"m": dropped} if "dropped_cross" in kinds else None) as stats:
        for batch in x.chunk(2):
            module(batch)
    return stats["m"]


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(sorted(PATHS)), st.integers(2, 9), st.integers(2, 12), st.integers(0, 10_000),
       st.sampled_from([F64, torch.float32]), st.data())
def test_every_statistics_path_gives_the_float64_reference(compensator, d_out, d_in, seed, dtype, data):
    kinds = data.draw(st.sampled_from(PATHS[compensator]))
    module, x, K, D = problem(d_out, d_in, seed, dtype)
    W = module.weight.detach().to(F64)
    want = reference(compensator, W, x.T.to(F64), K)
    params = {"lam": LAM} if compensator == "ridge" else {}
    out = getattr(C, compensator.replace("-", "_"))(module.weight, collected(module, x, kinds, D), K, D, **params)
    tolerance = FLOAT64_TOLERANCE if dtype == F64 else MIXED_TOLERANCE
    assert float((out.weight.to(F64) - want).abs().max()) <= tolerance * float(want.abs().max())


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 40), st.integers(1, 4), st.integers(1, 15),
       st.integers(0, 10_000))
def test_mixed_cross_statistic_is_within_float32_rounding(d_out, d_in, n_tokens, block, chunk, seed):
    """|C_mixed − Y Xᵀ| ≤ (n_c + 1)·u·(|Y||X|ᵀ) entry by entry, Y the float32 outputs given to the hook."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, d_in, generator=g).float()
    y = torch.randn(n_tokens, d_out, generator=g).float()
    with mock.patch.object(stats_module, "GRAM_BLOCK", block), mock.patch.object(stats_module, "CHUNK_TOKENS", chunk):
        stats = ActivationStats.from_activations(x, with_gram=False, outputs=y, with_cross=True)
    x64, y64 = x.to(F64), y.to(F64)
    bound = (min(chunk, n_tokens) + 1) * UNIT_ROUNDOFF_F32 * (y64.abs().T @ x64.abs())
    assert ((stats.cross - y64.T @ x64).abs() <= bound * (1 + 1e-9) + 1e-300).all()
    assert float(stats.out_sq_sum) == pytest.approx(float(y64.square().sum()), rel=1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 40), st.integers(1, 4), st.integers(1, 15),
       st.integers(0, 10_000), st.data())
def test_mixed_output_gram_and_dropped_cross_are_within_float32_rounding(d_out, d_in, n_tokens, block, chunk, seed,
                                                                         data):
    """|S_mixed − Y Yᵀ| ≤ (n_c + 1)·u·(|Y||Y|ᵀ) and |C_D − Y X_Dᵀ| ≤ (n_c + 1)·u·(|Y||X_D|ᵀ), entry by entry."""
    dropped = torch.tensor(data.draw(st.lists(st.integers(0, d_in - 1), max_size=d_in, unique=True)), dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_tokens, d_in, generator=g).float()
    y = torch.randn(n_tokens, d_out, generator=g).float()
    with mock.patch.object(stats_module, "GRAM_BLOCK", block), mock.patch.object(stats_module, "CHUNK_TOKENS", chunk):
        stats = ActivationStats.from_activations(x, with_gram=False, outputs=y, dropped=dropped)
    x64, y64 = x.to(F64)[:, dropped], y.to(F64)
    rounding = (min(chunk, n_tokens) + 1) * UNIT_ROUNDOFF_F32
    assert stats.kinds == {"dropped_cross"} and stats.out_gram is not None and stats.dropped_cross is not None
    assert torch.equal(stats.out_gram, stats.out_gram.T)
    assert ((stats.out_gram - y64.T @ y64).abs() <= rounding * (y64.abs().T @ y64.abs()) * (1 + 1e-9) + 1e-300).all()
    assert ((stats.dropped_cross - y64.T @ x64).abs() <= rounding * (y64.abs().T @ x64.abs()) * (1 + 1e-9)
            + 1e-300).all()


@pytest.mark.parametrize("dtype", [F64, torch.float32])
@pytest.mark.parametrize("d_out,d_in,span", [(9, 8, "kept columns"), (4, 12, "outputs")])
def test_procrustes_from_s_and_dropped_cross_on_both_spans(d_out, d_in, span, dtype):
    """M = S − C_D W_Dᵀ, solved on W_K's span (k < d_out: B = M P) and on the outputs, gives the reference."""
    module, x, K, D = problem(d_out, d_in, seed=11, dtype=dtype)
    W = module.weight.detach().to(F64)
    want = reference("procrustes", W, x.T.to(F64), K)
    out = C.procrustes(module.weight, collected(module, x, {"dropped_cross"}, D), K, D)
    assert out.info["span"] == span and "objective_after" not in out.info  # no G: no objective
    tolerance = FLOAT64_TOLERANCE if dtype == F64 else MIXED_TOLERANCE
    assert float((out.weight.to(F64) - want).abs().max()) <= tolerance * float(want.abs().max())


def test_dropped_statistics_merge_and_refuse_another_selection():
    """Two halves merged equal one pass; S and C_D of another selection are refused, naming both selections."""
    module, x, K, D = problem(5, 8, seed=4, dtype=F64)
    whole = collected(module, x, {"dropped_cross"}, D)
    halves = [collected(module, half, {"dropped_cross"}, D) for half in x.chunk(2)]
    halves[0].merge(halves[1])
    torch.testing.assert_close(halves[0].out_gram, whole.out_gram, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(halves[0].dropped_cross, whole.dropped_cross, rtol=1e-12, atol=1e-12)
    other = collected(module, x, {"dropped_cross"}, D[:-1])
    with pytest.raises(ValueError, match="dropped columns"):
        whole.merge(other)
    with pytest.raises(ValueError, match=r"collected for dropped columns .* but this problem drops"):
        C.procrustes(module.weight, other, K, D)
    with pytest.raises(ValueError, match=r"dropped columns must be .* in \[0, 8\)"):
        ActivationStats.empty(8, d_out=5, dropped=torch.tensor([3, 8]))


def test_cross_statistic_is_w_g_for_a_module_with_bias():
    """y − b = W x in the hook: C = W G and ‖Y‖² = tr(W G Wᵀ) for a float64 module."""
    module, x, _, _ = problem(5, 7, seed=3, dtype=F64)
    stats = collected(module, x, {"gram", "cross"})
    W = module.weight.detach()
    torch.testing.assert_close(stats.cross, W @ stats.gram, rtol=1e-12, atol=1e-10)
    assert float(stats.out_sq_sum) == pytest.approx(float(((W @ stats.gram) * W).sum()), rel=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.sampled_from(["none", "ridge", "procrustes", "scaled-procrustes"]), st.integers(2, 8), st.integers(2, 10),
       st.integers(0, 10_000))
def test_objective_from_each_path_is_the_direct_error(compensator, d_out, d_in, seed):
    """objective_before/after (G and C collected, ‖Y‖² from the outputs) against ‖Y − W̃ X_K‖² computed directly."""
    module, x, K, D = problem(d_out, d_in, seed, F64)
    X, W = x.T, module.weight.detach()
    params = {"lam": LAM} if compensator == "ridge" else {}
    out = getattr(C, compensator.replace("-", "_"))(module.weight, collected(module, x, {"gram", "cross"}), K, D,
                                                    **params)
    Y = W @ X
    scale = float(Y.square().sum())
    assert out.info["objective_before"] == pytest.approx(float((Y - W[:, K] @ X[K]).square().sum()), rel=1e-9,
                                                         abs=1e-11 * scale)
    assert out.info["objective_after"] == pytest.approx(float((Y - out.weight @ X[K]).square().sum()), rel=1e-7,
                                                        abs=1e-11 * scale)


def flops_by_hand(kinds: frozenset[str], need: str, n: int, d_out: int, d_in: int, k: int) -> float:
    """The documented model, written out: collecting G costs N·d_in², C 2·N·d_out·d_in, S and C_D
    N·d_out² + 2·N·d_out·|D|; then the float64 products (twice the float32 cost) that give what is read:
    for "cross" Y X_Kᵀ (from C nothing, from G W G[:,K] 2·d_out·d_in·k), for "output_cross" M (C[:,K] W_Kᵀ
    2·d_out²·k, W G[:,K] W_Kᵀ 2·d_out·d_in·k + 2·d_out²·k, S − C_D W_Dᵀ 2·d_out²·|D|)."""
    dropped = d_in - k
    by_kind = {"gram": n * d_in**2, "cross": 2 * n * d_out * d_in,
               "dropped_cross": n * d_out**2 + 2 * n * d_out * dropped}
    yxk_from = {frozenset({"cross"}): 0, frozenset({"gram"}): 2 * d_out * d_in * k}
    m_from = {frozenset({"cross"}): 2 * d_out**2 * k, frozenset({"gram"}): 2 * d_out * d_in * k + 2 * d_out**2 * k,
              frozenset({"dropped_cross"}): 2 * d_out**2 * dropped}
    products = {"cross": yxk_from, "output_cross": m_from}.get(need, {}).get(kinds, 0)
    return sum(by_kind[kind] for kind in kinds) + 2 * products


@pytest.mark.parametrize("selected", [False, True])
@pytest.mark.parametrize("need,sufficient", [("output_cross", [{"cross"}, {"gram"}]), ("cross", [{"cross"}, {"gram"}]),
                                             ("gram", [{"gram"}])])
@pytest.mark.parametrize("n,d_out,d_in", [(16384, 4096, 4096), (16384, 4096, 11008), (65536, 4096, 11008),
                                          (1024, 4096, 4096), (512, 5120, 13824), (262144, 5120, 5120)])
def test_the_collected_set_is_the_flop_minimum(need, sufficient, n, d_out, d_in, selected):
    """The minimum over the sufficient sets; S and C_D only when the selection is fixed before the pass."""
    sufficient = sufficient + ([{"dropped_cross"}] if selected and need == "output_cross" else [])
    k = expected_kept(d_in, 0.2)
    costs = {frozenset(s): flops_by_hand(frozenset(s), need, n, d_out, d_in, k) for s in sufficient}
    chosen = cheapest_statistics(need, n, d_out, d_in, k, selected=selected)
    assert costs[chosen] == min(costs.values()) == statistics_flops(chosen, need, n, d_out, d_in, k)
    assert cheapest_statistics(need, n, d_out, d_in, k, "float64", selected=selected) == {"gram"}


def test_the_flop_model_orders_the_public_needs():
    """Every need a plugin may declare has its sufficient sets, in the order of ``hookspecs.NEEDS``."""
    assert flops_module.NEEDS == hookspecs.NEEDS and set(flops_module.SUFFICIENT) == set(hookspecs.NEEDS)
    assert flops_module.strongest("cross", "output_cross", "moments") == "cross"


def test_llama_7b_shapes_choose_g_for_o_proj_and_c_for_down_proj():
    """One Llama-7B layer at 16,384 tokens: procrustes reads G for o_proj, C for down_proj; ridge G for both,
    with few tokens too (it reads G's blocks only, never Y X_Kᵀ)."""
    assert cheapest_statistics("output_cross", 16384, 4096, 4096, expected_kept(4096, 0.2)) == {"gram"}
    assert cheapest_statistics("output_cross", 16384, 4096, 11008, expected_kept(11008, 0.2)) == {"cross"}
    assert cheapest_statistics("output_cross", 1024, 4096, 4096, expected_kept(4096, 0.2)) == {"cross"}
    for n in (1024, 16384):
        assert cheapest_statistics("gram", n, 4096, 11008, expected_kept(11008, 0.2)) == {"gram"}
    # with the units chosen before the pass (AL-AM), S and C_D for both modules
    for d_in in (4096, 11008):
        assert cheapest_statistics("output_cross", 16384, 4096, d_in, expected_kept(d_in, 0.2), selected=True) == {
            "dropped_cross"}


def test_pipeline_collects_the_minimum_and_matches_the_float64_path():
    """A tiny model whose down_proj (with bias) reads C and whose o_proj reads G: the report names the set
    chosen by the flop model, and the weights equal those of the pure float64 path (G alone)."""
    config = tiny_config(hidden=24, intermediate=96, layers=2, mlp_bias=True)
    dense = tiny_model(config)
    ids = tokens(config.vocab_size, batch=8, length=32)
    n = ids.numel()
    models, reports = {}, {}
    for precision in ("mixed", "float64"):
        models[precision] = copy.deepcopy(dense)
        reports[precision] = prune_model(models[precision], ids, PruneConfig(
            compensator="procrustes", ratio=0.25, gram_precision=precision), progress=False,
            registry=default_registry())
    for layer in reports["mixed"].layers:
        attention_in = config.num_attention_heads * config.head_dim
        for module, (d_out, d_in) in {"attention": (24, attention_in), "mlp": (24, 96)}.items():
            want = cheapest_statistics("output_cross", n, d_out, d_in, expected_kept(d_in, 0.25))
            assert layer[module]["statistics"] == "+".join(sorted(want))
        assert layer["attention"]["statistics"] == "gram" and layer["mlp"]["statistics"] == "cross"
    assert all(layer[m]["statistics"] == "gram" for layer in reports["float64"].layers for m in ("attention", "mlp"))
    for (name, mixed), reference_weight in zip(models["mixed"].state_dict().items(),
                                               models["float64"].state_dict().values(), strict=True):
        scale = float(reference_weight.abs().max())
        assert math.isclose(float((mixed - reference_weight).abs().max()), 0, abs_tol=MIXED_TOLERANCE * scale), name


def test_pipeline_with_units_fixed_before_the_pass_collects_s_and_c_d():
    """AL-AM fixes every layer's units before the statistics passes: down_proj (with bias) reads S and C_D
    (the flop model's minimum at 24 outputs, 96 inputs), and the weights equal the pure float64 path's (G alone)."""
    config = tiny_config(hidden=24, intermediate=96, layers=2, mlp_bias=True)
    dense = tiny_model(config)
    ids = tokens(config.vocab_size, batch=8, length=32)
    models, reports = {}, {}
    for precision in ("mixed", "float64"):
        models[precision] = copy.deepcopy(dense)
        reports[precision] = prune_model(models[precision], ids, PruneConfig(
            compensator="procrustes", ratio=0.25, structure="al-am", gram_precision=precision), progress=False,
            registry=default_registry())
    for layer in reports["mixed"].layers:
        kept = layer["mlp"]["units_total"] - layer["mlp"]["units_pruned"]
        assert cheapest_statistics("output_cross", ids.numel(), 24, 96, kept, selected=True) == {"dropped_cross"}
        assert layer["mlp"]["statistics"] == "dropped_cross"
    for mixed_layer, reference_layer in zip(reports["mixed"].layers, reports["float64"].layers, strict=True):
        assert mixed_layer["mlp"]["pruned_units"] == reference_layer["mlp"]["pruned_units"]
    for (name, mixed), reference_weight in zip(models["mixed"].state_dict().items(),
                                               models["float64"].state_dict().values(), strict=True):
        scale = float(reference_weight.abs().max())
        assert math.isclose(float((mixed - reference_weight).abs().max()), 0, abs_tol=MIXED_TOLERANCE * scale), name
