"""Saving a figure: PNG (150 dpi), PDF and SVG, byte-for-byte reproducible (no dates, tool versions or random ids),
each written atomically."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import matplotlib
from matplotlib.figure import Figure

from rcpu_bench.atomic_file import remove_stale_staging_in, write_file_atomically

DPI = 150  # PNG resolution: a many-panel figure stays under 1 MiB; PDF and SVG are vector
FORMATS = ("png", "pdf", "svg")
# No creation dates or tool versions in the files, and fixed SVG ids: the same data give the same bytes.
_METADATA = {"png": {"Software": None}, "pdf": {"CreationDate": None, "Producer": None}, "svg": {"Date": None}}


def save_figure(figure: Figure, out_dir: Path, stem: str) -> list[Path]:
    """``figure`` as ``out_dir/stem.{png,pdf,svg}`` (the directory made if missing, the hidden partial files of killed
    writers removed from it); their paths, PNG first."""
    out_dir.mkdir(parents=True, exist_ok=True)
    remove_stale_staging_in(out_dir)
    paths = []
    for fmt in FORMATS:
        path = out_dir / f"{stem}.{fmt}"
        with matplotlib.rc_context({"svg.hashsalt": "rcpu-bench"}):
            write_file_atomically(path, partial(figure.savefig, format=fmt, dpi=DPI, bbox_inches="tight",
                                                metadata=_METADATA[fmt]))
        paths.append(path)
    return paths
