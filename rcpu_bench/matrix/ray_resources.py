"""What a Ray task of a cell asks the cluster for, what it carries along, and which GPU it then uses.

- Runtime environment: workers get neither the driver's environment nor its checkout. The job ships
  ``rcpu_bench`` and every plugin package not installed in site-packages (``shipped_packages``, Ray's
  ``py_modules``: uploaded once per content, first on the workers' path; Ray takes local directories only
  at ``ray.init``), and every task carries the fixtures directory the driver resolved
  (``RCPU_BENCH_SHARED``) and the driver's data and Hugging Face variables (``worker_env_vars``). The
  fixtures are not uploaded: every node must see them at that path (a shared filesystem). Results are not
  written by workers but shipped back to the driver, which alone writes the store.
- Memory (``memory_bytes``): Ray's ``memory`` resource, estimated from the model's parameter count P (a
  weightless skeleton of its config) and the dtype's bytes b per parameter, see ``memory_bytes``.
- GPU: a CUDA cell asks for one GPU. Workers are reused across tasks (``max_calls=0``, set by the executor)
  so that a worker keeps its dense copy, and Ray is told not to rewrite ``CUDA_VISIBLE_DEVICES`` per task
  (a CUDA context, once made, ignores later changes): the task picks its device from ``ray.get_gpu_ids()``
  (``assigned_device``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from functools import lru_cache
from types import ModuleType
from typing import Any, get_args

import torch
from transformers import AutoModelForCausalLM

from rcpu_bench.matrix.cells import Cell, expand_shared
from rcpu_bench.model.loading import load_config, parameter_count, resolve_dtype
from rcpu_bench.paths import DATA_ENV, SHARED_ENV, shared_dir
from rcpu_bench.registry import Kind, Registry

NOSET_CUDA_ENV = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
FORWARDED_ENV = (DATA_ENV, "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_CACHE", "HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE",
                 "TRANSFORMERS_OFFLINE", "TOKENIZERS_PARALLELISM")
WORKER_OVERHEAD_BYTES = 2 * 2**30  # Python, torch, transformers, tokenizer, tokenized data, evaluation logits
ACTIVATION_COPIES = 4  # captured layer-0 inputs, a layer's inputs and outputs, the statistics pass's temporaries


def worker_env_vars() -> dict[str, str]:
    """Every task's environment variables (``runtime_env={"env_vars": ...}``): see the module docstring."""
    env = {name: os.environ[name] for name in FORWARDED_ENV if name in os.environ}
    return env | {SHARED_ENV: str(shared_dir()), NOSET_CUDA_ENV: "1"}


def shipped_packages(registry: Registry) -> list[str]:
    """The directories of ``rcpu_bench`` and of every registered method's top-level package that is not installed in
    site-packages (a plugin from a checkout or an editable install); installed ones must be installed on the workers."""
    names = {getattr(fn, "__module__", None) or "" for kind in get_args(Kind) for method in registry.methods(kind)
             for fn in (method.fn, method.save, method.load) if fn is not None}
    packages = {sys.modules[name.split(".")[0]] for name in names if name.split(".")[0] in sys.modules}
    shipped = [p for p in packages if p.__name__ != "rcpu_bench" and getattr(p, "__path__", None)
               and not _installed(p)]
    return [package.__path__[0] for package in [sys.modules["rcpu_bench"], *sorted(shipped, key=lambda p: p.__name__)]]


def _installed(package: ModuleType) -> bool:
    return any(part in ("site-packages", "dist-packages") for path in package.__path__ for part in path.split(os.sep))


@lru_cache(maxsize=32)
def model_size(model: str, revision: str | None) -> tuple[int, int]:
    """(parameter count P, hidden size d) of a cell's model, from a weightless (meta) skeleton of its config."""
    config, _ = load_config(expand_shared(model), revision)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config)
    return parameter_count(skeleton), config.hidden_size


