"""What the subcommands that evaluate models take: the evaluation batch size and the models to check."""

from __future__ import annotations

import argparse

from rcpu_bench.evaluation import EVAL_BATCH_SIZE
from rcpu_bench.model.loading import resolve_device, resolve_dtype
from rcpu_bench.model.persistence import check_model_argument


def add_eval_batch_size_option(parser: argparse.ArgumentParser, what: str) -> None:
    """``--eval-batch-size``, one default for every command (:data:`rcpu_bench.evaluation.EVAL_BATCH_SIZE`)."""
    parser.add_argument("--eval-batch-size", type=int, default=EVAL_BATCH_SIZE, help=what)


def check_models(names: list[str], args: argparse.Namespace) -> None:
    """Reject a bad ``--dtype`` or ``--device`` and any bad model argument (``check_model_argument``), before
    anything is loaded: what every command that loads models checks first."""
    resolve_dtype(args.dtype)
    resolve_device(args.device)
    for name in names:
        check_model_argument(name, args.revision)
