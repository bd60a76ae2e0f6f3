"""The searched allocation's candidates on disk (:mod:`rcpu_bench.methods.search.driver`, steps 3 and 4): the
supernet of every slot's candidates and dense weights, assembled in place by masking, and the cache directory that
holds them, its size checked against the free space before any work.

The cache directory is ``.search-candidates.<pid>.<random>.partial`` in the ``cache`` directory, an
``rcpu_bench.atomic_file`` staging name: a search killed with SIGKILL cannot remove it, and the next search in the
same directory does (``staging_sibling`` removes the staging of writers whose process is gone). A kept cache is
renamed to a visible ``search-<random>``, which no search removes.
"""

from __future__ import annotations

import copy
import io
import os
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from rcpu_bench import console
from rcpu_bench.atomic_file import check_free_space, staging_sibling
from rcpu_bench.methods.search.genome import Genome, Slot
from rcpu_bench.model.adapter import layer_view
from rcpu_bench.model.views import LayerView
from rcpu_bench.paths import check_output_dir
from rcpu_bench.selection.select import Selection

if TYPE_CHECKING:
    from rcpu_bench.hookspecs import AllocationContext


CACHE_NAME = "search-candidates"
FILE_OVERHEAD = 4096  # bytes torch.save adds to a file beyond its tensors (its zip container), at most


def cache_bytes(slots: Iterable[tuple[Sequence[nn.Linear], int, Sequence[int]]], n_windows: int, seqlen: int,
                vocab: int) -> int:
    """Bytes the cache holds, at most. Per slot (its producers and consumer, its unit size, the units each level
    prunes): the dense linears, and per level the pruned units (int64), W̃_K and the consumer's bias; per held-out
    window its dense log-probabilities (float32, seqlen × vocab); each file's container."""
    total = n_windows * (seqlen * vocab * 4 + FILE_OVERHEAD)
    for linears, unit_size, counts in slots:
        consumer = linears[-1]
        size = consumer.weight.element_size()
        total += size * sum(linear.weight.numel() + (0 if linear.bias is None else linear.bias.numel())
                            for linear in linears) + FILE_OVERHEAD
        n_units = consumer.weight.shape[1] // unit_size
        for count in counts:
            total += 8 * count + size * ((n_units - count) * unit_size + 1) * consumer.out_features + FILE_OVERHEAD
    return total


def check_cache(root: Path, slots: Iterable[tuple[Sequence[nn.Linear], int, Sequence[int]]], n_windows: int,
                seqlen: int, vocab: int) -> None:
    """Refuse a cache directory ``root`` that cannot be written or lacks the room for :func:`cache_bytes`."""
    check_output_dir(root, "allocation 'search' parameter cache")
    check_free_space(root, cache_bytes(slots, n_windows, seqlen, vocab),
                     f"allocation 'search' parameter cache {root}: the candidates",
                     allowed="a cache directory with that much free space, or fewer held-out tokens")


def cache_directory(root: Path, cache: str | None) -> Path:
    """A new hidden cache directory in ``root`` named for this process (after those of searches whose process is
    gone were removed); an OSError names the ``cache`` parameter."""
    try:
        return staging_sibling(root / CACHE_NAME, directory=True)
    except OSError as error:
        raise OSError(f"allocation 'search' parameter cache={cache!r}: {error}; allowed: a writable directory") \
            from None


def published(directory: Path) -> Path:
    """A kept cache under a visible name of its own, ``search-<random>``, which no later search removes."""
    kept = Path(tempfile.mkdtemp(prefix="search-", dir=directory.parent))
    os.replace(directory, kept)
    return kept


