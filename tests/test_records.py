"""The environment a record carries: device name, CUDA and driver versions, threads, the harness's git commit."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from rcpu_bench import records

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", *args],
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path) -> Path:
    """A git repository with a package directory ``pkg`` (one committed file) and a ``results`` directory."""
    git(tmp_path, "init", "-q")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "code.py").write_text("x = 1\n")
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "records.jsonl").write_text("{}\n")
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "first")
    return tmp_path


def test_a_clean_checkout_gives_its_head_commit(repo):
    assert records.harness_commit(repo / "pkg") == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": False}


def test_an_edited_harness_file_is_dirty_and_results_written_elsewhere_are_not(repo):
    (repo / "results" / "records.jsonl").write_text("{}\n{}\n")
    (repo / "pkg" / "new_untracked.py").write_text("")
    assert records.harness_commit(repo / "pkg")["dirty"] is False
    (repo / "pkg" / "code.py").write_text("x = 2\n")
    assert records.harness_commit(repo / "pkg") == {"commit": git(repo, "rev-parse", "HEAD"), "dirty": True}


def test_outside_a_git_checkout_the_commit_is_unknown(tmp_path):
    assert records.harness_commit(tmp_path) == {"commit": "unknown", "dirty": "unknown"}


def test_cpu_environment(monkeypatch):
    monkeypatch.setattr(records, "harness_commit", lambda: {"commit": "abc", "dirty": False})
    env = records.environment("cpu")
    names = [line.partition(":")[2].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")] if Path("/proc/cpuinfo").exists() else []
    assert env == {"device": "cpu", "device_name": names[0] if names else env["device_name"], "cuda_version": "n/a",
                   "driver_version": "n/a", "threads": torch.get_num_threads(),
                   "harness": {"commit": "abc", "dirty": False}}
    assert env["device_name"]


def test_a_missing_nvidia_smi_gives_na_not_a_crash(monkeypatch):
    """With CUDA claimed available but no nvidia-smi on PATH, the driver is "n/a"."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "Fake GPU")
    monkeypatch.setattr(torch.version, "cuda", "12.4")
    monkeypatch.setenv("PATH", "/nonexistent")
    env = records.environment("cuda:0")
    assert (env["device_name"], env["cuda_version"], env["driver_version"]) == ("Fake GPU", "12.4", "n/a")
