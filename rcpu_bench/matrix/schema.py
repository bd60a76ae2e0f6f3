"""The matrix schema as data: each allowed key an :class:`rcpu_bench.declaration.Option`, and the readers.

The keys that are declared options (:class:`rcpu_bench.pruning.options.PruneConfig`'s,
:class:`rcpu_bench.experiment.Experiment`'s) are those options (:func:`option_key`,
:func:`rcpu_bench.declaration.reused`): their help, default and check come from the declaration. The matrix's
structural keys (``models``, ``methods``, ``calib``, ...) are options of kind ``structure`` with a reader each
(:func:`rcpu_bench.declaration.key` on the field of the dataclass it fills, or :func:`matrix_key`). A reader takes
``(where, value)`` (``where`` is the dotted location, e.g. ``calib.seqlen``) and returns the value parsed, or raises
:class:`MatrixError` naming the location, the bad value and what is allowed. :func:`read_keys` reads a whole mapping
against its keys; :func:`markdown_table` renders them for the reference.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import replace
from typing import Any

from rcpu_bench.declaration import REQUIRED, Option, subset_words

Reader = Callable[[str, Any], Any]


class MatrixError(ValueError):
    """A matrix (file or override) that does not validate; the message names the key or value and what is allowed."""


def error_message(error: Exception) -> str:
    """An exception's message (a KeyError's without the quotes str() adds)."""
    return error.args[0] if isinstance(error, KeyError) and error.args else str(error)


def matrix_key(name: str, read: Reader, help: str, default: Any = REQUIRED, shown: str | None = None) -> Option:
    """A structural key of a matrix mapping: its reader, what it means, its default (:data:`REQUIRED` when it must be
    given; a default is used as it stands, not read) and the default as the README shows it."""
    return Option(name, "structure", default, help, read=read, shown=shown)


def option_key(option: Option, read: Reader | None = None) -> Option:
    """The key of a declared option: its help and default, values checked by the option after ``read`` (a reader
    that parses the YAML value first, e.g. into the option's type); errors name the location."""
    return option if read is None else replace(option, read=read)


def required(key: Option) -> bool:
    return key.default is REQUIRED


def read_value(key: Option, where: str, value: Any) -> Any:
    """A YAML value of ``key`` at ``where``: read by its reader, then checked by the option unless a structure."""
    value = value if key.read is None else key.read(where, value)
    if key.kind != "structure":
        try:
            key.check(value)
        except ValueError as error:
            raise MatrixError(f"{where}: {error}") from None
    return value


def read_keys(where: str, mapping: Any, keys: Sequence[Option]) -> dict[str, Any]:
    """``mapping`` read against ``keys``: unknown keys refused, required ones demanded, defaults filled in.

    ``where`` locates the mapping in messages ("" for the matrix itself, whose keys are named bare)."""
    allowed = [key.name for key in keys]
    where_, where = where, where or "matrix"
    if not isinstance(mapping, Mapping):
        raise MatrixError(f"{where}: expected a mapping with keys {', '.join(allowed)}, got {mapping!r}")
    for name in mapping:
        if name not in allowed:
            raise MatrixError(f"{where}: unknown key {name!r}; allowed keys: {', '.join(allowed)}")
    out = {}
    for key in keys:
        if key.name in mapping:
            out[key.name] = read_value(key, f"{where_}.{key.name}" if where_ else key.name, mapping[key.name])
        elif required(key):
            names = ", ".join(k.name for k in keys if required(k))
            raise MatrixError(f"{where}: missing key {key.name!r} (required: {names})")
        else:
            out[key.name] = copy.deepcopy(key.default)  # a mapping or list default is the matrix's own
    return out


def markdown_table(keys: Sequence[Option]) -> str:
    """A Markdown table of matrix keys: name, meaning, default."""
    rows = ["| key | meaning | default |", "|---|---|---|"]
    for key in keys:
        default = "required" if required(key) else key.shown or f"`{_yaml(key.default)}`"
        rows.append(f"| `{key.name}` | {key.help} | {default} |")
    return "\n".join(rows)


def _yaml(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{k}: {_yaml(v)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    return f"{value:g}" if isinstance(value, float) else str(value)


# ----------------------------------------------------------------------------------------------- readers


def text(where: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise MatrixError(f"{where}: expected a non-empty string, got {value!r}")
    return value


def optional(read: Reader) -> Reader:
    """``read``, or None for null."""
    return lambda where, value: None if value is None else read(where, value)


def number(where: str, value: Any) -> float:
    """A number; numeric strings count too (YAML 1.1 reads 1e-2 without a dot as a string)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        return float(value)
    except (TypeError, ValueError):
        raise MatrixError(f"{where}: {value!r} is not a number") from None


def integer(minimum: int) -> Reader:
    def read(where: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise MatrixError(f"{where}: {value!r} is not an integer >= {minimum}")
        return value
    return read


def flag(where: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise MatrixError(f"{where}: {value!r} is not allowed; allowed: true, false")
    return value


def choice(allowed: Iterable[str]) -> Reader:
    allowed = tuple(allowed)

    def read(where: str, value: Any) -> str:
        if value not in allowed:
            raise MatrixError(f"{where}: {value!r} is not allowed; allowed: {', '.join(allowed)}")
        return value
    return read


def checked(check: Callable[[Any], Any], read: Reader = text) -> Reader:
    """``read``, then a library check (dtype, device, profile), its error given the location."""
    def checked_read(where: str, value: Any) -> Any:
        value = read(where, value)
        try:
            check(value)
        except (ValueError, KeyError, TypeError) as error:
            raise MatrixError(f"{where}: {error_message(error)}") from None
        return value
    return checked_read


def items(where: str, value: Any) -> list[Any]:
    """A non-empty list (a single value counts as a list of one)."""
    listed = value if isinstance(value, list) else [value]
    if not listed or None in listed:
        raise MatrixError(f"{where}: expected a non-empty list, got {value!r}")
    return listed


def subset(where: str, value: Any) -> tuple[Any, ...]:
    """A ``subset`` option's value (checked by the option): a list, a comma list ``a,b``, or ``none`` / null."""
    if value is None:
        return ()
    if isinstance(value, str):
        return subset_words(value)
    if isinstance(value, list):
        return tuple(value)
    raise MatrixError(f"{where}: expected a list or a comma list, got {value!r}")


def listed(read: Reader) -> Reader:
    """A non-empty list (a single value counts as one), each item read: a tuple."""
    return lambda where, value: tuple(read(f"{where}[{i}]", item) for i, item in enumerate(items(where, value)))
