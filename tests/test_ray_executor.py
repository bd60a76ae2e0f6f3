"""The Ray executor on a small local cluster: cells run as tasks, the driver stores every entry."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
from tiny_matrices import tiny_matrix
from tiny_models import needs_stories

from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.store import Store

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_cluster():
    """A two-CPU local cluster without dashboard or auth token, its session files in a short temp path."""
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    session = tempfile.mkdtemp(prefix="rcpu-ray-test-")
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=100 * 2**20, _temp_dir=session,
             log_to_driver=False)
    yield
    ray.shutdown()
    shutil.rmtree(session, ignore_errors=True)


@pytest.mark.slow
@needs_stories
def test_cells_run_as_ray_tasks_and_the_driver_stores_both_entries(tmp_path, local_cluster):
    summary = run_matrix(tiny_matrix(["wanda-sp", "rcpu-rot"]), tmp_path, executor="ray", progress=False)
    assert (summary.ok, summary.failed) == (2, 0)
    entries = Store(tmp_path).entries()
    assert sorted(e["cell"]["method"] for e in entries) == ["rcpu-rot", "wanda-sp"]
    assert all(e["status"] == "ok" and e["record"]["perplexity"][0]["ppl"] > 0 for e in entries)
    assert ray.is_initialized()  # a cluster the executor did not start is left running
