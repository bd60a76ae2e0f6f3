"""Files and directories written whole or not at all (plots, tables --out, saves), one writer per output, and the
staging a killed writer leaves removed by the next."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from tiny_models import STORIES_MHA, needs_stories

from rcpu_bench import atomic_file
from rcpu_bench.atomic_file import claimed, write_atomically, write_file_atomically
from rcpu_bench.cli import main


def test_a_finished_write_replaces_the_file_and_leaves_no_temporary(tmp_path):
    target = tmp_path / "figure.png"
    target.write_bytes(b"old")
    write_file_atomically(target, lambda path: path.write_bytes(b"new figure"))
    assert target.read_bytes() == b"new figure" and [p.name for p in tmp_path.iterdir()] == ["figure.png"]


@pytest.mark.parametrize("existing", [b"old figure", None])
def test_a_failing_write_leaves_the_old_file_and_no_temporary(tmp_path, existing):
    target = tmp_path / "figure.png"
    if existing is not None:
        target.write_bytes(existing)

    def half_then_fail(path):
        path.write_bytes(b"half a fig")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        write_file_atomically(target, half_then_fail)
    assert (target.read_bytes() if target.exists() else None) == existing
    assert [p.name for p in tmp_path.iterdir()] == ([] if existing is None else ["figure.png"])


# --------------------------------------------------------- one writer per output, and what a killed writer leaves


@pytest.fixture
def other_process():
    """A live process other than this one (its pid names another writer's staging)."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process.pid
    process.kill()
    process.wait()


def test_a_claimed_output_refuses_a_second_writer_at_once_and_frees_it_after(tmp_path, other_process):
    target = tmp_path / "pruned"
    with claimed(target):
        (marker,) = tmp_path.iterdir()
        assert marker.name.startswith(f".pruned.{os.getpid()}.") and marker.suffix == ".partial"
        write_atomically(target, lambda staging: (staging / "weights").write_text("w"))  # the claimant itself saves
    assert [p.name for p in tmp_path.iterdir()] == ["pruned"]
    another = tmp_path / "other"
    (tmp_path / f".other.{other_process}.abcd1234.partial").mkdir()  # another live process is writing it
    with pytest.raises(FileExistsError, match=f"{another} is being written by another process \\(pid "
                                              f"{other_process}\\); allowed: one writer per output"):
        with claimed(another):
            pytest.fail("the work ran")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".other.{other_process}.abcd1234.partial", "pruned"]


@needs_stories
def test_a_second_prune_saving_to_the_same_directory_is_refused_before_its_work(tmp_path, other_process, capsys,
                                                                                monkeypatch):
    from rcpu_bench.model import loading

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    (tmp_path / f".pruned.{other_process}.abcd1234.partial").mkdir()
    code = main(["prune", "--model", str(STORIES_MHA), "--calib", "tinystories:8x32", "--ppl", "tinystories[900:902]",
                 "--quiet", "--save", str(tmp_path / "pruned")])
    assert code == 2
    assert capsys.readouterr().err == (f"rcpu-bench prune: error: {tmp_path / 'pruned'} is being written by another "
                                       f"process (pid {other_process}); allowed: one writer per output (wait for it "
                                       "to end, or choose another path)\n")


def test_staging_is_stale_when_its_writer_is_gone_or_its_pid_was_reused(tmp_path, other_process, monkeypatch):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead = tmp_path / f".out.{gone.stdout.strip()}.dead0000.partial"
    live = tmp_path / f".out.{other_process}.live0000.partial"
    for path in (dead, live):
        path.mkdir()
    assert atomic_file._stale(dead) and not atomic_file._stale(live)
    assert atomic_file._process_start(other_process) <= time.time()
    # the process holding the pid started after the staging was last written: a gone writer's pid, reused
    monkeypatch.setattr(atomic_file, "_process_start", lambda pid: time.time() + 60)
    assert atomic_file._stale(live)


def test_a_directory_written_through_a_link_lands_where_it_points(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "elsewhere")
    write_atomically(tmp_path / "link", lambda staging: (staging / "weights").write_text("w"))
    assert (tmp_path / "link").is_symlink() and (tmp_path / "elsewhere" / "weights").read_text() == "w"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "link"]
