"""How cells run: one at a time in this process (``local``) or as Ray tasks (``ray``).

Either way a cell becomes a store entry where it ran (``run_cell``): its record, or its error with the
traceback when anything in it raises (a plugin, a NaN, out of memory); the entries come back to the
driver, which alone writes the store. The dense model is loaded once per model and process and every
cell prunes a private copy of it (``ModelCache``); cells of one model and calibration share layer 0's
captured inputs (``rcpu_bench.matrix.reuse``); tokenized data is cached by ``rcpu_bench.data``.
"""

from __future__ import annotations

import copy
import gc
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Protocol, TypeVar

import torch
from torch import nn

from rcpu_bench.experiment import run_experiment
from rcpu_bench.matrix.ray_resources import (
    ClusterShape,
    assigned_device,
    shipped_packages,
    task_request,
    worker_env_vars,
)
from rcpu_bench.matrix.reuse import LayerInputCache, capture_key
from rcpu_bench.matrix.spec import Cell
from rcpu_bench.matrix.store import Entry, error_info, make_entry
from rcpu_bench.model.loading import LoadedModel, check_device, load_model
from rcpu_bench.records import Record
from rcpu_bench.registry import Registry

EXECUTORS = ("local", "ray")
RAY_OBJECT_STORE_BYTES = 256 * 2**20  # entries are small; Ray would reserve ~30 % of RAM by default

OnStart = Callable[[Cell], None]
M = TypeVar("M", bound=nn.Module)


class Executor(Protocol):
    """Runs cells and yields their store entries as they finish; ``on_start(cell)`` tells when a cell starts."""

    def run(self, cells: Sequence[Cell], registry: Registry, on_start: OnStart) -> Generator[Entry, None, None]: ...


