"""ActivationStats against direct float64 statistics of a materialised activation matrix X (d_in × N)."""

from unittest import mock

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import rcpu_bench.statistics.activations as stats_module
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig
from rcpu_bench.statistics.activations import ActivationStats, collect_input_stats

F64 = torch.float64


def make_X(d_in: int, n_tokens: int, seed: int, offset: float = 0.5) -> torch.Tensor:
    """Calibration inputs X (d_in × N) with per-channel scales and non-zero means, so E[x] ≠ 0."""
    g = torch.Generator().manual_seed(seed)
    scales = torch.rand(d_in, 1, generator=g, dtype=F64) * 2 + 0.1
    means = (torch.rand(d_in, 1, generator=g, dtype=F64) - 0.5) * 2 * offset
    return torch.randn(d_in, n_tokens, generator=g, dtype=F64) * scales + means


def stats_of(X: torch.Tensor, with_gram: bool = True) -> ActivationStats:
    """Statistics of X (d_in × N) fed as one batch of N tokens (token-major, as a module sees them)."""
    return ActivationStats.from_activations(X.T, with_gram=with_gram)


def assert_same_stats(a: ActivationStats, b: ActivationStats) -> None:
    assert a.n == b.n
    for name in ("sum", "abs_sum", "sq_sum"):
        torch.testing.assert_close(getattr(a, name), getattr(b, name), rtol=1e-12, atol=1e-10)
    assert (a.gram is None) == (b.gram is None)
    if a.gram is not None:
        torch.testing.assert_close(a.gram, b.gram, rtol=1e-12, atol=1e-10)


shapes = st.tuples(st.integers(1, 7), st.integers(2, 30), st.integers(0, 10_000))


