"""Where the shared fixtures (``models/``, ``data/``) live: beside the checkout, or where the environment says;
the default model among them."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path

SHARED_ENV = "RCPU_BENCH_SHARED"
DATA_ENV = "RCPU_BENCH_DATA"
DEFAULT_MODEL = "stories260K-mha"  # resolved in the shared fixtures directory


def shared_dir() -> Path:
    """``$RCPU_BENCH_SHARED`` if set, else the first existing of ``<repo>/../shared``, ``./shared``, ``../shared``."""
    if os.environ.get(SHARED_ENV):
        path = Path(os.environ[SHARED_ENV])
        if not path.is_dir():
            raise FileNotFoundError(f"${SHARED_ENV}={path} is not a directory")
        return path
    repo_root = Path(__file__).resolve().parent.parent
    tried = [repo_root.parent / "shared", Path.cwd() / "shared", Path.cwd().parent / "shared"]
    for path in tried:
        if path.is_dir():
            return path
    places = ", ".join(str(p) for p in tried)
    raise FileNotFoundError(f"no shared fixtures directory found (tried {places}); set ${SHARED_ENV} to point at it")


def data_dir() -> Path:
    """``$RCPU_BENCH_DATA`` if set, else ``shared_dir()/data``."""
    return Path(os.environ[DATA_ENV]) if os.environ.get(DATA_ENV) else shared_dir() / "data"


def default_model() -> str:
    """The embedded default model: the shared stories260K-mha fixture."""
    return str(shared_dir() / "models" / DEFAULT_MODEL)


def _creatable(path: Path, what: str) -> None:
    """Raise unless a file can be created in ``path``'s nearest existing ancestor (the missing parents get created)
    and no missing one is a broken symbolic link (which no mkdir can create)."""
    for place in (path.absolute(), *path.absolute().parents):
        if place.exists():
            break
        if place.is_symlink():
            raise ValueError(f"{what} {path}: {place} is a broken symbolic link (to {os.readlink(place)}); allowed: a "
                             "path under a writable directory")
    ancestor = next(parent for parent in path.absolute().parents if parent.exists())
    if not ancestor.is_dir():
        raise ValueError(f"{what} {path}: {ancestor} is not a directory; allowed: a path under a writable directory")
    _try_writing_in(ancestor, path, what)


def _try_writing_in(directory: Path, path: Path, what: str) -> None:
    """Create and remove a file in ``directory``: a real write test of the destination ``path`` (``os.access``
    says yes to root where a read-only file system then refuses the write)."""
    try:
        handle, name = tempfile.mkstemp(prefix=".rcpu-bench-write-test.", dir=directory)
    except OSError as error:
        raise ValueError(f"{what} {path}: cannot write in {directory} ({error.strerror}); allowed: a path under a "
                         "writable directory") from None
    os.close(handle)
    os.unlink(name)


def check_new_dir(path: str | os.PathLike, what: str) -> None:
    """Raise a one-line error unless ``path`` can be written as a new directory: absent, or an empty directory."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        kind = "a non-empty directory" if path.is_dir() else "a file"
        raise ValueError(f"{what} {path} is {kind}; allowed: a new path or an empty directory")
    _creatable(path, what)


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """Raise a one-line error unless ``path`` can be written or appended to as a file (opened for appending, which
    changes nothing, or its directory written to)."""
    path = Path(path)
    if path.exists() and not path.is_file():
        kind = "a directory" if path.is_dir() else "not a regular file"
        raise ValueError(f"{what} {path} is {kind}; allowed: a file (a new path or an existing regular file)")
    if path.exists():
        try:
            open(path, "ab").close()
        except OSError as error:
            raise ValueError(f"{what} {path} is not writable ({error.strerror}); allowed: a writable file") from None
    _creatable(path, what)


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """Raise a one-line error unless ``path`` is a writable directory or can be created as one."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file; allowed: a directory (new, or an existing one)")
    if path.exists():
        _try_writing_in(path, path, what)
    else:
        _creatable(path, what)


def check_not_input(path: str | os.PathLike, inputs: Iterable[str | os.PathLike | None], what: str) -> None:
    """Raise a one-line error when the output ``path`` is one of the command's ``inputs`` (files, or directories:
    then any existing file inside one is an input too): an output never destroys what the command reads."""
    path = Path(path)
    for given in (Path(name) for name in inputs if name):
        if given.is_dir() and path.exists() and inside(path, given):
            raise ValueError(f"{what} {path} is a file of the input {given}; allowed: a path that is none of the "
                             "command's inputs")
        if _same(path, given):
            raise ValueError(f"{what} {path} is the command's input {given}; allowed: a path that is none of the "
                             "command's inputs")


def _same(path: Path, other: Path) -> bool:
    """Whether two paths name one file (through links too)."""
    if path.exists() and other.exists():
        return os.path.samefile(path, other)
    return path.resolve() == other.resolve()


def inside(path: Path, directory: Path) -> bool:
    """Whether ``path`` lies in ``directory`` (or is it), links resolved."""
    return path.resolve().is_relative_to(directory.resolve())