def clone_to(model: M, device: str | torch.device) -> M:
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
    After ``set_keep_dense(False)`` no CPU copy is kept: each ``load`` reads the model straight onto its device
    (the Ray executor's choice when the copy does not fit in a node's memory beside the cell's own).
    """

    def __init__(self) -> None:
        self._key: tuple[str, str | None, str, bool] | None = None
        self._dense: LoadedModel | None = None
        self.keep_dense = True

    def set_keep_dense(self, keep_dense: bool) -> None:
        """Keep the dense copy from now on, or drop it now and read every model afresh."""
        self.keep_dense = keep_dense
        if not keep_dense:
            self._key, self._dense = None, None

    def load(self, name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
             revision: str | None = None, trust_remote_code: bool = False) -> LoadedModel:
        """A copy of the dense model on ``device``: load_model's signature, for ``run_experiment(load=...)``."""
        if not self.keep_dense:
            return load_model(name_or_path, dtype=dtype, device=device, revision=revision,
                              trust_remote_code=trust_remote_code)
        key = (name_or_path, revision, dtype, trust_remote_code)
        if key != self._key:
            self._key, self._dense = None, None  # free the previous model before reading the next
            self._dense = load_model(name_or_path, dtype=dtype, device="cpu", revision=revision,
                                     trust_remote_code=trust_remote_code)
            self._key = key
        assert self._dense is not None  # loaded above, or kept from the last call with the same key
        return LoadedModel(clone_to(self._dense.model, device), self._dense.tokenizer,
                           {**self._dense.provenance, "device": device})


def _check_finite(record: Record) -> None:
    """FloatingPointError naming every perplexity of the record that is not finite (a skipped one is None)."""
    values = {"calibration": record.calibration_ppl, **{p.profile: p.ppl for p in record.perplexity}}
    bad = {name: value for name, value in values.items() if value is not None and not math.isfinite(value)}
    if bad:
        raise FloatingPointError(f"non-finite perplexity: {bad}")


def _release_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def evaluations(cell: Cell) -> Callable[[Any, Any], dict[str, Any]] | None:
    """What the cell evaluates beyond perplexity, when asked for: zero-shot accuracy (``record["zeroshot"]``) and
    llama.cpp speed (``record["inference_llama_cpp"]``, through a temporary GGUF file, on torch's threads)."""
    steps: list[Callable[[Any, Any], dict[str, Any]]] = []
    if "zeroshot" in cell.eval:
        from rcpu_bench.evaluation.zeroshot import evaluate_zeroshot  # lm-eval: imported only when asked for

        steps.append(lambda model, tokenizer: {"zeroshot": evaluate_zeroshot(model, tokenizer,
                                                                             limit=cell.zeroshot_limit)})
    if "speed-llama-cpp" in cell.eval:
        from rcpu_bench.evaluation.speed_llama_cpp import model_speed

        steps.append(lambda model, tokenizer: {"inference_llama_cpp": model_speed(
            model, tokenizer, threads=torch.get_num_threads())})
    if not steps:
        return None
    return lambda model, tokenizer: {key: value for step in steps for key, value in step(model, tokenizer).items()}


def run_cell(cell: Cell, registry: Registry, models: ModelCache, inputs: LayerInputCache | None = None,
             device: str | None = None) -> Entry:
    """Run one cell, checked before it ran (``runner.preflight``), and return its store entry; any exception becomes
    a failed entry with its traceback.

    ``inputs`` shares layer 0's captured inputs between cells (rcpu_bench.matrix.reuse); ``device`` replaces
    the cell's device (the GPU Ray assigned), the entry still records the cell as listed.
    """
    started = time.perf_counter()
    try:
        experiment = cell.experiment() if device is None else replace(cell.experiment(), device=device)
        reuse = inputs.reuse(capture_key(cell, experiment.device)) if inputs is not None else None
        check_device(experiment.device)  # the device a Ray worker was given is checked where it runs
        record = run_experiment(experiment, registry=registry, progress=False, load=models.load,
                                evaluate=evaluations(cell), reuse_capture=reuse, validated=True)
        _check_finite(record)
        return make_entry(cell, seconds=time.perf_counter() - started, record=record)
    except Exception as error:  # noqa: BLE001 - one failing cell must not stop the matrix
        return make_entry(cell, seconds=time.perf_counter() - started, error=error_info(error))
    finally:
        _release_memory()  # the failed cell's model copy (held by the traceback until now) included


class LocalExecutor:
    """Cells one after another in this process, sharing the dense model and (with ``reuse``) layer 0's inputs."""

    def __init__(self, reuse: bool = True) -> None:
        self.reuse = reuse

    def run(self, cells: Sequence[Cell], registry: Registry, on_start: OnStart) -> Generator[Entry, None, None]:
        models, inputs = ModelCache(), LayerInputCache() if self.reuse else None
        for cell in cells:
            on_start(cell)
            yield run_cell(cell, registry, models, inputs)


# ------------------------------------------------------------------------------------------------ Ray

# Per Ray worker process: tasks of one model reuse its dense copy (when it fits: ray_resources.task_request)
# and, on the CPU, its captured layer-0 inputs.
_WORKER_MODELS = ModelCache()
_WORKER_INPUTS = LayerInputCache()


def _ray_cell(cell: Cell, registry: Registry, keep_dense: bool) -> Entry:
    """The body of a Ray task: the cell on the GPU Ray assigned to this task (if any)."""
    import ray

    device = assigned_device(cell.device, ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    _WORKER_MODELS.set_keep_dense(keep_dense)
    try:
        return run_cell(cell, registry, _WORKER_MODELS, _WORKER_INPUTS, device=device)
    finally:
        if device.startswith("cuda"):
            _WORKER_INPUTS.clear()  # this GPU may go to another worker while this one idles


def import_ray():
    """The ``ray`` module, or an ImportError that says how to install it."""
    try:
        import ray
    except ImportError as error:
        raise ImportError("the ray executor needs Ray, which is not installed: "
                          "pip install 'rcpu-bench[ray]'") from error
    return ray


class RayExecutor:
    """Each cell is a Ray task; its entry comes back to the driver, which alone writes the store.

    Connects to ``address`` (an existing cluster), or uses the connection this process already has, or
    starts a small local cluster (no dashboard, a small object store, its session files in a temporary
    directory, token auth off) that it stops again. The cluster schedules the cells, so ``on_start`` is
    not called. What a task gets (rcpu_bench.matrix.ray_resources): the package and unpublished plugins
    (shipped when this executor connects; a connection the caller made must ship them itself) and the
    driver's fixture and Hugging Face variables through its runtime environment, a GPU for a CUDA cell,
    and memory for the model copies it holds.
    """

    def __init__(self, address: str | None = None):
        self.ray, self.address = import_ray(), address

    def run(self, cells: Sequence[Cell], registry: Registry, on_start: OnStart) -> Generator[Entry, None, None]:
        ray = self.ray
        with self._connected(ray, registry):
            task = ray.remote(max_retries=0, max_calls=0)(_ray_cell)  # reused workers keep their dense copy
            cluster = ClusterShape.of(ray)
            runtime_env = {"env_vars": worker_env_vars()}
            registry_ref = ray.put(registry)
            pending, refused = {}, []
            for cell in cells:
                try:
                    request = task_request(cell, cluster)
                except ValueError as error:  # the cluster cannot run it: no task that would wait forever
                    refused.append(make_entry(cell, seconds=0.0, error=error_info(error)))
                    continue
                options = {**request.options, "runtime_env": runtime_env}
                pending[task.options(**options).remote(cell, registry_ref, request.keep_dense)] = cell
            yield from refused
            try:
                while pending:
                    (ref,), _ = ray.wait(list(pending), num_returns=1)
                    yield self._entry(ray, ref, pending.pop(ref))
            finally:
                for ref in pending:
                    ray.cancel(ref, force=True)

    @contextmanager
    def _connected(self, ray, registry: Registry) -> Iterator[None]:
        """Connected to the cluster, with the packages shipped; a connection the caller made is used as it is."""
        if ray.is_initialized():
            yield
            return
        options = self._init_options()
        ray.init(**options, runtime_env={"py_modules": shipped_packages(registry)})
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
    def _entry(ray, ref, cell: Cell) -> Entry:
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