# --- moments against direct computation -------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(shapes)
def test_moments_match_direct_computation(shape):
    d_in, n_tokens, seed = shape
    X = make_X(d_in, n_tokens, seed)
    s = stats_of(X)
    x = X.numpy()
    assert s.n == n_tokens and s.d_in == d_in
    np.testing.assert_allclose(s.mean.numpy(), x.mean(axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.mean_abs.numpy(), np.abs(x).mean(axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(s.l2_norm.numpy(), np.sqrt((x * x).sum(axis=1)), rtol=1e-12)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_variance_is_population_variance(shape):
    d_in, n_tokens, seed = shape
    X = make_X(d_in, n_tokens, seed)
    np.testing.assert_allclose(stats_of(X).variance.numpy(), np.var(X.numpy(), axis=1, ddof=0), rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_sample_variance_is_unbiased_variance(shape):
    d_in, n_tokens, seed = shape
    X = make_X(d_in, n_tokens, seed)
    np.testing.assert_allclose(stats_of(X).sample_variance.numpy(), np.var(X.numpy(), axis=1, ddof=1),
                               rtol=1e-9, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(shapes)
def test_gram_is_X_Xt(shape):
    d_in, n_tokens, seed = shape
    X = make_X(d_in, n_tokens, seed)
    x = X.numpy()
    np.testing.assert_allclose(stats_of(X).gram.numpy(), x @ x.T, rtol=1e-12, atol=1e-10)


def test_constant_channel_has_zero_variance_not_negative():
    X = torch.full((3, 50), 0.1, dtype=F64)
    s = stats_of(X)
    assert (s.variance >= 0).all()
    torch.testing.assert_close(s.variance, torch.zeros(3, dtype=F64), atol=1e-15, rtol=0)


def test_float64_gram_of_float32_inputs_is_exact():
    X = make_X(4, 20, seed=1)
    s = ActivationStats.from_activations(X.T.to(torch.float32), gram_precision="float64")
    assert s.sum.dtype == s.gram.dtype == F64
    x32 = X.to(torch.float32).to(F64)
    torch.testing.assert_close(s.gram, x32 @ x32.T, rtol=1e-12, atol=1e-10)


UNIT_ROUNDOFF_F32 = 2.0**-24


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 12), st.integers(1, 60), st.integers(1, 5), st.integers(1, 25), st.integers(0, 10_000),
       st.sampled_from([torch.float32, torch.bfloat16]))
def test_mixed_gram_is_within_float32_rounding_of_float64(d_in, n_tokens, block, chunk, seed, dtype):
    """|G_mixed − G_64| ≤ (n_c + 1)·u·(|X||X|ᵀ): a float32 dot product of n_c terms plus its rounding.

    G_64 is the exact float64 Gram of the same (float32 or bfloat16) inputs; blocks and chunks are tiny so
    that the upper-triangle blocks, their mirror and several chunks are all exercised.
    """
    x = make_X(d_in, n_tokens, seed).T.to(dtype)  # tokens × d_in, as a module sees them
    with mock.patch.object(stats_module, "GRAM_BLOCK", block), mock.patch.object(stats_module, "CHUNK_TOKENS", chunk):
        mixed = ActivationStats.from_activations(x).gram
    x64 = x.to(F64)
    exact = x64.T @ x64
    bound = (min(chunk, n_tokens) + 1) * UNIT_ROUNDOFF_F32 * (x64.abs().T @ x64.abs())
    assert mixed.dtype == F64
    assert torch.equal(mixed, mixed.T)
    assert ((mixed - exact).abs() <= bound * (1 + 1e-9) + 1e-300).all()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 9), st.integers(1, 9), st.integers(1, 12), st.integers(1, 40), st.integers(0, 10_000))
def test_add_product_in_slices_equals_one_add_of_the_float32_product(d_left, d_right, n_tokens, add_slice, seed):
    """sums + leftᵀ right, added slice by slice, is bit for bit the one-step add; the float32 product itself
    is within (n + 1)·u·(|L|ᵀ|R|) of the float64 product."""
    g = torch.Generator().manual_seed(seed)
    left, right = torch.randn(n_tokens, d_left, generator=g), torch.randn(n_tokens, d_right, generator=g)
    start = torch.randn(d_left, d_right, generator=g, dtype=F64)
    sliced = start.clone()
    with mock.patch.object(stats_module, "ADD_SLICE", add_slice):
        stats_module.add_product(sliced, left, right)
    assert torch.equal(sliced, start + (left.T @ right).to(F64))
    l64, r64 = left.to(F64), right.to(F64)
    bound = (n_tokens + 1) * UNIT_ROUNDOFF_F32 * (l64.abs().T @ r64.abs()) + 4 * 2.0**-53 * start.abs()
    assert ((sliced - (start + l64.T @ r64)).abs() <= bound * (1 + 1e-9) + 1e-300).all()


def test_unknown_gram_precision_is_rejected():
    with pytest.raises(ValueError, match="gram_precision='float16'; allowed: mixed, float64"):
        ActivationStats.empty(3, gram_precision="float16")


@settings(max_examples=25, deadline=None)
@given(st.integers(2, 9), st.integers(1, 4), st.integers(0, 10_000))
def test_reading_gram_between_updates_keeps_it_exact(d_in, block, seed):
    """The lower triangle is mirrored on read; later updates (upper only) must show up on the next read."""
    X = make_X(d_in, 12, seed)
    s = ActivationStats.empty(d_in)
    with mock.patch.object(stats_module, "GRAM_BLOCK", block):
        s.update(X[:, :5].T)
        first = s.gram.clone()
        s.update(X[:, 5:].T)
        second = s.gram
    x = X.numpy()
    np.testing.assert_allclose(first.numpy(), x[:, :5] @ x[:, :5].T, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(second.numpy(), x @ x.T, rtol=1e-12, atol=1e-10)


def test_without_gram_keeps_moments_only():
    X = make_X(5, 12, seed=2)
    s = stats_of(X, with_gram=False)
    assert s.gram is None
    np.testing.assert_allclose(s.mean.numpy(), X.numpy().mean(axis=1), rtol=1e-12)


def test_without_gram_require_gram_raises_clear_error():
    s = stats_of(make_X(3, 10, seed=3), with_gram=False)
    with pytest.raises(ValueError, match="Gram"):
        s.require_gram()


# --- errors -----------------------------------------------------------------------------------------

def test_empty_stats_refuse_mean_and_variance():
    s = ActivationStats.empty(4)
    for prop in ("mean", "mean_abs", "variance"):
        with pytest.raises(ValueError, match="no calibration tokens"):
            getattr(s, prop)


def test_sample_variance_needs_two_tokens():
    s = stats_of(make_X(3, 1, seed=4))
    with pytest.raises(ValueError, match="N=1"):
        _ = s.sample_variance


def test_update_rejects_wrong_width():
    s = ActivationStats.empty(4)
    with pytest.raises(ValueError, match="5"):
        s.update(torch.zeros(2, 5))


@pytest.mark.parametrize("other", [ActivationStats.empty(5), ActivationStats.empty(4, with_gram=False)])
def test_merge_rejects_different_width_or_kind(other):
    with pytest.raises(ValueError, match="cannot merge"):
        ActivationStats.empty(4).merge(other)


# --- streaming --------------------------------------------------------------------------------------

@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.lists(st.integers(1, 9), min_size=1, max_size=8), st.integers(0, 10_000))
def test_many_small_batches_equal_one_big_batch(d_in, batch_sizes, seed):
    X = make_X(d_in, sum(batch_sizes), seed)
    streamed = ActivationStats.empty(d_in)
    start = 0
    for size in batch_sizes:
        streamed.update(X[:, start:start + size].T)
        start += size
    assert_same_stats(streamed, stats_of(X))


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 6), st.integers(2, 40), st.integers(1, 5), st.integers(1, 4), st.integers(0, 10_000),
       st.sampled_from(["mixed", "float64"]))
