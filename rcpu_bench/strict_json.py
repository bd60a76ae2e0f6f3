"""Strict JSON for records and manifests: finite numbers only, no tensors, no bare ``NaN`` ever written.

Python's ``json`` writes ``NaN`` and ``Infinity``, which are not JSON; and ``default=str`` would turn a
tensor into the text ``"tensor([...])"``. A value that is not strict JSON is refused with the path of
the offending field, so the writer (a plugin's ``info``, a record field) can be named.
"""

from __future__ import annotations

import json
import math
from pathlib import PurePath
from typing import Any

import torch

ALLOWED = "finite numbers, strings, booleans, None, and lists or dicts of them (string keys)"


def problem(value: Any, where: str) -> str | None:
    """Why ``value`` (found at ``where``) is not strict JSON, or None when it is."""
    if value is None or isinstance(value, (bool, str, int)):
        return None
    if isinstance(value, float):
        return None if math.isfinite(value) else f"{where} = {value!r} is not finite"
    if isinstance(value, torch.Tensor):
        return (f"{where} is a tensor of shape {tuple(value.shape)}; report a number (float(t)) or a list "
                "(t.tolist())")
    if isinstance(value, (list, tuple)):
        return next((p for i, item in enumerate(value) if (p := problem(item, f"{where}[{i}]"))), None)
    if isinstance(value, dict):
        for key, item in value.items():
            if not isinstance(key, (str, int)) or isinstance(key, bool):
                return f"{where} has the key {key!r}; keys must be strings"
            if p := problem(item, f"{where}[{key!r}]"):
                return p
        return None
    return f"{where} is a {type(value).__name__}; allowed: {ALLOWED}"


def dumps(record: dict[str, Any], **kwargs: Any) -> str:
    """``json.dumps`` with ``allow_nan=False``; paths are written as strings, any other non-JSON value raises
    ValueError naming its field."""
    def default(obj: Any) -> Any:
        if isinstance(obj, PurePath):
            return str(obj)
        raise ValueError(problem(obj, "record") or f"a {type(obj).__name__} is not JSON")

    try:
        return json.dumps(record, allow_nan=False, default=default, **kwargs)
    except ValueError as error:
        found = problem(_paths_as_strings(record), "record")
        raise ValueError(f"not strict JSON: {found or error}") from None


def _paths_as_strings(value: Any) -> Any:
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {k: _paths_as_strings(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_paths_as_strings(v) for v in value]
    return value
