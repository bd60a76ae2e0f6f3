"""The experiment-level options (model revision, dtype, device, evaluation batch size, ...), each declared once as an
:class:`rcpu_bench.declaration.Option`, the mechanism of the pruning options.

From the declaration come the flags of the commands that take them (:func:`add_arguments`: one default and one help
everywhere), the defaults of :class:`rcpu_bench.experiment.Experiment`'s fields (:func:`default`), the matrix keys and
their checks (:func:`rcpu_bench.matrix.schema.option_key`) and the README's table (:func:`markdown_table`).
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from dataclasses import field
from typing import Any

from rcpu_bench.declaration import Option, add_argument
from rcpu_bench.declaration import markdown_table as options_table
from rcpu_bench.evaluation import EVAL_BATCH_SIZE
from rcpu_bench.model.loading import DEFAULT_DEVICE, DEFAULT_DTYPE, DTYPES, resolve_device, resolve_dtype
from rcpu_bench.tracking import TRACKERS

OPTIONS: tuple[Option, ...] = (
    Option("revision", "text", None, "hub revision (branch, tag or commit) to pin; recorded"),
    Option("trust_remote_code", "flag", False, "run Python code shipped with the model (transformers' "
           "trust_remote_code); without it such a model is refused with an error, never prompted for"),
    Option("dtype", "text", DEFAULT_DTYPE, f"the model's dtype: {', '.join(DTYPES)} (the paper uses float32)",
           library_check=resolve_dtype),
    Option("device", "text", DEFAULT_DEVICE, "cpu, cuda or cuda:N (does not change results, nor enter cell ids)",
           library_check=resolve_device),
    Option("eval_batch_size", "count", EVAL_BATCH_SIZE, "sequences per evaluation forward pass: perplexity, lm-eval, "
           "timing (does not change perplexity or accuracy; speed's recorded figures are measured at 1)"),
    Option("zeroshot_limit", "count", None, "examples per zero-shot task, for quick runs (null: all)"),
    Option("report_to", "subset", (), "experiment trackers that log each run (transformers' report_to): "
           f"{', '.join(TRACKERS)} (a comma list) or none; run --report-to replaces a matrix's report_to",
           choices=TRACKERS, shown="none"),
)
BY_NAME: dict[str, Option] = {option.name: option for option in OPTIONS}
MODEL = ("revision", "trust_remote_code", "dtype", "device")  # what every command that loads a model takes
TABLED = tuple(option for option in OPTIONS if option.name not in ("zeroshot_limit", "report_to"))  # of every command


def default(name: str) -> Any:
    """A dataclass field whose default is the declared default of the option ``name``."""
    return field(default=BY_NAME[name].default)


def add_arguments(parser: argparse.ArgumentParser, names: Iterable[str]) -> None:
    """The flags of the options ``names``; counts are parsed as integers and checked where they are used."""
    for name in names:
        add_argument(parser, BY_NAME[name], checked_later=True)


def markdown_table() -> str:
    """The reference's table of the experiment-level options that every command loading a model takes, as
    command-line flags (a matrix's ``zeroshot_limit`` and the trackers of ``prune`` and ``run`` are not among them)."""
    return options_table(TABLED)
