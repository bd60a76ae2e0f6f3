"""``rcpu-bench generate``: greedy continuations of prompts by a model (a saved pruned directory or any
checkpoint) and, with ``--compare``, by a second one (the dense model), one under another."""

from __future__ import annotations

import argparse

from rcpu_bench import console
from rcpu_bench.commands import command
from rcpu_bench.commands.shared import check_models
from rcpu_bench.evaluation.generation import SAMPLE_PROMPT, check_length, greedy_continuation
from rcpu_bench.experiment import MODEL, add_flags
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import default_model
from rcpu_bench.plugins import default_registry


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="directory written by --save / save_pruned, Hugging Face model directory or hub "
                   "id (default: the stories260K-mha fixture in the shared directory)")
    p.add_argument("--compare", metavar="DIR_OR_ID", help="a second model whose continuations are printed beside")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help=f"prompt to continue (repeatable; default {SAMPLE_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=32)
    add_flags(p, MODEL)
    console.add_quiet_option(p)


@command()
def run(args: argparse.Namespace) -> int:
    """Check the models, load them, print each prompt's continuations one under another."""
    names = [args.model or default_model(), *([args.compare] if args.compare else [])]
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
    check_models(names, args)
    models = [load_saved_or_model(name, revision=args.revision, dtype=args.dtype, device=args.device,
                                  registry=default_registry(), trust_remote_code=args.trust_remote_code)
              for name in names]
    for loaded in models:  # every prompt fits every model's context, before the first is generated
        for prompt in args.prompt or [SAMPLE_PROMPT]:
            check_length(loaded.model, loaded.tokenizer, prompt, args.max_new_tokens)
    width = max(len(name) for name in names)
    for prompt in args.prompt or [SAMPLE_PROMPT]:
        print(f"prompt: {prompt}")
        for name, loaded in zip(names, models):
            text = greedy_continuation(loaded.model, loaded.tokenizer, prompt, args.max_new_tokens)
            print(f"  {name:<{width}} | {prompt}{text}".rstrip())
    return 0
