"""The one mechanism by which options are declared: an :class:`Option` (kind, default, choices, help, cell-id rule)
and what every declaration derives from it: the check of a value, the ``--flag`` of a command, the reference row.

An option is declared where it is used, as a dataclass field (:func:`option`, :func:`key`), and :func:`declared`
reads a dataclass's options back from its fields: the pruning options (:class:`rcpu_bench.pruning.options.PruneConfig`),
the experiment-level options (:class:`rcpu_bench.experiment.Experiment`: revision, dtype, device, batch size, ...),
and the matrix schema (:class:`rcpu_bench.matrix.spec.Matrix` and the entries it lists,
:mod:`rcpu_bench.matrix.entries`), whose keys are these options plus its structural keys (``models``, ``methods``,
``calib``, ...: kind ``structure``, each with its own reader, :mod:`rcpu_bench.matrix.schema`).
"""

from __future__ import annotations

import argparse
import ast
from collections.abc import Callable, Iterable, Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from typing import Any, Literal, get_args, get_type_hints

from rcpu_bench.model.views import MODULES
from rcpu_bench.selection.select import n_pruned

Kind = Literal["name", "text", "params", "ratio", "choice", "subset", "modules", "flag", "count", "windows",
               "multiple", "structure"]
ALLOWED: dict[str, str] = {"name": "a registered name (rcpu-bench plugins)", "text": "a non-empty string",
                           "params": "a mapping of parameters", "ratio": "a number in [0, 1)",
                           "modules": f"a subset of {', '.join(MODULES)}", "flag": "true, false",
                           "count": "an integer >= 1", "windows": "an integer >= 0",
                           "multiple": "an integer >= 0 (0: off)", "structure": "what its reader reads"}


@dataclass(frozen=True)
class Option:
    """One declared option: a field of a run, its ``--flag`` and its key in a matrix.

    ``kind``: ``name`` a registered method's name (checked against the registry elsewhere), ``text`` a non-empty
    string, ``params`` keyword parameters (``--x-param K=V``, repeatable), ``ratio`` a number in [0, 1),
    ``choice`` one of ``choices``, ``subset`` a tuple of distinct ``choices`` (``a,b`` or ``none`` on the command
    line), ``modules`` a subset of :data:`MODULES`, ``flag`` a boolean, ``count`` an
    integer >= 1, ``windows`` an integer >= 0, ``multiple`` an integer >= 0 (0: off), ``structure`` a matrix
    value that ``read`` parses and checks. An option whose default is None also takes None (unset).
    ``library_check`` (a dtype's or device's name): a function that raises a ValueError naming the bad value and
    what is allowed. ``read(where, value)`` parses a matrix's YAML value (``where``: its location), raising an
    error that names the location; ``shown``: the default as the reference writes it, when not the value itself.
    """

    name: str
    kind: Kind
    default: Any
    help: str
    choices: tuple[str, ...] = ()
    hashed: Literal["always", "when-set"] = "always"
    recipe: bool = False
    cli: str | None = None  # the command-line flag when the field's name would be ambiguous (batch_size)
    library_check: Callable[[Any], Any] | None = None
    read: Callable[[str, Any], Any] | None = None
    shown: str | None = None

    @property
    def flag(self) -> str:
        """The command-line flag: ``--scorer-param`` for ``scorer_params``, else the name with dashes."""
        if self.cli is not None:
            return self.cli
        return "--" + (self.name.removesuffix("s") if self.kind == "params" else self.name).replace("_", "-")

    @property
    def allowed(self) -> str:
        """The allowed values in words, for errors and the reference."""
        if self.kind == "subset":
            return f"a comma list of {', '.join(self.choices)}, or none"
        return ", ".join(self.choices) if self.kind == "choice" else ALLOWED[self.kind]

    def check(self, value: Any) -> None:
        """Raise ValueError naming the option, the bad value and what is allowed (a library check's own error names
        the value and what it allows); registry names are not looked up."""
        if value is None and self.default is None:
            return
        if not _valid(self, value):
            members = {"modules": MODULES, "subset": self.choices}.get(self.kind)
            unknown = (sorted({v for v in value if isinstance(v, str)} - set(members))
                       if members and isinstance(value, tuple) else [])
            noun = "module" if self.kind == "modules" else "value"
            what = f"has unknown {noun}(s) {unknown}" if unknown else "is not allowed"
            raise ValueError(f"{self.name}={value!r} {what}; allowed: {self.allowed}")
        if self.kind == "ratio":
            n_pruned(100, value)
        if self.library_check is not None:
            self.library_check(value)


REQUIRED = object()  # the default of a matrix key that must be given


def option(kind: Kind, default: Any, help: str, *, hashed: Literal["always", "when-set"] = "always",
           recipe: bool = False, cli: str | None = None, library_check: Callable[[Any], Any] | None = None,
           choices: tuple[str, ...] = (), read: Callable[[str, Any], Any] | None = None,
           shown: str | None = None) -> Any:
    """A dataclass field declared as an option; its name and (for a ``Literal`` type) a choice's allowed values come
    from the field (a ``subset``'s from ``choices``), and the field's default is the option's."""
    metadata = {"option": {"kind": kind, "help": help, "hashed": hashed, "recipe": recipe, "cli": cli,
                           "library_check": library_check, "choices": choices, "read": read, "shown": shown}}
    if kind == "params":
        return field(default_factory=dict, metadata=metadata)
    return field(default=default, metadata=metadata)


