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