def test_chunked_update_equals_unchunked(d_in, n_tokens, chunk, block, seed, precision):
    """Float64 inputs: both precisions compute their products in float64, in chunks and (mixed) blocks."""
    X = make_X(d_in, n_tokens, seed)
    with mock.patch.object(stats_module, "CHUNK_TOKENS", chunk), mock.patch.object(stats_module, "GRAM_BLOCK", block):
        chunked = ActivationStats.from_activations(X.T, gram_precision=precision)
    x = X.numpy()
    assert chunked.n == n_tokens
    np.testing.assert_allclose(chunked.gram.numpy(), x @ x.T, rtol=1e-12, atol=1e-10)
    np.testing.assert_allclose(chunked.sum.numpy(), x.sum(axis=1), rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(chunked.abs_sum.numpy(), np.abs(x).sum(axis=1), rtol=1e-12)
    np.testing.assert_allclose(chunked.sq_sum.numpy(), (x * x).sum(axis=1), rtol=1e-12)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 6), st.integers(2, 30), st.data())
def test_merge_of_two_halves_equals_one_big_batch(d_in, n_tokens, data):
    X = make_X(d_in, n_tokens, data.draw(st.integers(0, 10_000)))
    cut = data.draw(st.integers(1, n_tokens - 1))
    first, second = stats_of(X[:, :cut]), stats_of(X[:, cut:])
    first.merge(second)
    assert_same_stats(first, stats_of(X))


def test_merge_without_gram_equals_one_big_batch():
    X = make_X(4, 20, seed=5)
    first, second = stats_of(X[:, :7], with_gram=False), stats_of(X[:, 7:], with_gram=False)
    first.merge(second)
    assert_same_stats(first, stats_of(X, with_gram=False))


def test_batched_3d_input_is_flattened_over_batch_and_sequence():
    X = make_X(5, 24, seed=6)
    batch = X.T.reshape(3, 8, 5)  # (batch, seq, d_in), tokens in the same order as X's columns
    assert_same_stats(ActivationStats.from_activations(batch), stats_of(X))


# --- collect_input_stats on a real nn.Linear --------------------------------------------------------

def linear(d_in: int, d_out: int, seed: int) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(d_in, d_out, bias=False, dtype=F64)


def test_collect_input_stats_on_linear_equals_one_big_batch():
    layer = linear(6, 4, seed=7)
    batches = [make_X(6, 2 * 5, seed=s).T.reshape(2, 5, 6) for s in range(4)]  # (batch, seq, d_in) each
    with torch.no_grad(), collect_input_stats({"proj": layer}) as collected:
        for batch in batches:
            layer(batch)
    X = torch.cat([b.reshape(-1, 6) for b in batches]).T  # d_in × N
    assert_same_stats(collected["proj"], stats_of(X))


@pytest.mark.parametrize("moment_block", [2, 64])
@pytest.mark.parametrize("chunk", [4, 7, 64])
def test_gathered_batches_equal_direct_float64_sums(chunk, moment_block):
    """Batches gathered up to CHUNK_TOKENS (fewer, longer updates; a batch of 9 holds whole chunks of 4 and 7)
    give the float64 sums of all tokens, C included, whatever the moments' block length."""
    layer = linear(6, 4, seed=12)
    batches = [make_X(6, n, seed=20 + n).T.reshape(1, n, 6) for n in (3, 5, 9, 2)]
    with mock.patch.object(stats_module, "CHUNK_TOKENS", chunk), \
            mock.patch.object(stats_module, "MOMENT_BLOCK", moment_block), torch.no_grad(), \
            collect_input_stats({"proj": layer}, with_cross=True) as collected:
        for batch in batches:
            layer(batch)
    X = torch.cat([b.reshape(-1, 6) for b in batches]).T  # d_in × N
    Y = layer.weight.detach() @ X  # d_out × N
    stats = collected["proj"]
    assert_same_stats(stats, stats_of(X))
    torch.testing.assert_close(stats.cross, Y @ X.T, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(stats.out_sq_sum, Y.square().sum(), rtol=1e-12, atol=1e-10)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 200_000))