def save(saved: Any, path: Path) -> None:
    """``torch.save`` through memory, then one plain write: a full disk is an OSError naming the file, not torch's
    RuntimeError from inside its zip writer."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    try:
        path.write_bytes(buffer.getbuffer())
    except OSError as error:
        raise OSError(f"allocation 'search': cannot write {path} in its cache ({error.strerror or error}); the cache "
                      "is removed; allowed: a cache directory with room for the candidates") from error


class Supernet:
    """Every slot's candidates and dense weights in a cache directory, and the model assembled from them in place."""

    def __init__(self, directory: Path, views: list[LayerView], grid: list[Slot], gqa_rule: str):
        self.directory, self.views, self.grid, self.gqa_rule = directory, views, grid, gqa_rule
        self.applied: list[int | None] = [None] * len(grid)  # the level in place per slot; None: dense

    def build(self, task: AllocationContext) -> None:
        """Write each slot's dense producers and consumer and the candidate of each of its levels (module
        docstring, 3), from one dense pass."""
        (self.directory / "candidates").mkdir()
        (self.directory / "dense").mkdir()
        layers = task.dense_layers()
        for index, view, stats in console.progress(layers, desc="search: candidates", total=len(self.views),
                                                   unit="layer", enabled=task.progress):
            for i, slot in enumerate(self.grid):
                if slot.layer != index:
                    continue
                save(_state(linears(view, slot.module)), self._dense(i))
                for level, count in slot.counts.items():
                    candidate = _candidate(task, view, slot.module, stats[slot.module], count)
                    save(candidate, self._candidate(i, level))

    def assemble(self, genome: Genome) -> None:
        """Mask the model into the choice ``genome``, changing only the slots whose level differs."""
        for i, level in enumerate(genome):
            if self.applied[i] != level:
                self._restore(i)
                self._mask(i, level)

    def restore(self) -> None:
        """Hand the model back dense."""
        for i in range(len(self.grid)):
            self._restore(i)

    def _dense(self, i: int) -> Path:
        return self.directory / "dense" / f"{self.grid[i].layer}-{self.grid[i].module}.pt"

    def _candidate(self, i: int, level: int) -> Path:
        return self.directory / "candidates" / f"{self.grid[i].layer}-{self.grid[i].module}-{level}.pt"

    def _restore(self, i: int) -> None:
        if self.applied[i] is None:
            return
        view = self.views[self.grid[i].layer]
        _load_state(linears(view, self.grid[i].module), torch.load(self._dense(i)))
        self.applied[i] = None

    def _mask(self, i: int, level: int) -> None:
        """Apply a candidate to the dense slot, same-shape: ``LayerView.apply(physical=False)``."""
        slot, view = self.grid[i], self.views[self.grid[i].layer]
        device = view.projection(slot.module).weight.device
        candidate = torch.load(self._candidate(i, level), map_location=device)
        mapping = view.units(slot.module, self.gqa_rule)
        kept = torch.ones(view.n_units(slot.module, self.gqa_rule), dtype=torch.bool)
        kept[candidate["pruned"].cpu()] = False
        units = Selection(kept.nonzero().flatten(), (~kept).nonzero().flatten())
        view.apply(slot.module, units.columns(mapping.unit_size), candidate["weight"], candidate["bias"],
                   physical=False)
        self.applied[i] = level


def linears(view: LayerView, module: str) -> tuple[nn.Linear, ...]:
    """The linears that pruning a module changes: its producers and its consumer."""
    return (*view.producers(module), view.projection(module))


def _state(linears: Sequence[nn.Linear]) -> list[tuple[Tensor, Tensor | None]]:
    return [(linear.weight.detach().cpu(), None if linear.bias is None else linear.bias.detach().cpu())
            for linear in linears]


def _load_state(linears: Sequence[nn.Linear], state: list[tuple[Tensor, Tensor | None]]) -> None:
    for linear, (weight, bias) in zip(linears, state, strict=True):
        device, dtype, grad = linear.weight.device, linear.weight.dtype, linear.weight.requires_grad
        linear.weight = nn.Parameter(weight.to(device, dtype), requires_grad=grad)
        # torch types Linear.bias as a Parameter, but a Linear built with bias=False holds None
        new_bias = None if bias is None else nn.Parameter(bias.to(device, dtype), requires_grad=grad)
        linear.bias = new_bias  # type: ignore[assignment]


def _candidate(task: AllocationContext, view: LayerView, module: str, stats: Any, count: int
               ) -> dict[str, Tensor | None]:
    """One level of one slot: a copy of the layer pruned by the run's methods, kept as its pruned units, W̃_K (d_out ×
    |K|, kept order) and the consumer's bias."""
    pruned = layer_view(copy.deepcopy(view.layer))
    report = task.prune(pruned, module, stats, count)
    consumer = pruned.projection(module)
    return {"pruned": torch.tensor(report["pruned_units"], dtype=torch.long), "weight": consumer.weight.detach().cpu(),
            "bias": None if consumer.bias is None else consumer.bias.detach().cpu()}
