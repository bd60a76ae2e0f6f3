"""Files and directories written whole or not at all (a temporary sibling, then a rename), and file checksums."""

from __future__ import annotations

import glob
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

_STAGING, _RETIRED = ".partial", ".old"  # suffixes of write_atomically's sibling directories

log = logging.getLogger(__name__)


def write_file_atomically(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """Have ``write(temporary)`` fill a temporary file beside ``path``, then rename it onto ``path``.

    A reader sees the old file or the complete new one, never a half-written figure; a failing or interrupted
    write leaves ``path`` as it was (and, unless killed, no temporary file).
    """
    path = Path(path)
    handle, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(handle)
    temporary = Path(name)
    try:
        write(temporary)
        follow_umask(temporary)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path


def umask() -> int:
    """The process's file-mode creation mask (read by setting it and setting it back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give ``path`` (and, for a directory, what is directly inside it) the modes a plain ``open`` / ``mkdir`` would:
    temporary files and directories are created private (0600 / 0700), whatever the user's umask says."""
    mask = umask()
    for item in [path, *(path.iterdir() if path.is_dir() else ())]:
        item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def write_atomically(directory: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool = False) -> None:
    """Have ``write(staging)`` fill a temporary directory beside ``directory``, then rename it into place.

    An interrupted or failing write leaves nothing behind (and an existing ``directory`` untouched); an
    existing ``directory`` raises FileExistsError unless ``overwrite`` or it is an empty directory (which
    ``Experiment.validate`` accepts for ``--save``, so the save after all the work must too). Every saver uses this.
    A process killed mid-save cannot clean up: its staging directory (``.NAME.<pid>.<random>.partial``) is removed
    by the next save to ``directory`` (``remove_stale_staging``).
    """
    target = Path(directory)
    if target.exists() and not overwrite and not (target.is_dir() and not any(target.iterdir())):
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_staging(target)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.{os.getpid()}.", suffix=_STAGING, dir=target.parent))
    try:
        write(staging)
        follow_umask(staging)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def _publish(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` directory to ``target``, replacing what was there."""
    if target.exists():
        retired = staging.with_suffix(_RETIRED)
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired)
    else:
        staging.rename(target)


def remove_stale_staging(target: Path) -> None:
    """Remove the staging (and retired) directories beside ``target`` left by saves whose process is gone."""
    for path in target.parent.glob(f".{glob.escape(target.name)}.*"):
        if path.suffix in (_STAGING, _RETIRED) and path.is_dir() and not _writer_alive(path, target.name):
            log.warning("removing %s, left by an interrupted save", path)
            shutil.rmtree(path, ignore_errors=True)


def _writer_alive(path: Path, name: str) -> bool:
    """Whether the process that named ``path`` (``.NAME.<pid>.…``) still runs; a name without a pid is stale."""
    pid = path.name[len(name) + 2:].partition(".")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 16 MiB blocks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