def test_moment_blocks_are_the_cpu_s_64_tokens_or_bounded_by_elements_elsewhere(width):
    """On the CPU the moments' blocks stay MOMENT_BLOCK tokens; on an accelerator they grow to the element bound, but
    never below MOMENT_BLOCK tokens nor (above that) past DEVICE_MOMENT_ELEMENTS elements."""
    assert stats_module.moment_block(torch.device("cpu"), width) == stats_module.MOMENT_BLOCK
    block = stats_module.moment_block(torch.device("cuda"), width)
    assert block >= stats_module.MOMENT_BLOCK
    assert block == stats_module.MOMENT_BLOCK or block * width <= stats_module.DEVICE_MOMENT_ELEMENTS
    assert (block + 1) * width > stats_module.DEVICE_MOMENT_ELEMENTS or block == stats_module.MOMENT_BLOCK


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_statistics_equal_direct_float64_sums():
    """On CUDA (whole adds, element-bounded moment blocks) the sums equal the float64 sums of all tokens."""
    layer = linear(6, 4, seed=12).cuda()
    batches = [make_X(6, n, seed=20 + n).T.reshape(1, n, 6) for n in (3, 5, 9, 2)]
    with mock.patch.object(stats_module, "CHUNK_TOKENS", 7), torch.no_grad(), \
            collect_input_stats({"proj": layer}, with_cross=True) as collected:
        for batch in batches:
            layer(batch.cuda())
    X = torch.cat([b.reshape(-1, 6) for b in batches]).T  # d_in × N
    Y = layer.weight.detach().cpu() @ X  # d_out × N
    stats = collected["proj"]
    assert stats.device.type == "cuda"
    for name in ("sum", "abs_sum", "sq_sum"):
        torch.testing.assert_close(getattr(stats, name).cpu(), getattr(stats_of(X), name), rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(stats.cross.cpu(), Y @ X.T, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(stats.out_sq_sum.cpu(), Y.square().sum(), rtol=1e-12, atol=1e-10)


def test_gathered_batches_are_copies():
    """A later in-place change of the layer's input or output does not reach the held tokens."""
    layer = linear(3, 2, seed=13)
    x = make_X(3, 4, seed=14).T.reshape(1, 4, 3).clone()
    with torch.no_grad(), collect_input_stats({"proj": layer}) as collected:
        out = layer(x)
        expected = x.reshape(-1, 3).sum(0).clone()
        x.mul_(100)
        out.mul_(100)
    torch.testing.assert_close(collected["proj"].sum, expected, rtol=1e-12, atol=1e-12)


def test_collect_input_stats_removes_hooks_on_exit():
    layer = linear(3, 2, seed=8)
    with torch.no_grad():
        with collect_input_stats({"proj": layer}) as collected:
            layer(torch.ones(1, 4, 3, dtype=F64))
        layer(torch.ones(1, 4, 3, dtype=F64))
    assert collected["proj"].n == 4
    assert not layer._forward_pre_hooks


def test_collect_input_stats_gram_only_for_named_modules():
    up, down = linear(4, 6, seed=9), linear(6, 4, seed=10)
    x = make_X(4, 10, seed=11).T.reshape(2, 5, 4)
    with torch.no_grad(), collect_input_stats({"up": up, "down": down}, with_gram=["down"]) as collected:
        down(up(x))
    assert collected["up"].gram is None
    h = up(x).detach().reshape(-1, 6).T
    torch.testing.assert_close(collected["down"].gram, h @ h.T, rtol=1e-12, atol=1e-10)
    assert collected["up"].n == collected["down"].n == 10


@pytest.mark.parametrize("precision", ["mixed", "float64"])
def test_collect_input_stats_passes_gram_precision(precision):
    layer = nn.Linear(3, 2, bias=False)
    with torch.no_grad(), collect_input_stats({"proj": layer}, gram_precision=precision) as collected:
        layer(torch.ones(2, 3))
    assert collected["proj"].gram_precision == precision


def test_collect_input_stats_without_gram():
    layer = linear(3, 2, seed=12)
    with torch.no_grad(), collect_input_stats({"proj": layer}, with_gram=False) as collected:
        layer(torch.ones(2, 3, dtype=F64))
    assert collected["proj"].gram is None and collected["proj"].n == 2


def test_prune_config_rejects_unknown_gram_precision():
    with pytest.raises(ValueError, match="gram_precision='half' is not allowed; allowed: mixed, float64"):
        PruneConfig(gram_precision="half").validate(default_registry())
