"""How cells run: one at a time in this process (``local``) or as Ray tasks (``ray``).

Either way a cell becomes a store entry where it ran (``run_cell``): its record, or its error with the
traceback when anything in it raises (a plugin, a NaN, out of memory); the entries come back to the
driver, which alone writes the store. The dense model is loaded once per model and process and every
cell prunes a private copy of it (``ModelCache``); tokenized data is cached by ``rcpu_bench.data``.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from rcpu_bench.matrix.experiment import run_experiment
from rcpu_bench.matrix.spec import Cell
from rcpu_bench.model.loading import LoadedModel, load_model
from rcpu_bench.registry import Registry
from rcpu_bench.matrix.store import error_info, make_entry

EXECUTORS = ("local", "ray")
RAY_OBJECT_STORE_BYTES = 256 * 2**20  # entries are small; Ray would reserve ~30 % of RAM by default

OnStart = Callable[[Cell], None]


class Executor(Protocol):
    """Runs cells and yields their store entries as they finish; ``on_start(cell)`` tells when a cell starts."""

    def run(self, cells: Sequence[Cell], registry: Registry, on_start: OnStart) -> Iterator[dict[str, Any]]: ...


def clone_to(model: nn.Module, device: str | torch.device) -> nn.Module:
    """A deep copy of ``model`` whose parameters and buffers are new tensors on ``device`` (ties preserved).

    Each tensor is copied straight to ``device``, so a GPU copy of a CPU model needs no second CPU copy.
    """
    memo: dict[int, Any] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(param.detach().to(device, copy=True), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = buffer.detach().to(device, copy=True)
    return copy.deepcopy(model, memo)


class ModelCache:
    """The dense model last asked for, read once onto the CPU; every ``load`` hands out a private copy.

    Only one model is kept: cells arrive model by model, and a second 13B model would not fit beside the first.
    """

    def __init__(self) -> None:
        self._key: tuple[str, str | None, str] | None = None
        self._dense: LoadedModel | None = None

    def load(self, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
             revision: str | None = None) -> LoadedModel:
        """A copy of the dense model on ``device``: load_model's signature, for ``run_experiment(load=...)``."""
        key = (name_or_path, revision, dtype)
        if key != self._key:
            self._key, self._dense = None, None  # free the previous model before reading the next
            self._dense = load_model(name_or_path, dtype=dtype, device="cpu", revision=revision)
            self._key = key
        return LoadedModel(clone_to(self._dense.model, device), self._dense.tokenizer,
                           {**self._dense.provenance, "device": device})


def _check_finite(record: dict[str, Any]) -> None:
    values = {"calibration": record["calibration_ppl"], **{p["profile"]: p["ppl"] for p in record["perplexity"]}}
    bad = {name: value for name, value in values.items() if not math.isfinite(value)}
    if bad:
        raise FloatingPointError(f"non-finite perplexity: {bad}")


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluations(cell: Cell) -> Callable[[Any, Any], dict[str, Any]] | None:
    """What the cell evaluates beyond perplexity: zero-shot accuracy (``record["zeroshot"]``) when asked for."""
    if "zeroshot" not in cell.eval:
        return None
    from rcpu_bench.evaluation.zeroshot import evaluate_zeroshot  # lm-eval: imported only when asked for

    return lambda model, tokenizer: {"zeroshot": evaluate_zeroshot(model, tokenizer, limit=cell.zeroshot_limit)}


def run_cell(cell: Cell, registry: Registry, models: ModelCache) -> dict[str, Any]:
    """Run one cell and return its store entry; any exception becomes a failed entry with its traceback."""
    started = time.perf_counter()
    try:
        record = run_experiment(cell.experiment(), registry=registry, progress=False, load=models.load,
                                evaluate=evaluations(cell))
        _check_finite(record)
        return make_entry(cell, seconds=time.perf_counter() - started, record=record)
    except Exception as error:  # noqa: BLE001 - one failing cell must not stop the matrix
        return make_entry(cell, seconds=time.perf_counter() - started, error=error_info(error))
    finally:
        _release_memory()  # the failed cell's model copy (held by the traceback until now) included


