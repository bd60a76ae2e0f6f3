"""Seeded synthetic LLaMA-7B modules and activations for the per-module benchmarks (``test_bench_*.py``).

o_proj is 4096×4096 (32 heads of 128 columns), down_proj 4096×11008 (channels); widths scale by a factor
to validate quickly. Pruning is data-free (smallest column norms) so that every path prunes the same units.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from rcpu_bench.selection.select import Selection, select_by_score

SEED = 0
RATIO = 0.2
# Tokens per synthetic batch: 8 calibration windows of 128 tokens, one forward batch of the pipeline.
BATCH_TOKENS = 1024


@dataclass(frozen=True)
class ModuleShape:
    """A linear module W (d_out × d_in) whose input columns are pruned in units of ``unit_size``."""

    name: str
    d_out: int
    d_in: int
    unit_size: int


def module_shapes(scale: float = 1.0) -> dict[str, ModuleShape]:
    """LLaMA-7B o_proj (32 heads of 128 columns) and down_proj (11,008 channels), widths times ``scale``."""
    head_dim = max(1, round(128 * scale))
    hidden = 32 * head_dim
    return {"o_proj": ModuleShape("o_proj", hidden, hidden, head_dim),
            "down_proj": ModuleShape("down_proj", hidden, max(1, round(11008 * scale)), 1)}


def make_weight(shape: ModuleShape) -> Tensor:
    """A seeded float32 weight with unit-variance outputs for unit-variance inputs."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randn(shape.d_out, shape.d_in, generator=generator) / shape.d_in**0.5


def select_columns(weight: Tensor, shape: ModuleShape, ratio: float = RATIO) -> Selection:
    """Prune the units (heads or channels) with the smallest column norms; data-free, so all paths agree."""
    unit_scores = weight.norm(dim=0).reshape(-1, shape.unit_size).sum(1)
    return select_by_score(unit_scores, ratio).columns(shape.unit_size)


def synthetic_batches(d_in: int, n_tokens: int, batch_tokens: int = BATCH_TOKENS) -> Iterator[Tensor]:
    """Seeded float32 activations, (tokens × d_in) per batch, ``n_tokens`` in all.

    Each channel has its own mean (≈ 0.1·N(0,1)) and scale (log-normal, e^{±0.25}), so the mean adds a
    rank-one term to G as in real activations while G stays well conditioned for float32 solves.
    """
    generator = torch.Generator().manual_seed(SEED + 1)
    mean = 0.1 * torch.randn(d_in, generator=generator)
    scale = torch.exp(0.25 * torch.randn(d_in, generator=generator))
    for start in range(0, n_tokens, batch_tokens):
        yield torch.randn(min(batch_tokens, n_tokens - start), d_in, generator=generator) * scale + mean
