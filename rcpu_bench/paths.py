"""Where the shared fixtures (``models/``, ``data/``) live: beside the checkout, or where the environment says;
the default model among them."""

from __future__ import annotations

import os
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
    """Raise unless ``path``'s nearest existing ancestor is a writable directory (the missing parents get created)."""
    ancestor = next(parent for parent in path.absolute().parents if parent.exists())
    if not ancestor.is_dir():
        raise ValueError(f"{what} {path}: {ancestor} is not a directory; allowed: a path under a writable directory")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path}: {ancestor} is not writable; allowed: a path under a writable directory")


def check_new_dir(path: str | os.PathLike, what: str) -> None:
    """Raise a one-line error unless ``path`` can be written as a new directory: absent, or an empty directory."""
    path = Path(path)
    if path.exists() and not (path.is_dir() and not any(path.iterdir())):
        kind = "a non-empty directory" if path.is_dir() else "a file"
        raise ValueError(f"{what} {path} is {kind}; allowed: a new path or an empty directory")
    _creatable(path, what)


def check_output_file(path: str | os.PathLike, what: str) -> None:
    """Raise a one-line error unless ``path`` can be written or appended to as a file."""
    path = Path(path)
    if path.exists() and not path.is_file():
        raise ValueError(f"{what} {path} is a directory; allowed: a file (new or to append to)")
    if path.exists() and not os.access(path, os.W_OK):
        raise ValueError(f"{what} {path} is not writable; allowed: a writable file")
    _creatable(path, what)


def check_output_dir(path: str | os.PathLike, what: str) -> None:
    """Raise a one-line error unless ``path`` is a writable directory or can be created as one."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{what} {path} is a file; allowed: a directory (new, or an existing one)")
    if path.exists() and not os.access(path, os.W_OK | os.X_OK):
        raise ValueError(f"{what} {path} is not writable; allowed: a writable directory")
    _creatable(path, what)
