"""Files and directories written whole or not at all (a temporary sibling, then a rename), and file checksums.

Every staging name carries the writer's pid (``.NAME.<pid>.<random>.partial``): concurrent writers of one output
never share one, and a staging file or directory left by a killed writer is removed by the next write beside it
(its process is gone, or the process now holding its pid started after it was last written). A write that fails (a
full disk, say) is one OSError naming the output, with the staging removed; where the size of a write is known
beforehand, ``check_free_space`` refuses it before any work.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import glob
import hashlib
import logging
import math
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

_STAGING, _RETIRED = ".partial", ".old"  # suffixes of the staging and retired siblings

log = logging.getLogger(__name__)


def write_file_atomically(path: str | os.PathLike, write: Callable[[Path], None], *, replace: bool = True) -> Path:
    """Have ``write(temporary)`` fill a temporary file beside ``path``, then rename it onto ``path``.

    A reader sees the old file or the complete new one, never a half-written figure; a failing or interrupted
    write leaves ``path`` as it was (and, unless killed, no temporary file). Without ``replace`` a ``path`` that
    exists when the file is published (another writer's) is kept and FileExistsError raised.
    """
    path = Path(path)
    temporary = staging_sibling(path)
    try:
        with writing(path):
            write(temporary)
            follow_umask(temporary)
            _publish_file(temporary, path, replace)
    finally:
        temporary.unlink(missing_ok=True)
    return path


def staging_sibling(target: Path, *, directory: bool = False) -> Path:
    """A new hidden file (or ``directory``) beside ``target`` named for this writer, ``.NAME.<pid>.<random>.partial``,
    after the stale ones of writers that are gone were removed; the missing parents of ``target`` are created."""
    remove_stale_staging(target)
    with writing(target):
        target.parent.mkdir(parents=True, exist_ok=True)
        names = {"prefix": f".{target.name}.{os.getpid()}.", "suffix": _STAGING, "dir": target.parent}
        if directory:
            return Path(tempfile.mkdtemp(**names))
        handle, name = tempfile.mkstemp(**names)
    os.close(handle)
    return Path(name)


def _publish_file(temporary: Path, path: Path, replace: bool) -> None:
    """Rename ``temporary`` onto ``path``; without ``replace``, never over a file that exists by now (a hard link
    publishes atomically or fails)."""
    if replace:
        os.replace(temporary, path)
        return
    try:
        os.link(temporary, path)
    except FileExistsError:
        raise FileExistsError(f"{path} was created by another writer while this one wrote it; it is kept as it is "
                              "(allowed: one writer per output)") from None


def umask() -> int:
    """The process's file-mode creation mask (read by setting it and setting it back)."""
    mask = os.umask(0o077)
    os.umask(mask)
    return mask


def follow_umask(path: Path) -> None:
    """Give ``path`` and, for a directory, everything under it the modes a plain ``open`` / ``mkdir`` would:
    temporary files and directories are created private (0600 / 0700), whatever the user's umask says."""
    mask = umask()
    items = [path, *(path.rglob("*") if path.is_dir() else ())]
    for item in items:
        if not item.is_symlink():
            item.chmod((0o777 if item.is_dir() else 0o666) & ~mask)


def write_atomically(directory: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool = False) -> None:
    """Have ``write(staging)`` fill a temporary directory beside ``directory``, then rename it into place.

    An interrupted or failing write leaves nothing behind (and an existing ``directory`` untouched); an
    existing ``directory`` raises FileExistsError unless ``overwrite`` or it is an empty directory (which
    ``Experiment.validate`` accepts for ``--save``, so the save after all the work must too), and so does one
    that another writer published meanwhile. Every saver uses this. A process killed mid-save cannot clean up:
    its staging directory is removed by the next save to ``directory`` (``remove_stale_staging``). A symbolic link
    is written through: the directory it points to is the output.
    """
    target = Path(directory)
    target = target.resolve() if target.is_symlink() else target
    if target.exists() and not overwrite and not _empty_directory(target):
        raise FileExistsError(f"{target} already exists and is kept as it is; allowed: a new path or an empty "
                              "directory (overwrite=True replaces it)")
    staging = staging_sibling(target, directory=True)
    try:
        with writing(target):
            write(staging)
            follow_umask(staging)
            _publish(staging, target, overwrite)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


@contextlib.contextmanager
def claimed(directory: str | os.PathLike) -> Iterator[None]:
    """Hold the output ``directory`` for this process while the work that ends in writing it runs (a hidden staging
    sibling of this process marks it): an output another live process holds or writes is refused at once, a
    FileExistsError naming it, before the work, not after it. Two processes that claim one output at the same
    moment may both be refused; neither writes."""
    target = Path(directory)
    target = target.resolve() if target.is_symlink() else target
    _refuse_other_writers(target)
    marker = staging_sibling(target, directory=True)
    try:
        _refuse_other_writers(target)
        yield
    finally:
        shutil.rmtree(marker, ignore_errors=True)


def _refuse_other_writers(target: Path) -> None:
    """FileExistsError naming the live processes other than this one whose staging sits beside ``target``."""
    others = sorted({int(parts[1]) for path in target.parent.glob(f".{glob.escape(target.name)}.*")
                     if path.suffix == _STAGING and not _stale(path)
                     and len(parts := path.stem.rsplit(".", 2)) == 3 and parts[1].isdigit()} - {os.getpid()})
    if others:
        raise FileExistsError(f"{target} is being written by another process (pid {', '.join(map(str, others))}); "
                              "allowed: one writer per output (wait for it to end, or choose another path)")


def _empty_directory(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def _publish(staging: Path, target: Path, overwrite: bool) -> None:
    """Move the finished ``staging`` directory to ``target``: over an empty directory, or with ``overwrite`` over
    what is there; another writer's ``target`` published meanwhile raises FileExistsError."""
    if overwrite and target.exists() and not _empty_directory(target):
        retired = staging.with_suffix(_RETIRED)
        target.rename(retired)
        staging.rename(target)
        _remove(retired)
        return
    try:
        staging.rename(target)  # replaces an empty directory; fails on a non-empty one or a file
    except OSError as error:
        if error.errno not in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
            raise
        raise FileExistsError(f"{target} was written by another writer while this one saved it; it is kept as it "
                              "is (allowed: one writer per output)") from None


def remove_stale_staging(target: Path) -> None:
    """Remove the staging files and directories (and retired directories) beside ``target`` left by writers whose
    process is gone."""
    _remove_stale(target.parent.glob(f".{glob.escape(target.name)}.*"))


def remove_stale_staging_in(directory: Path) -> None:
    """Remove every staging file or directory in ``directory`` left by a writer whose process is gone (the figures
    of a killed report, say)."""
    _remove_stale(directory.glob(".*"))


def _remove_stale(paths: Iterable[Path]) -> None:
    for path in paths:
        if _stale(path):
            log.warning("removing %s, left by an interrupted write", path)
            _remove(path)


def _remove(path: Path) -> None:
    """Remove a file, a link (not what it points to) or a directory tree, as far as it goes: what remains of a
    retired or staging sibling is removed by a later write (``remove_stale_staging``)."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)


def _stale(path: Path) -> bool:
    """Whether ``path`` is a staging (``.NAME.<pid>.<random>.partial``) or retired (``….old``) sibling whose writer's
    process is gone, or a ``.partial`` named before staging names carried a pid."""
    if path.suffix not in (_STAGING, _RETIRED):
        return False
    parts = path.stem.rsplit(".", 2)
    if len(parts) == 3 and parts[1].isdigit():
        pid = int(parts[1])
        if not _process_alive(pid):
            return True
        started = _process_start(pid)
        try:  # a writer starts before it writes: a process younger than the path reuses a gone writer's pid
            status = path.lstat()
        except FileNotFoundError:
            return False
        return started is not None and max(status.st_mtime, status.st_ctime) < started - _CLOCK_SLACK
    return path.suffix == _STAGING


def _process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (another user's included)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):  # no such process (or a number no pid can be)
        return False
    except PermissionError:  # another user's live process
        return True
    return True


_CLOCK_SLACK = 2.0  # seconds: /proc's boot time is whole seconds, a process's start time in clock ticks


def _process_start(pid: int) -> float | None:
    """When process ``pid`` started (seconds since the epoch), from Linux's /proc; None where that is not known."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        boot = next(line for line in Path("/proc/stat").read_text().splitlines() if line.startswith("btime "))
        return int(boot.split()[1]) + int(fields[19]) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def check_free_space(path: Path, needed: int, what: str, *, allowed: str) -> None:
    """OSError naming ``what`` unless the file system of ``path`` (or of its nearest existing parent, where it is to
    be created) has ``needed`` bytes free: a write whose size is known is refused before any work."""
    existing = next(place for place in (path.absolute(), *path.absolute().parents) if place.exists())
    free = shutil.disk_usage(existing).free
    if free < needed:
        raise OSError(f"{what} need about {byte_size(needed)} and {existing} has {byte_size(free)} free; allowed: "
                      f"{allowed}")


def byte_size(count: int) -> str:
    """A byte count for people: 517 MiB, 1.4 GiB, 48 KiB."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if count >= scale:
            return f"{count / scale:,.1f} {unit}" if count < 10 * scale else f"{count / scale:,.0f} {unit}"
    return f"{math.ceil(count / 2**10):,} KiB"


@contextlib.contextmanager
def writing(target: Path) -> Iterator[None]:
    """Turn an OSError raised while writing ``target`` (through a hidden staging sibling, say) into one naming
    ``target``."""
    try:
        yield
    except FileExistsError:
        raise
    except OSError as error:
        raise write_error(target, error) from error


def write_error(target: Path, error: BaseException) -> OSError:
    """The one-line OSError of a failed write of ``target`` (a full disk, a read-only file system, ...)."""
    reason = getattr(error, "strerror", None) or str(error)
    return OSError(f"cannot write {target}: {reason}; it is left as it was and no partial file remains")


def file_sha256(path: Path) -> str:
    """The sha256 hex digest of a file, read in 16 MiB blocks; hashed once per process while the file's size and
    modification time stay the same (a load that verified a file before reading it hashes it once)."""
    stat = os.stat(path)
    return _sha256(str(Path(path).resolve()), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


@functools.lru_cache(maxsize=256)
def _sha256(path: str, *identity: int) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(1 << 24):
            digest.update(block)
    return digest.hexdigest()
