"""Streaming second-order statistics of a linear module's inputs (and outputs).

For inputs x ∈ R^{d_in} and bias-free outputs y = W x ∈ R^{d_out} over N calibration tokens we keep,
summed in float64,

    N,  Σx,  Σ|x|,  Σx²,  ‖Y‖² = Σ‖y‖²  (the moments, always),
    G = Σ x xᵀ  and/or  C = Σ y xᵀ      (when a compensator needs them, ``statistics/flops.py`` chooses),
    S = Σ y yᵀ  and  C_D = Σ y x_Dᵀ     (instead, when the dropped columns D are fixed before the pass).

y is the module's own output in the forward hook, minus its bias: C = W G up to the rounding of y in the
module's dtype (exactly for a float64 module). ‖Y‖², C, S and C_D are collected in ``"mixed"`` precision only
(below): ``"float64"`` is the pure float64 reference path and collects G alone, from which every
quantity follows (``compensation/compensators.py``).

The moments are always computed in float64. G, the costly part (2·N·d_in² flops), has two precisions:

* ``"mixed"`` (default): each chunk's products X_cᵀX_c are computed in float32 (or the input's dtype
  if that is float64) and added into the float64 accumulator, block row by block row over the upper
  triangle only (G is symmetric; the lower triangle is mirrored when G is read), about half the flops
  of a full product at 2-4x the float64 rate on CPU. Per entry, |G_mixed − G_float64| ≤
  (n_c + 1)·u·Σ_n |x_in||x_jn| with u = 2⁻²⁴ and n_c ≤ ``CHUNK_TOKENS`` the chunk length (float32
  rounding of a length-n_c dot product and of its result); measured errors are far smaller (see
  ``benchmarks/README.md``). On CUDA, keep ``torch.backends.cuda.matmul.allow_tf32`` off (the default).
  C is accumulated the same way, block row by block row of ``GRAM_BLOCK`` output rows, with the same
  per-entry bound (|y_i||x_j| in place of |x_i||x_j|), and so are S (G's upper block triangle, of the
  outputs) and C_D (C's columns D).
* ``"float64"``: every product in float64, the full matrix, as a reference.

Because a linear module's dense output is Y = W X exactly, every quantity the paper's
compensators need follows from these sums (see ``compensators.py``); raw activations are never
stored, so memory does not grow with the calibration set.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal, get_args

import torch
from torch import Tensor, nn

GramPrecision = Literal["mixed", "float64"]
GRAM_PRECISIONS: tuple[str, ...] = get_args(GramPrecision)
# Tokens folded into the sums per step: the length of the held chunk (and n_c above).
CHUNK_TOKENS = 4096
# Tokens per float64 block of the moments: a 64 × d_in float64 copy stays small enough to be reused by the
# allocator (a whole chunk's float64 copy and its temporaries cost 13x as much, measured at d_in = 11,008).
MOMENT_BLOCK = 64
# Rows of G per block of the upper-triangle product (2-core Zen 3: 512, 1024 and 2048 within noise of each other;
# benchmarks/README.md, "Accumulation block").
GRAM_BLOCK = 1024
# Elements of a block product added into a float64 sum per step. Adding a whole float32 block converts it into a
# float64 temporary as large as the block, which the CPU allocator maps fresh from the OS every time (a 1024 ×
# 11,008 block: 22,017 page faults, 0.060 s per add); in slices of this size the temporaries are reused (no
# page fault, 0.013-0.016 s). Per 4096-token chunk of G's upper block triangle at d_in = 11,008 the adds took
# 0.33-0.68 s whole and 0.07-0.10 s sliced, of about 5 s (2-core Zen 3).
ADD_SLICE = 1 << 20
# Both blockings above are for the CPU allocator. CUDA's caching allocator reuses freed blocks, so there each block
# only costs kernel launches: with 64-token moment blocks and sliced adds, a 7B layer's statistics on an H200 took
# 0.12 s at 16k tokens and 0.53 s at 65k, launch-bound (the official replay's copies: 0.03 s). Off the CPU the adds
# are whole and the moments' blocks hold up to DEVICE_MOMENT_ELEMENTS elements (128 MiB in float64).
DEVICE_MOMENT_ELEMENTS = 1 << 24


def moment_block(device: torch.device, width: int) -> int:
    """Tokens per float64 block of the moments of ``width`` columns on ``device`` (see the constants above)."""
    if device.type == "cpu":
        return MOMENT_BLOCK
    return max(MOMENT_BLOCK, DEVICE_MOMENT_ELEMENTS // max(1, width))


def check_gram_precision(precision: str) -> None:
    if precision not in GRAM_PRECISIONS:
        raise ValueError(f"gram_precision={precision!r}; allowed: {', '.join(GRAM_PRECISIONS)}")


def add_product(sums: Tensor, left: Tensor, right: Tensor) -> None:
    """sums += leftᵀ right: the product in the operands' dtype, added into ``sums`` (float64), on the CPU ``ADD_SLICE``
    elements at a time (the result is the same as one add; only the temporaries are smaller)."""
    product = left.T @ right
    rows = max(1, ADD_SLICE // max(1, product.shape[1])) if sums.device.type == "cpu" else product.shape[0]
    for start in range(0, product.shape[0], rows):
        sums[start : start + rows].add_(product[start : start + rows])


def add_gram_upper(gram: Tensor, rows: Tensor) -> None:
    """G[i:i+b, i:] += X[:, i:i+b]ᵀ X[:, i:] per block row of ``GRAM_BLOCK``: the upper block triangle of XᵀX.

    The products are computed in the dtype of ``rows`` and added into ``gram`` (float64) by
    :func:`add_product`; the diagonal blocks are full, the blocks below them are not touched.
    """
    for start in range(0, rows.shape[1], GRAM_BLOCK):
        add_product(gram[start : start + GRAM_BLOCK, start:], rows[:, start : start + GRAM_BLOCK], rows[:, start:])


def mirror_upper(gram: Tensor) -> None:
    """Copy the upper triangle (as written by ``add_gram_upper``) onto the lower one, in place.

    The diagonal blocks are mirrored too, so G is exactly symmetric (a full product's two triangles can
    differ in the last bit).
    """
    for start in range(0, gram.shape[0], GRAM_BLOCK):
        stop = start + GRAM_BLOCK
        gram[stop:, start:stop].copy_(gram[start:stop, stop:].T)
        diagonal = gram[start:stop, start:stop]
        diagonal.copy_(diagonal.triu() + diagonal.triu(1).T)


def gram_of(m: Tensor, full: bool = True) -> Tensor:
    """MᵀM (k × k for M n × k) from its upper block triangle (:func:`add_gram_upper`, about half the flops of a full
    product), in M's dtype; mirrored onto the lower triangle when ``full`` (else the blocks below the diagonal
    blocks are zero)."""
    gram = m.new_zeros(m.shape[1], m.shape[1])
    add_gram_upper(gram, m)
    if full:
        mirror_upper(gram)
    return gram


def add_cross(cross: Tensor, outputs: Tensor, rows: Tensor) -> None:
    """C[i:i+b, :] += Y[:, i:i+b]ᵀ X per block of ``GRAM_BLOCK`` output rows, in the dtype of the chunks.

    ``outputs`` (n_c × d_out) and ``rows`` (n_c × d_in) are one chunk of tokens; the block products are
    added into ``cross`` (float64) by :func:`add_product`.
    """
    for start in range(0, outputs.shape[1], GRAM_BLOCK):
        add_product(cross[start : start + GRAM_BLOCK], outputs[:, start : start + GRAM_BLOCK], rows)


@dataclass
class ActivationStats:
    """Running sums over calibration tokens of a module input of width ``d_in`` (and of its output)."""

    n: int
    sum: Tensor
    abs_sum: Tensor
    sq_sum: Tensor
    gram_sums: Tensor | None  # G's accumulator; in "mixed" precision its lower triangle is stale until read
    gram_precision: GramPrecision = "mixed"
    lower_stale: bool = False  # G's and S's lower triangles await mirroring
    cross: Tensor | None = None  # C = Σ y xᵀ (d_out × d_in), y the bias-free output
    out_sq_sum: Tensor | None = None  # ‖Y‖² = Σ‖y‖² (a float64 scalar), when outputs are seen
    dropped: Tensor | None = None  # the dropped columns D fixed before the pass, when S and C_D are kept
    out_gram_sums: Tensor | None = None  # S = Σ y yᵀ (d_out × d_out), upper block triangle until read
    dropped_cross: Tensor | None = None  # C_D = Σ y x_Dᵀ (d_out × |D|)

    @classmethod
    def empty(cls, d_in: int, *, with_gram: bool = True, device: torch.device | str | None = None,
              gram_precision: GramPrecision = "mixed", d_out: int | None = None,
              with_cross: bool = False, dropped: Tensor | None = None) -> ActivationStats:
        """Zero sums; ``d_out`` (mixed precision only) also keeps ‖Y‖², ``with_cross`` C, and ``dropped`` (the
        columns D, fixed before the pass) S = Σ y yᵀ and C_D = Σ y x_Dᵀ, from the outputs."""
        check_gram_precision(gram_precision)
        if d_out is not None and gram_precision == "float64":
            raise ValueError("output statistics (‖Y‖², C = Σ y xᵀ, S = Σ y yᵀ) are collected in gram_precision='mixed' "
                             "only; "
                             "'float64' is the reference path from G alone: pass d_out=None")
        if (with_cross or dropped is not None) and d_out is None:
            raise ValueError("C = Σ y xᵀ (with_cross) and S, C_D (dropped) need the output width d_out")
        if dropped is not None:
            dropped = torch.as_tensor(dropped, dtype=torch.long, device=device)
            if dropped.ndim != 1 or (len(dropped) and not 0 <= int(dropped.min()) <= int(dropped.max()) < d_in):
                raise ValueError(f"dropped columns must be a list of indices in [0, {d_in}), got {dropped.tolist()}")

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(shape, dtype=torch.float64, device=device)

        return cls(0, zeros(d_in), zeros(d_in), zeros(d_in), zeros(d_in, d_in) if with_gram else None,
                   gram_precision, cross=zeros(d_out, d_in) if with_cross and d_out else None,
                   out_sq_sum=zeros() if d_out is not None else None, dropped=dropped,
                   out_gram_sums=zeros(d_out, d_out) if dropped is not None and d_out else None,
                   dropped_cross=zeros(d_out, len(dropped)) if dropped is not None and d_out else None)

    @classmethod
    def from_activations(cls, x: Tensor, *, with_gram: bool = True, gram_precision: GramPrecision = "mixed",
                         outputs: Tensor | None = None, with_cross: bool = False,
                         dropped: Tensor | None = None) -> ActivationStats:
        """Statistics of a stored activation matrix ``x`` of shape (N, d_in) (or (..., d_in)), and of the
        module's bias-free ``outputs`` (N, d_out) when given."""
        d_out = None if outputs is None else outputs.shape[-1]
        stats = cls.empty(x.shape[-1], with_gram=with_gram, device=x.device, gram_precision=gram_precision,
                          d_out=d_out, with_cross=with_cross, dropped=dropped)
        stats.update(x, outputs)
        return stats

    @property
    def gram(self) -> Tensor | None:
        """G = Σ x xᵀ (float64, symmetric), or None if it was not collected."""
        self._mirror_stale()
        return self.gram_sums

    @property
    def out_gram(self) -> Tensor | None:
        """S = Σ y yᵀ (float64, symmetric), or None if it was not collected."""
        self._mirror_stale()
        return self.out_gram_sums

    def _mirror_stale(self) -> None:
        """Mirror the upper block triangles of G and S (mixed precision writes only those) onto the lower ones."""
        if self.lower_stale:
            for sums in (self.gram_sums, self.out_gram_sums):
                if sums is not None:
                    mirror_upper(sums)
            self.lower_stale = False

    @property
    def d_in(self) -> int:
        return self.sum.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sum.device

    @property
    def kinds(self) -> frozenset[str]:
        """Which of the costly statistics were collected: a subset of {"gram", "cross", "dropped_cross"} (the last
        is S and C_D)."""
        return frozenset(name for name, t in (("gram", self.gram_sums), ("cross", self.cross),
                                              ("dropped_cross", self.dropped_cross)) if t is not None)

    def update(self, x: Tensor, outputs: Tensor | None = None) -> None:
        """Fold a batch of inputs (..., d_in), and the module's bias-free outputs (..., d_out), into the sums."""
        if x.shape[-1] != self.d_in:
            raise ValueError(f"input width {x.shape[-1]} does not match the statistics' d_in={self.d_in}")
        if (outputs is None) != (self.out_sq_sum is None):
            raise ValueError("outputs must be given exactly when the statistics keep output sums (d_out set)")
        rows = x.detach().reshape(-1, self.d_in).to(self.device)
        outs = None if outputs is None else outputs.detach().reshape(rows.shape[0], -1).to(self.device)
        product_dtype = torch.promote_types(rows.dtype, torch.float32)
        for start in range(0, rows.shape[0], CHUNK_TOKENS):
            chunk = rows[start : start + CHUNK_TOKENS]
            self._add_moments(chunk)
            if outs is not None:
                self._update_outputs(outs[start : start + CHUNK_TOKENS], chunk)
            if self.gram_sums is None:
                continue
            if self.gram_precision == "float64":
                wide = chunk.to(torch.float64)
                self.gram_sums.addmm_(wide.T, wide)
            else:
                add_gram_upper(self.gram_sums, chunk.to(product_dtype))
                self.lower_stale = True

    def _add_moments(self, rows: Tensor) -> None:
        """N, Σx, Σ|x|, Σx² in float64, block by block of ``moment_block`` tokens."""
        self.n += rows.shape[0]
        block = moment_block(rows.device, rows.shape[1])
        for start in range(0, rows.shape[0], block):
            wide = rows[start : start + block].to(torch.float64)
            self.sum += wide.sum(0)
            self.abs_sum += wide.abs().sum(0)
            self.sq_sum += wide.square().sum(0)

    def _update_outputs(self, outs: Tensor, rows: Tensor) -> None:
        """‖Y‖² (float64 squares), C, S and C_D (mixed: block products in float32 or the chunk's wider dtype)."""
        assert self.out_sq_sum is not None
        block = moment_block(outs.device, outs.shape[1])
        for start in range(0, outs.shape[0], block):
            self.out_sq_sum += outs[start : start + block].to(torch.float64).square().sum()
        dtype = torch.promote_types(torch.promote_types(rows.dtype, outs.dtype), torch.float32)
        if self.cross is not None:
            add_cross(self.cross, outs.to(dtype), rows.to(dtype))
        if self.dropped_cross is not None:
            assert self.out_gram_sums is not None and self.dropped is not None
            wide = outs.to(dtype)
            add_gram_upper(self.out_gram_sums, wide)
            self.lower_stale = True
            add_cross(self.dropped_cross, wide, rows[:, self.dropped].to(dtype))

    def merge(self, other: ActivationStats) -> None:
        """Add another accumulator's sums into this one (e.g. from another device or worker)."""
        if (other.d_in != self.d_in or other.kinds != self.kinds
                or (other.out_sq_sum is None) != (self.out_sq_sum is None)
                or (other.cross is not None and (self.cross is None or other.cross.shape != self.cross.shape))
                or not _same_columns(self.dropped, other.dropped)):
            raise ValueError("cannot merge statistics of different widths, kinds or dropped columns")
        self.n += other.n
        optional = ("gram", "cross", "out_sq_sum", "out_gram", "dropped_cross")
        names = ("sum", "abs_sum", "sq_sum") + tuple(name for name in optional if getattr(self, name) is not None)
        for name in names:
            getattr(self, name).add_(getattr(other, name).to(self.device))

    def _require_tokens(self) -> None:
        if self.n == 0:
            raise ValueError("no calibration tokens were seen: run calibration data through the module first")

    @property
    def mean(self) -> Tensor:
        """μ_j = (1/N) Σ_n x_jn."""
        self._require_tokens()
        return self.sum / self.n

    @property
    def mean_abs(self) -> Tensor:
        """E|x_j| = (1/N) Σ_n |x_jn| (the RCPU code's activation statistic)."""
        self._require_tokens()
        return self.abs_sum / self.n

    @property
    def l2_norm(self) -> Tensor:
        """‖X[j,:]‖₂ = sqrt(Σ_n x_jn²) (the paper's activation statistic)."""
        return self.sq_sum.sqrt()

    @property
    def variance(self) -> Tensor:
        """Mean-centred population variance Var(x_j) = max(0, E[x_j²] − E[x_j]²)."""
        self._require_tokens()
        return (self.sq_sum / self.n - self.mean.square()).clamp_min(0)

    @property
    def sample_variance(self) -> Tensor:
        """Unbiased variance (1/(N−1)) Σ_n (x_jn − μ_j)², FLAP's fluctuation."""
        if self.n < 2:
            raise ValueError(f"sample variance needs at least 2 tokens, got N={self.n}")
        return self.variance * (self.n / (self.n - 1))

    def require_gram(self) -> Tensor:
        if self.gram is None:
            raise ValueError("these statistics were collected without the Gram matrix G = Σ x xᵀ; "
                             "collect with with_gram=True for compensators that need it")
        return self.gram


