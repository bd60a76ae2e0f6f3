"""``rcpu-bench speed``: parameters and inference speed (prefill and decode tokens/s) of models, one line each."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from rcpu_bench import console
from rcpu_bench.commands import command
from rcpu_bench.commands.shared import add_eval_batch_size_option, check_models
from rcpu_bench.evaluation.speed import NEW_TOKENS, PROMPT_TOKENS, REPEATS, inference_speed
from rcpu_bench.model.loading import add_model_options, parameter_count
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import default_model


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="DIR_OR_ID",
                   help="saved pruned directory, model directory or hub id (repeatable; default: the "
                   "stories260K-mha fixture in the shared directory)")
    add_eval_batch_size_option(p, "sequences per timed forward pass (the records' inference figures are measured at "
                               "1: --eval-batch-size 1 compares with them)")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=REPEATS)
    add_model_options(p)
    console.add_quiet_option(p)


@command()
def run(args: argparse.Namespace) -> int:
    """Check the models, then one line per model: parameters, prefill and decode tokens/s."""
    names = args.model or [default_model()]
    check_models(names, args)
    rows = []
    for name in names:
        model = load_saved_or_model(name, revision=args.revision, dtype=args.dtype, device=args.device).model
        speed = inference_speed(model, batch_size=args.eval_batch_size, prompt_tokens=args.prompt_tokens,
                                new_tokens=args.new_tokens, repeats=args.repeats)
        rows.append((name, f"{parameter_count(model):,}", f"{speed['prefill_tokens_per_s']:,.0f}",
                     f"{speed['decode_tokens_per_s']:,.0f}"))
    print(tabulate(rows, headers=["model", "parameters", "prefill tokens/s", "decode tokens/s"]))
    print(f"batch {args.eval_batch_size}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of "
          f"{args.repeats} after a warm-up, on {args.device}")
    return 0
