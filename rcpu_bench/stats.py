"""Streaming second-order statistics of a linear module's inputs.

For inputs x ∈ R^{d_in} over N calibration tokens we keep, summed in float64,

    N,  Σx,  Σ|x|,  Σx²,  and (when a compensator needs it)  G = Σ x xᵀ.

Because a linear module's dense output is Y = W X exactly, every quantity the paper's
compensators need follows from these sums (see ``compensators.py``); raw activations are never
stored, so memory does not grow with the calibration set.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

# Tokens folded into the sums per step: bounds the float64 copy of one batch.
CHUNK_TOKENS = 4096


@dataclass
class ActivationStats:
    """Running sums over calibration tokens of a module input of width ``d_in``."""

    n: int
    sum: Tensor
    abs_sum: Tensor
    sq_sum: Tensor
    gram: Tensor | None

    @classmethod
    def empty(cls, d_in: int, *, with_gram: bool = True, device: torch.device | str | None = None) -> ActivationStats:
        zeros = lambda *shape: torch.zeros(*shape, dtype=torch.float64, device=device)  # noqa: E731
        return cls(0, zeros(d_in), zeros(d_in), zeros(d_in), zeros(d_in, d_in) if with_gram else None)

    @classmethod
    def from_activations(cls, x: Tensor, *, with_gram: bool = True) -> ActivationStats:
        """Statistics of a stored activation matrix ``x`` of shape (N, d_in) (or (..., d_in))."""
        stats = cls.empty(x.shape[-1], with_gram=with_gram, device=x.device)
        stats.update(x)
        return stats

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
        rows = x.detach().reshape(-1, self.d_in)
        for start in range(0, rows.shape[0], CHUNK_TOKENS):
            chunk = rows[start : start + CHUNK_TOKENS].to(device=self.device, dtype=torch.float64)
            self.n += chunk.shape[0]
            self.sum += chunk.sum(0)
            self.abs_sum += chunk.abs().sum(0)
            self.sq_sum += chunk.square().sum(0)
            if self.gram is not None:
                self.gram.addmm_(chunk.T, chunk)

    def merge(self, other: ActivationStats) -> None:
        """Add another accumulator's sums into this one (e.g. from another device or worker)."""
        if other.d_in != self.d_in or (other.gram is None) != (self.gram is None):
            raise ValueError("cannot merge statistics of different widths or kinds")
        self.n += other.n
        for name in ("sum", "abs_sum", "sq_sum") + (("gram",) if self.gram is not None else ()):
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
def collect_input_stats(modules: dict[str, nn.Module], *, with_gram: Iterable[str] | bool = True):
    """Stream input statistics of each named module while the block runs.

    Yields a dict name -> ActivationStats, filled by forward pre-hooks; ``with_gram`` says for which
    modules the Gram matrix is needed (True/False for all, or a collection of names).
    """
    wanted = set(modules) if with_gram is True else set() if with_gram is False else set(with_gram)
    stats: dict[str, ActivationStats] = {}
    handles = []
    for name, module in modules.items():
        weight = module.weight
        stats[name] = ActivationStats.empty(weight.shape[1], with_gram=name in wanted, device=weight.device)
        handles.append(module.register_forward_pre_hook(lambda _m, args, s=stats[name]: s.update(args[0])))
    try:
        yield stats
    finally:
        for handle in handles:
            handle.remove()