def key(read: Callable[[str, Any], Any], help: str, default: Any = REQUIRED, shown: str | None = None) -> Any:
    """A dataclass field declared as a structural key of a matrix mapping: its reader ``read(where, value)``, what
    it means, its default (:data:`REQUIRED` when it must be given; a default is used as it stands, not read) and
    the default as the reference shows it. The field itself has no default: the matrix reader fills every field."""
    return field(metadata={"option": {"kind": "structure", "help": help, "read": read, "shown": shown,
                                      "default": default}})


def reused(declared_option: Option, read: Callable[[str, Any], Any] | None = None) -> Any:
    """A dataclass field that is an option declared elsewhere (a matrix's ``dtype`` is the experiment's): the same
    option, read first by ``read`` where given."""
    chosen = declared_option if read is None else replace(declared_option, read=read)
    return field(default=declared_option.default, metadata={"declared": chosen})


def declared(cls: type) -> tuple[Option, ...]:
    """The options a dataclass declares by its fields (:func:`option`, :func:`key`, :func:`reused`), in field order;
    a ``Literal`` type gives a choice's allowed values."""
    hints = get_type_hints(cls)
    found = []
    for f in fields(cls):
        if "declared" in f.metadata:
            found.append(f.metadata["declared"])
        elif "option" in f.metadata:
            values = dict(f.metadata["option"])
            default = values.pop("default", {} if f.default is MISSING else f.default)
            if values["kind"] == "choice":
                values["choices"] = get_args(hints[f.name])
            found.append(Option(name=f.name, default=default, **values))
    return tuple(found)


def _valid(option: Option, value: Any) -> bool:
    kind = option.kind
    if kind in ("name", "text"):
        return isinstance(value, str) and bool(value)
    if kind == "params":
        return isinstance(value, Mapping) and all(isinstance(k, str) for k in value)
    if kind == "ratio":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "choice":
        return value in option.choices
    if kind in ("modules", "subset"):
        members = MODULES if kind == "modules" else option.choices
        return (isinstance(value, tuple) and all(isinstance(v, str) for v in value) and set(value) <= set(members)
                and len(set(value)) == len(value))
    if kind == "flag":
        return isinstance(value, bool)
    if kind == "structure":
        return True  # its reader checks it
    return isinstance(value, int) and not isinstance(value, bool) and value >= (1 if kind == "count" else 0)


# ---------------------------------------------------------------------------------------------- command line


def parse_param(pair: str) -> tuple[str, Any]:
    """``key=value``; the value is a Python literal where it parses (1e-3, 'l2', True), else a string."""
    key, sep, value = pair.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"bad parameter {pair!r}; expected KEY=VALUE")
    try:
        return key, ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return key, value


def parse_modules(text: str) -> tuple[str, ...]:
    """``attention,mlp``, one of them, or ``none``."""
    names = tuple(n for n in text.split(",") if n) if text != "none" else ()
    bad = [n for n in names if n not in MODULES]
    if bad:
        raise argparse.ArgumentTypeError(f"unknown module(s) {bad}; allowed: {', '.join(MODULES)} or none")
    return names


def subset_words(text: str) -> tuple[str, ...]:
    """``a,b`` as ``("a", "b")``; ``none`` (or nothing) as ``()``: how a ``subset`` option is written."""
    return () if text.strip() in ("none", "") else tuple(word.strip() for word in text.split(","))


def parse_subset(option: Option) -> Callable[[str], tuple[str, ...]]:
    """An argparse type for a ``subset`` option: :func:`subset_words`, checked by the option."""
    def parse(text: str) -> tuple[str, ...]:
        value = subset_words(text)
        try:
            option.check(value)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return value
    return parse


def positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (batch sizes, token and repeat counts)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: an integer >= 1")
    return value


def metavar(option: Option) -> str | None:
    metavars = {"name": "NAME", "text": option.name.upper(), "params": "KEY=VALUE", "ratio": "RHO",
                "subset": option.name.upper(), "modules": "MODULES", "count": "N", "windows": "N", "multiple": "N"}
    return metavars.get(option.kind)


def add_argument(parser: argparse.ArgumentParser, option: Option, *, checked_later: bool = False) -> None:
    """The option's flag; parameters are repeatable ``KEY=VALUE`` pairs. ``checked_later``: integers parsed as
    plain ``int`` and left to :meth:`Option.check` (whose message names the option)."""
    kwargs: dict[str, Any] = {"dest": option.name, "help": option.help}
    if option.kind == "flag":
        kwargs["action"] = "store_true"
    elif option.kind == "params":
        kwargs.update(action="append", default=[], type=parse_param, metavar="KEY=VALUE")
    else:
        default = shown(option.default) if option.kind in ("modules", "subset") else option.default  # parsed
        kinds = {"ratio": float, "count": int if checked_later else positive_int, "windows": int, "multiple": int,
                 "modules": parse_modules, "subset": parse_subset(option)}
        kwargs.update(default=default, metavar=metavar(option), type=kinds.get(option.kind, str))
        if option.kind == "choice":
            kwargs.update(choices=option.choices, metavar=None)
    parser.add_argument(option.flag, **kwargs)


# --------------------------------------------------------------------------------------------- reference


def shown(value: Any) -> str:
    """A default as the reference shows it."""
    if isinstance(value, tuple):
        return ",".join(value) or "none"
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def markdown_table(options: Iterable[Option]) -> str:
    """A reference table of options as command-line flags, one row per option: flag, meaning, default."""
    rows = ["| option | meaning | default |", "|---|---|---|"]
    for option in options:
        value = "" if option.kind == "flag" else f" {metavar(option) or '|'.join(option.choices)}"
        default = "" if option.kind in ("params", "flag") else f"`{shown(option.default)}`"
        rows.append(f"| `{option.flag}{value.replace('|', chr(92) + '|')}` | {option.help} | {default} |")
    return "\n".join(rows)
