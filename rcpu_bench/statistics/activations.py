"""Streaming second-order statistics of a linear module's inputs.

For inputs x ∈ R^{d_in} over N calibration tokens we keep, summed in float64,

    N,  Σx,  Σ|x|,  Σx²,  and (when a compensator needs it)  G = Σ x xᵀ.

The moments are always computed in float64. G, the costly part (2·N·d_in² flops), has two precisions:

* ``"mixed"`` (default): each chunk's products X_cᵀX_c are computed in float32 (or the input's dtype
  if that is float64) and added into the float64 accumulator, block row by block row over the upper
  triangle only (G is symmetric; the lower triangle is mirrored when G is read), about half the flops
  of a full product at 2-4x the float64 rate on CPU. Per entry, |G_mixed − G_float64| ≤
  (n_c + 1)·u·Σ_n |x_in||x_jn| with u = 2⁻²⁴ and n_c ≤ ``CHUNK_TOKENS`` the chunk length (float32
  rounding of a length-n_c dot product and of its result); measured errors are far smaller (see
  ``benchmarks/README.md``). On CUDA, keep ``torch.backends.cuda.matmul.allow_tf32`` off (the default).
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
# Tokens folded into the sums per step: bounds the float64 copy of one batch (and n_c above).
CHUNK_TOKENS = 4096
# Rows of G per block of the upper-triangle product (measured on a 2-core Zen 3: 1024 beats 512 and 2048).
GRAM_BLOCK = 1024


def check_gram_precision(precision: str) -> None:
    if precision not in GRAM_PRECISIONS:
        raise ValueError(f"gram_precision={precision!r}; allowed: {', '.join(GRAM_PRECISIONS)}")


def add_gram_upper(gram: Tensor, rows: Tensor) -> None:
    """G[i:i+b, i:] += X[:, i:i+b]ᵀ X[:, i:] per block row of ``GRAM_BLOCK``: the upper block triangle of XᵀX.

    The products are computed in the dtype of ``rows`` and added into ``gram`` (float64) without a
    float64 copy of the product; the diagonal blocks are full, the blocks below them are not touched.
    """
    for start in range(0, rows.shape[1], GRAM_BLOCK):
        gram[start : start + GRAM_BLOCK, start:].add_(rows[:, start : start + GRAM_BLOCK].T @ rows[:, start:])


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


@dataclass
class ActivationStats:
    """Running sums over calibration tokens of a module input of width ``d_in``."""

    n: int
    sum: Tensor
    abs_sum: Tensor
    sq_sum: Tensor
    gram_sums: Tensor | None  # G's accumulator; in "mixed" precision its lower triangle is stale until read
    gram_precision: GramPrecision = "mixed"
    lower_stale: bool = False

    @classmethod
    def empty(cls, d_in: int, *, with_gram: bool = True, device: torch.device | str | None = None,
              gram_precision: GramPrecision = "mixed") -> ActivationStats:
        check_gram_precision(gram_precision)

        def zeros(*shape: int) -> Tensor:
            return torch.zeros(*shape, dtype=torch.float64, device=device)

        return cls(0, zeros(d_in), zeros(d_in), zeros(d_in), zeros(d_in, d_in) if with_gram else None,
                   gram_precision)

    @classmethod
    def from_activations(cls, x: Tensor, *, with_gram: bool = True,
                         gram_precision: GramPrecision = "mixed") -> ActivationStats:
        """Statistics of a stored activation matrix ``x`` of shape (N, d_in) (or (..., d_in))."""
        stats = cls.empty(x.shape[-1], with_gram=with_gram, device=x.device, gram_precision=gram_precision)
        stats.update(x)
        return stats

    @property
    def gram(self) -> Tensor | None:
        """G = Σ x xᵀ (float64, symmetric), or None if it was not collected."""
        if self.gram_sums is not None and self.lower_stale:
            mirror_upper(self.gram_sums)
            self.lower_stale = False
        return self.gram_sums

    @property
    def d_in(self) -> int:
        return self.sum.shape[0]

    @property
    def device(self) -> torch.device:
        return self.sum.device

    def update(self, x: Tensor) -> None:
        """Fold a batch of inputs (..., d_in) into the sums, in float64, chunk by chunk."""
        if x.shape[-1] != self.d_in:
            raise ValueError(f"input width {x.shape[-1]} does not match the statistics' d_in={self.d_in}")
        rows = x.detach().reshape(-1, self.d_in).to(self.device)
        product_dtype = torch.promote_types(rows.dtype, torch.float32)
        for start in range(0, rows.shape[0], CHUNK_TOKENS):
            chunk = rows[start : start + CHUNK_TOKENS].to(torch.float64)
            self.n += chunk.shape[0]
            self.sum += chunk.sum(0)
            self.abs_sum += chunk.abs().sum(0)
            self.sq_sum += chunk.square().sum(0)
            if self.gram_sums is None:
                continue
            if self.gram_precision == "float64":
                self.gram_sums.addmm_(chunk.T, chunk)
            else:
                add_gram_upper(self.gram_sums, rows[start : start + CHUNK_TOKENS].to(product_dtype))
                self.lower_stale = True

    def merge(self, other: ActivationStats) -> None:
        """Add another accumulator's sums into this one (e.g. from another device or worker)."""
        if other.d_in != self.d_in or (other.gram_sums is None) != (self.gram_sums is None):
            raise ValueError("cannot merge statistics of different widths or kinds")
        self.n += other.n
        for name in ("sum", "abs_sum", "sq_sum") + (("gram",) if self.gram_sums is not None else ()):
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


@contextmanager
def collect_input_stats(modules: Mapping[str, nn.Linear], *, with_gram: Iterable[str] | bool = True,
                        gram_precision: GramPrecision = "mixed") -> Iterator[dict[str, ActivationStats]]:
    """Stream input statistics of each named module while the block runs.

    Yields a dict name -> ActivationStats, filled by forward pre-hooks; ``with_gram`` says for which
    modules the Gram matrix is needed (True/False for all, or a collection of names), ``gram_precision``
    how it is accumulated (module docstring).
    """
    wanted = set(modules) if with_gram is True else set() if with_gram is False else set(with_gram)
    stats: dict[str, ActivationStats] = {}
    handles = []
    for name, module in modules.items():
        weight = module.weight
        stats[name] = ActivationStats.empty(weight.shape[1], with_gram=name in wanted, device=weight.device,
                                            gram_precision=gram_precision)
        handles.append(module.register_forward_pre_hook(lambda _m, args, s=stats[name]: s.update(args[0])))
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
