"""The Ray executor against a cluster started as a separate process, whose workers inherit neither the
fixtures variable nor the checkout: the package and the variables reach them only through the runtime
environment, and the entries come back to the driver, which alone writes the store. Plus the pure parts
of rcpu_bench.matrix.ray_resources: the device a task uses and the memory it asks for."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from processes import stop_group
from tiny_matrices import tiny_matrix
from tiny_models import needs_stories

from rcpu_bench.matrix import ray_resources
from rcpu_bench.matrix.ray_resources import (
    ACTIVATION_COPIES,
    WORKER_OVERHEAD_BYTES,
    ClusterShape,
    assigned_device,
    memory_bytes,
    shipped_packages,
    task_request,
    worker_env_vars,
)
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.spec import expand
from rcpu_bench.matrix.store import RECORDS, Store
from rcpu_bench.model.loading import load_model
from rcpu_bench.paths import DATA_ENV, SHARED_ENV, shared_dir
from rcpu_bench.plugins import default_registry

ray = pytest.importorskip("ray")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _wait_for_port(port: int, process: subprocess.Popen, seconds: float = 120.0) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"ray start exited with {process.returncode}: {process.stdout.read()}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.5)
    raise TimeoutError(f"the Ray head did not listen on port {port} within {seconds} s")


@pytest.fixture(scope="module")
def separate_cluster():
    """A two-CPU head node started by ``ray start --block`` in its own process group, from a temporary directory,
    with RCPU_BENCH_SHARED, RCPU_BENCH_DATA and PYTHONPATH removed from its (and so its workers') environment.

    Teardown ends that process group only (``ray stop`` would stop every Ray cluster of this user on the machine):
    SIGTERM, then SIGKILL after 5 s. Ray's graceful stop took about 30 s; the group holds every process of the
    cluster, and none (nor anything in /dev/shm) was left after the kill.
    """
    session = tempfile.mkdtemp(prefix="rcpu-rt-")  # short: Ray's unix socket paths live under it
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in (SHARED_ENV, DATA_ENV, "PYTHONPATH")}
    env["RAY_AUTH_MODE"] = "disabled"
    command = [str(Path(sys.executable).parent / "ray"), "start", "--head", "--block", f"--port={port}",
               "--num-cpus=2", "--num-gpus=0", "--object-store-memory=80000000", f"--memory={6 * 2**30}",
               f"--temp-dir={session}", "--include-dashboard=false", "--disable-usage-stats"]
    head = subprocess.Popen(command, cwd=session, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        _wait_for_port(port, head)
        yield {"address": f"127.0.0.1:{port}", "session": Path(session)}
    finally:
        stop_group(head, timeout=5)
        shutil.rmtree(session, ignore_errors=True)


@pytest.fixture
def fixtures_elsewhere(tmp_path, monkeypatch):
    """The driver's RCPU_BENCH_SHARED at a path no worker could guess (a link to the real fixtures), and the
    driver's working directory away from the checkout (Ray puts it on local workers' path)."""
    link = tmp_path / "fixtures-for-this-driver"
    link.symlink_to(shared_dir(), target_is_directory=True)
    monkeypatch.setenv(SHARED_ENV, str(link))
    monkeypatch.chdir(tmp_path)
    return link


@pytest.mark.slow
@needs_stories
def test_a_separate_cluster_runs_every_cell_through_the_runtime_env_and_only_the_driver_writes(
        tmp_path, separate_cluster, fixtures_elsewhere):
    matrix = tiny_matrix(["wanda-sp", "rcpu-rot"], include_dense=True)
    results = tmp_path / "results"
    summary = run_matrix(matrix, results, executor="ray", ray_address=separate_cluster["address"], progress=False)
    entries = Store(results).entries()
    assert (summary.ok, summary.failed) == (3, 0), [e.error for e in entries if e.error]
    assert sorted(e.cell.method for e in entries) == ["original", "rcpu-rot", "wanda-sp"]
    for entry in entries:
        assert entry.status == "ok" and entry.record.perplexity[0].ppl > 0
        # The worker expanded ${shared} with the driver's RCPU_BENCH_SHARED, which only the runtime env carried (or it
        # could not have loaded the model); the store writes the path back as ${shared}/... .
        assert entry.cell.model.startswith("${shared}/") and entry.record.experiment["model"] == entry.cell.model
    # The store: written once per cell, by this process (the workers never learn its path, and no store file
    # appears where they run: the cluster's directory is their working directory).
    assert len((results / RECORDS).read_text().splitlines()) == 3
    assert list(separate_cluster["session"].rglob(RECORDS)) == []
    assert not ray.is_initialized()  # the executor disconnected again


@pytest.mark.slow
def test_workers_import_the_shipped_package_and_see_the_forwarded_variables(separate_cluster, fixtures_elsewhere):
    """A probe task with the executor's runtime environment: rcpu_bench from the uploaded package, not a checkout."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    ray.init(address=separate_cluster["address"], runtime_env={"py_modules": shipped_packages(default_registry())})
    try:
        @ray.remote
        def probe():
            import rcpu_bench
            return rcpu_bench.__file__, os.environ.get(SHARED_ENV), os.environ.get("CUDA_VISIBLE_DEVICES")

        where, shared, _ = ray.get(probe.options(runtime_env={"env_vars": worker_env_vars()}).remote())
    finally:
        ray.shutdown()
    assert shared == str(fixtures_elsewhere)
    checkout = Path(ray_resources.__file__).resolve().parents[2]
    assert Path(where).resolve().is_relative_to(separate_cluster["session"].resolve())  # Ray's unpacked copy
    assert not Path(where).resolve().is_relative_to(checkout)