class LocalExecutor:
    """Cells one after another in this process."""

    def run(self, cells: Sequence[Cell], registry: Registry, on_start: OnStart) -> Iterator[dict[str, Any]]:
        models = ModelCache()
        for cell in cells:
            on_start(cell)
            yield run_cell(cell, registry, models)


# ------------------------------------------------------------------------------------------------ Ray

_WORKER_MODELS = ModelCache()  # per Ray worker process: tasks of one model reuse its dense copy


def _ray_cell(cell: Cell, registry: Registry) -> dict[str, Any]:
    """The body of a Ray task."""
    return run_cell(cell, registry, _WORKER_MODELS)


def import_ray():
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError("the ray executor needs Ray, which is not installed: "
                          "pip install 'rcpu-bench[ray]'") from error
    return ray


class RayExecutor:
    """Each cell is a Ray task (a GPU for a CUDA cell if the cluster has GPUs, else a CPU); entries go to the driver.

    Connects to ``address`` (an existing cluster), or uses the connection this process already has, or
    starts a small local cluster (no dashboard, a small object store, its session files in a temporary
    directory, token auth off) that it stops again. The cluster schedules the cells, so ``on_start`` is
    not called. Each worker process keeps the dense model of its last task (``ModelCache``).
    """

    def __init__(self, address: str | None = None):
        self.ray, self.address = import_ray(), address

    def run(self, cells: Sequence[Cell], registry: Registry, on_start: OnStart) -> Iterator[dict[str, Any]]:
        ray = self.ray
        with self._connected(ray):
            task = ray.remote(max_retries=0)(_ray_cell)
            gpus = ray.cluster_resources().get("GPU", 0) > 0
            registry_ref = ray.put(registry)
            pending = {task.options(**self._resources(cell, gpus)).remote(cell, registry_ref): cell
                       for cell in cells}
            try:
                while pending:
                    (ref,), _ = ray.wait(list(pending), num_returns=1)
                    yield self._entry(ray, ref, pending.pop(ref))
            finally:
                for ref in pending:
                    ray.cancel(ref, force=True)

    @contextmanager
    def _connected(self, ray) -> Iterator[None]:
        if ray.is_initialized():
            yield
            return
        options = self._init_options()
        ray.init(**options)
        try:
            yield
        finally:
            ray.shutdown()
            if "_temp_dir" in options:
                shutil.rmtree(options["_temp_dir"], ignore_errors=True)

    def _init_options(self) -> dict[str, Any]:
        if self.address:
            return {"address": self.address}
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")
        # Session files go to a fresh directory under the system tmp: their unix socket paths must stay short.
        return {"include_dashboard": False, "object_store_memory": RAY_OBJECT_STORE_BYTES,
                "_temp_dir": tempfile.mkdtemp(prefix="rcpu-ray-")}

    @staticmethod
    def _resources(cell: Cell, gpus: bool) -> dict[str, int]:
        """A GPU for a cell on a CUDA device when the cluster has GPUs, else a CPU."""
        return {"num_gpus": 1} if gpus and cell.device.startswith("cuda") else {"num_cpus": 1}

    @staticmethod
    def _entry(ray, ref, cell: Cell) -> dict[str, Any]:
        """The task's entry; a task that died (worker crash, cancelled) becomes a failed entry here."""
        try:
            return ray.get(ref)
        except Exception as error:  # noqa: BLE001 - the cell failed outside run_cell
            return make_entry(cell, seconds=0.0, error=error_info(error))


def make_executor(name: str, *, ray_address: str | None = None) -> Executor:
    """The executor called ``name`` (one of EXECUTORS)."""
    if name == "local":
        return LocalExecutor()
    if name == "ray":
        return RayExecutor(ray_address)
    raise ValueError(f"unknown executor {name!r}; allowed: {', '.join(EXECUTORS)}")
