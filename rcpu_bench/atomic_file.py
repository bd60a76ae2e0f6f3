"""Files written whole or not at all: a temporary file beside the target, then ``os.replace``."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path


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
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
    return path
