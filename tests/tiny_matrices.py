"""Test helpers: tiny benchmark matrices on the stories260K-mha fixture that run in about a second a cell."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from rcpu_bench.matrix.spec import SHARED, Matrix, parse_matrix

QUICK_CALIB = {"source": "tinystories", "n_calib": [8], "seqlen": 64}
QUICK_PPL = ["tinystories[900:920]"]


def tiny_raw(methods: list[Any], **changes: Any) -> dict[str, Any]:
    """A matrix mapping: stories260K-mha × ``methods`` at ratio 0.2, 8 × 64 calibration tokens, 20 stories of ppl."""
    return {"name": "tiny", "models": [{"model": f"{SHARED}/models/stories260K-mha", "label": "mha"}],
            "methods": methods, "ratios": [0.2], "calib": dict(QUICK_CALIB), "ppl_profiles": list(QUICK_PPL),
            **changes}


def tiny_matrix(methods: list[Any], **changes: Any) -> Matrix:
    return parse_matrix(tiny_raw(methods, **changes))


def write_matrix(path: Path, raw: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path
