"""Files written whole or not at all (plots, tables --out)."""

from __future__ import annotations

import pytest

from rcpu_bench.atomic_file import write_file_atomically


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