def _same_columns(a: Tensor | None, b: Tensor | None) -> bool:
    if a is None or b is None:
        return a is b
    return torch.equal(a.cpu(), b.cpu())


def _names(modules: Mapping[str, nn.Linear], which: Iterable[str] | bool) -> set[str]:
    return set(modules) if which is True else set() if which is False else set(which)


def bias_free(module: nn.Linear, output: Tensor) -> Tensor:
    """y = W x: the module's output minus its bias (if any)."""
    return output if module.bias is None else output - module.bias


class PendingTokens:
    """A module's hook batches gathered into one chunk of ``CHUNK_TOKENS`` tokens, folded when it is full.

    Folding costs a pass over the float64 accumulators per update, whatever the batch's length, and the
    block products run faster with more tokens (a longer inner dimension), so short forward batches
    (e.g. 8 windows of 128 tokens) are gathered first, copied into one buffer per module allocated on the
    first batch (in its dtype; the copies also keep later in-place changes of the layer's tensors out of
    the sums). A batch of a whole chunk or more is folded as it is.
    """

    def __init__(self, stats: ActivationStats):
        self.stats, self.filled = stats, 0
        self.inputs: Tensor | None = None
        self.outputs: Tensor | None = None

    def add(self, x: Tensor, outputs: Tensor | None) -> None:
        rows = x.detach().reshape(-1, self.stats.d_in)
        outs = None if outputs is None else outputs.detach().reshape(rows.shape[0], -1)
        start = 0
        if not self.filled:
            whole = rows.shape[0] - rows.shape[0] % CHUNK_TOKENS
            if whole:
                self.stats.update(rows[:whole], None if outs is None else outs[:whole])
            start = whole
        while start < rows.shape[0]:
            take = min(CHUNK_TOKENS - self.filled, rows.shape[0] - start)
            self._hold(rows[start : start + take], None if outs is None else outs[start : start + take])
            start += take
            if self.filled == CHUNK_TOKENS:
                self.flush()

    def _hold(self, rows: Tensor, outs: Tensor | None) -> None:
        """Copy tokens into the chunk buffers after the ones already held."""
        if self.inputs is None:
            self.inputs = rows.new_empty((CHUNK_TOKENS, rows.shape[1]), device=self.stats.device)
            if outs is not None:
                self.outputs = outs.new_empty((CHUNK_TOKENS, outs.shape[1]), device=self.stats.device)
        stop = self.filled + rows.shape[0]
        self.inputs[self.filled : stop] = rows
        if outs is not None:
            assert self.outputs is not None
            self.outputs[self.filled : stop] = outs
        self.filled = stop

    def flush(self) -> None:
        """Fold the held tokens into the sums."""
        if self.filled:
            assert self.inputs is not None
            held = None if self.outputs is None else self.outputs[: self.filled]
            self.stats.update(self.inputs[: self.filled], held)
        self.filled = 0


