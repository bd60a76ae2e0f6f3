"""The phases a pruning run is timed in, declared once (:data:`PHASES`), and the :class:`Timer` that times them.

A record keeps each phase's seconds for the whole run (``timing.prune_seconds``) and, for the phases of the layer
loop, per layer (``timing.layers``); the efficiency table shows one column per declared phase
(``rcpu_bench.tables.results``). A whole-model method is timed under its own name instead.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Literal, get_args

import torch

Phase = Literal["allocation", "capture", "statistics", "score", "solve", "forward", "holdout", "offload"]
PHASES: tuple[Phase, ...] = get_args(Phase)
# What each phase times; "allocation" and "capture" happen once per run, the others in every layer.
MEANING: dict[Phase, str] = {
    "allocation": "the units each layer loses: AL-AM's dense pass, a model allocation's search, or a profile",
    "capture": "the inputs of layer 0 (calibration and held-out windows)",
    "statistics": "the dense pass over the calibration windows that streams each module's input statistics",
    "score": "scoring and selecting the units to prune",
    "solve": "the compensator",
    "forward": "the pruned layer's outputs, the next layer's inputs (sequential statistics)",
    "holdout": "the held-out windows' passes (generalisation diagnostics)",
    "offload": "moving the layer to the device and back (offload)",
}


class Timer:
    """Accumulates wall time per named section, synchronising the accelerator around each."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        """Time the block as ``name``: a declared :data:`PHASES` member, or a whole-model method's name."""
        self._sync()
        start = time.perf_counter()
        yield
        self._sync()
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def add(self, other: Timer) -> None:
        """Add ``other``'s seconds, phase by phase (a layer's into the run's)."""
        for name, seconds in other.seconds.items():
            self.seconds[name] = self.seconds.get(name, 0.0) + seconds