def memory_bytes(cell: Cell, keep_dense: bool) -> int:
    """Bytes of host memory one cell's task needs (an estimate; Ray schedules on it, it does not enforce it).

    memory = P·b·(k + h) + h·A·N·T·d·b + O, with P parameters of b bytes (the cell's dtype), k = 1 when the worker
    keeps the dense CPU copy, h = 1 when the cell's own model lives in host memory (device cpu, or offload),
    A = ACTIVATION_COPIES copies of the N × T × d calibration activations (host-side only when h = 1) and
    O = WORKER_OVERHEAD_BYTES. A GPU cell's own model and activations are on the GPU it asks for.
    """
    parameters, hidden = model_size(cell.model, cell.revision)
    width = resolve_dtype(cell.dtype).itemsize
    on_host = int(not cell.device.startswith("cuda") or bool(cell.prune.get("offload")))
    model = parameters * width * (int(keep_dense) + on_host)
    activations = on_host * ACTIVATION_COPIES * cell.n_calib * cell.seqlen * hidden * width
    return model + activations + WORKER_OVERHEAD_BYTES


@dataclass(frozen=True)
class ClusterShape:
    """What the cluster offers: GPUs in all, and the largest memory resource of one live node (bytes)."""

    gpus: float
    node_memory: float

    @classmethod
    def of(cls, ray: Any) -> ClusterShape:
        nodes = [node["Resources"] for node in ray.nodes() if node.get("Alive")]
        return cls(gpus=ray.cluster_resources().get("GPU", 0), node_memory=max(n.get("memory", 0) for n in nodes))


@dataclass(frozen=True)
class TaskRequest:
    """Ray task options (CPUs, GPUs, memory) and whether the worker keeps the dense CPU copy."""

    options: dict[str, Any]
    keep_dense: bool


def task_request(cell: Cell, cluster: ClusterShape) -> TaskRequest:
    """One CPU, a GPU for a CUDA cell, and ``memory_bytes``: with the dense copy kept when that fits in the largest
    node's memory, else without it. A ValueError when the cluster cannot run the cell at all."""
    options: dict[str, Any] = {"num_cpus": 1}
    if cell.device.startswith("cuda"):
        if cluster.gpus < 1:
            raise ValueError(f"the cell runs on {cell.device!r} but the Ray cluster has no GPUs; "
                             "run it on a cluster with GPUs or set device: cpu")
        options["num_gpus"] = 1
    keep_dense = memory_bytes(cell, keep_dense=True) <= cluster.node_memory
    needed = memory_bytes(cell, keep_dense)
    if needed > cluster.node_memory:
        raise ValueError(f"the cell needs about {needed / 2**30:.1f} GiB of host memory (memory_bytes) but the "
                         f"largest Ray node offers {cluster.node_memory / 2**30:.1f} GiB")
    return TaskRequest({**options, "memory": needed}, keep_dense)


def assigned_device(cell_device: str, gpu_ids: list[Any], visible: str | None) -> str:
    """The torch device of a task: ``cell_device`` unless it is CUDA, then ``cuda:<i>`` for the one GPU Ray assigned.

    With CUDA_VISIBLE_DEVICES left as the node set it (``visible``, a comma-separated list of indices or
    UUIDs, or unset for all GPUs), torch's index i of Ray's GPU id g is g's position in that list, or g itself.
    """
    if not cell_device.startswith("cuda"):
        return cell_device
    if len(gpu_ids) != 1:
        raise RuntimeError(f"a CUDA cell's task must hold exactly one GPU, Ray assigned {gpu_ids!r}")
    gpu = str(gpu_ids[0])
    if not visible:
        return f"cuda:{int(gpu)}"
    listed = [entry.strip() for entry in visible.split(",")]
    if gpu not in listed:
        raise RuntimeError(f"Ray assigned GPU {gpu!r}, which is not in CUDA_VISIBLE_DEVICES={visible!r}")
    return f"cuda:{listed.index(gpu)}"