@contextmanager
def collect_input_stats(modules: Mapping[str, nn.Linear], *, with_gram: Iterable[str] | bool = True,
                        with_cross: Iterable[str] | bool = False, dropped: Mapping[str, Tensor] | None = None,
                        gram_precision: GramPrecision = "mixed") -> Iterator[dict[str, ActivationStats]]:
    """Stream input (and output) statistics of each named module while the block runs.

    Yields a dict name -> ActivationStats, filled by forward hooks and complete when the context exits
    (short batches are gathered up to ``CHUNK_TOKENS`` tokens first: :class:`PendingTokens`); ``with_gram``
    and ``with_cross`` say for which modules G and C are needed (True/False for all, or a collection of
    names), ``dropped`` for which modules S and C_D over the given dropped columns, ``gram_precision`` how
    they are accumulated (module docstring). In "mixed" precision every module also keeps ‖Y‖² of its
    bias-free output.
    """
    dropped = dropped or {}
    gram, cross = _names(modules, with_gram), _names(modules, with_cross)
    stats: dict[str, ActivationStats] = {}
    pending: list[PendingTokens] = []
    handles = []
    for name, module in modules.items():
        weight = module.weight
        outputs = gram_precision == "mixed"
        stats[name] = ActivationStats.empty(weight.shape[1], with_gram=name in gram, device=weight.device,
                                            gram_precision=gram_precision,
                                            d_out=weight.shape[0] if outputs else None, with_cross=name in cross,
                                            dropped=dropped.get(name))
        pending.append(PendingTokens(stats[name]))

        def hook(module: nn.Linear, args: tuple[Tensor, ...], output: Tensor, held: PendingTokens = pending[-1],
                 outputs: bool = outputs) -> None:
            held.add(args[0], bias_free(module, output) if outputs else None)

        handles.append(module.register_forward_hook(hook))
    try:
        yield stats
        for held in pending:
            held.flush()
    finally:
        for handle in handles:
            handle.remove()