# ------------------------------------------------------------------------------- pure parts, no cluster


@pytest.mark.parametrize(("cell_device", "gpu_ids", "visible", "expected"), [
    ("cpu", [], None, "cpu"),
    ("cuda", [3], None, "cuda:3"),            # node shows all GPUs: torch index = Ray's id
    ("cuda:0", ["3"], "1,3,5", "cuda:1"),     # node restricted to 1,3,5: GPU 3 is torch's second
    ("cuda", ["GPU-b2"], "GPU-a1,GPU-b2", "cuda:1"),
])
def test_a_cuda_task_uses_the_gpu_ray_assigned_not_cuda_0(cell_device, gpu_ids, visible, expected):
    assert assigned_device(cell_device, gpu_ids, visible) == expected


def test_a_gpu_outside_the_visible_list_or_two_gpus_is_an_error():
    with pytest.raises(RuntimeError, match="not in CUDA_VISIBLE_DEVICES='0,1'"):
        assigned_device("cuda", ["4"], "0,1")
    with pytest.raises(RuntimeError, match="exactly one GPU"):
        assigned_device("cuda", ["0", "1"], None)


def _stories_cell(**changes):
    cells = expand(tiny_matrix(["wanda-sp"], **changes), default_registry())
    return cells[0]


@pytest.mark.slow
@needs_stories
def test_memory_request_counts_the_dense_copy_the_private_copy_and_the_activations():
    cell = _stories_cell()
    model = load_model(shared_dir() / "models" / "stories260K-mha").model  # the real model, counted independently
    tensors = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    weights = sum(tensors.values())
    activations = cell.n_calib * cell.seqlen * model.config.hidden_size * 4
    assert memory_bytes(cell, keep_dense=True) == 2 * weights + ACTIVATION_COPIES * activations + WORKER_OVERHEAD_BYTES
    assert memory_bytes(cell, keep_dense=False) == weights + ACTIVATION_COPIES * activations + WORKER_OVERHEAD_BYTES


@needs_stories
def test_the_dense_copy_is_kept_only_where_it_fits_and_a_cell_that_cannot_fit_is_refused():
    cell = _stories_cell()
    roomy = task_request(cell, ClusterShape(gpus=0, node_memory=2**40))
    assert roomy.keep_dense and roomy.options == {"num_cpus": 1, "memory": memory_bytes(cell, True)}
    tight = task_request(cell, ClusterShape(gpus=0, node_memory=memory_bytes(cell, True) - 1))
    assert not tight.keep_dense and tight.options["memory"] == memory_bytes(cell, False)
    with pytest.raises(ValueError, match="largest Ray node offers"):
        task_request(cell, ClusterShape(gpus=0, node_memory=memory_bytes(cell, False) - 1))
    with pytest.raises(ValueError, match="has no GPUs"):
        task_request(_stories_cell(device="cuda"), ClusterShape(gpus=0, node_memory=2**40))


@needs_stories
def test_a_gpu_cell_asks_for_one_gpu_and_no_host_copy_of_its_own_model():
    cell = _stories_cell(device="cuda")
    request = task_request(cell, ClusterShape(gpus=2, node_memory=2**40))
    assert request.options["num_gpus"] == 1
    dense = memory_bytes(cell, True) - memory_bytes(cell, False)  # the kept CPU copy alone
    assert memory_bytes(cell, False) == WORKER_OVERHEAD_BYTES and dense > 0

