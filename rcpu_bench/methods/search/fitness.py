"""The searched allocation's fitness (:mod:`rcpu_bench.methods.search.driver`, step 4): KL(p_dense ‖ p) of the model
as it stands on held-out windows, the dense log-probabilities written once, and the tokens a search scores, bounded
before any work."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from rcpu_bench.methods.search.supernet import save

MAX_SCORED_TOKENS = 2**24  # the default bound on the tokens a search scores (its default parameters score about 2**17)


def scored_tokens(plan: Sequence[tuple[int, int]], population: int, generations: int, seqlen: int) -> int:
    """Tokens the search runs the model on, at most, for its selection ``plan`` ((windows, survivors) per step): the
    dense log-probabilities and the start's fitness on all W held-out windows, then per generation each step's
    candidates on its windows (``population`` at the first step, the survivors of the step before at the others;
    the parent's fitness is known): seqlen · (2W + generations · Σ_i candidatesᵢ · windowsᵢ)."""
    n_windows = plan[-1][0]
    alive, per_generation = population, 0
    for windows, survivors in plan:
        per_generation += alive * min(windows, n_windows)
        alive = survivors
    return seqlen * (2 * n_windows + generations * per_generation)


def check_cost(plan: Sequence[tuple[int, int]], seqlen: int, population: int, generations: int, bound: int | None,
               given: str) -> None:
    """Refuse a search (its parameters ``given``) that scores more than ``bound`` tokens (:func:`scored_tokens`)."""
    cost = scored_tokens(plan, population, generations, seqlen)
    if bound is not None and cost > bound:
        raise ValueError(f"allocation 'search' with {given} scores about {cost:,} tokens ({plan[-1][0]:,} held-out "
                         f"windows of {seqlen}); allowed: at most max_scored_tokens={bound:,} (raise it, or "
                         "max_scored_tokens=None for no bound)")


class Fitness:
    """KL(p_dense ‖ p) of the model as it stands on chosen held-out windows (module docstring, 4), the dense
    log-probabilities written once, one file per window."""

    def __init__(self, model: nn.Module, windows: Tensor, directory: Path, batch_size: int):
        self.model, self.windows, self.directory, self.batch_size = model, windows, directory, batch_size
        directory.mkdir()
        for start in range(0, len(windows), batch_size):
            for offset, log_p in enumerate(self._log_probs(windows[start : start + batch_size])):
                # a copy: a view saves its whole storage, here the batch's (B× the window's bytes on the CPU)
                save(log_p.to("cpu", copy=True), self._target(start + offset))

    def __call__(self, chosen: list[int]) -> float:
        total, positions = 0.0, 0
        for start in range(0, len(chosen), self.batch_size):
            batch = chosen[start : start + self.batch_size]
            log_p = self._log_probs(self.windows[batch])  # (B, T, V)
            dense = torch.stack([torch.load(self._target(w), map_location=log_p.device) for w in batch])
            total += float(F.kl_div(log_p, dense, log_target=True, reduction="sum").double())
            positions += log_p.shape[0] * log_p.shape[1]
        return total / positions

    def _target(self, window: int) -> Path:
        return self.directory / f"{window}.pt"

    @torch.no_grad()
    def _log_probs(self, ids: Tensor) -> Tensor:
        device = next(self.model.parameters()).device
        return self.model(input_ids=ids.to(device), use_cache=False).logits.float().log_softmax(-1)
