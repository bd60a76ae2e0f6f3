"""Work that several cells of a matrix share and that changes no number: layer 0's captured inputs.

Layer 0 receives the embeddings of the calibration windows (with the attention mask and rotary tables),
which depend only on the dense model, the calibration windows and how they are batched and placed, never on
the method or ratio: cells that agree on those (``capture_key``) share one capture (``LayerInputCache``).
The pipeline never writes into the captured tensors (each layer's outputs are new tensors), so sharing
them is exact; tests/test_reuse.py compares records with and without reuse.

The dense model itself is evaluated once per model and matrix: ``spec.expand`` lists one dense cell
(ratio 0) per model whatever the calibration sizes, methods or ablation variants.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

from rcpu_bench.matrix.spec import Cell

CaptureKey = tuple[Hashable, ...]


def capture_key(cell: Cell, device: str) -> CaptureKey:
    """Everything layer 0's inputs depend on: the dense model (path, revision, dtype), the calibration windows
    (source, count, length, seed: ``cell.calib``), their batching and where they are computed (device, offload)."""
    return (cell.model, cell.revision, cell.dtype, device, cell.calib, cell.prune["batch_size"],
            cell.prune["offload"])


class LayerInputCache:
    """The captured layer-0 inputs of the last ``max_entries`` keys (least recently used dropped first).

    One entry holds N·T·d activations on the cell's device (N windows of T tokens, hidden size d) plus the
    rotary tables, as much as one cell holds anyway while it prunes; the default keeps one.
    """

    def __init__(self, max_entries: int = 1) -> None:
        if max_entries < 1:
            raise ValueError(f"max_entries={max_entries} must be >= 1")
        self.max_entries = max_entries
        self._entries: OrderedDict[CaptureKey, Any] = OrderedDict()
        self.hits = self.misses = 0

    def reuse(self, key: CaptureKey) -> Callable[[Callable[[], Any]], Any]:
        """``prune_model(reuse_capture=...)`` for one cell: its capture's result, computed once per key."""
        def reuse_capture(capture: Callable[[], Any]) -> Any:
            if key in self._entries:
                self.hits += 1
                self._entries.move_to_end(key)
                return self._entries[key]
            self.misses += 1
            while len(self._entries) >= self.max_entries:  # freed before the capture: never max_entries + 1 held
                self._entries.popitem(last=False)
            self._entries[key] = inputs = capture()
            return inputs
        return reuse_capture

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
