"""Greedy text continuations of a model, to read its text before and after pruning side by side.

``rcpu-bench generate`` prints them for a saved pruned directory (or any checkpoint) and, with
``--compare``, for a second model (the dense one) under each prompt; every experiment record keeps one
short continuation of a fixed prompt (``record["sample"]``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from transformers import GenerationConfig

from rcpu_bench import console
from rcpu_bench.evaluation.eval_command import check_models, load_saved_or_model
from rcpu_bench.finite import finite_logits
from rcpu_bench.model.loading import add_model_options

SAMPLE_PROMPT = "Once upon a time"
SAMPLE_TOKENS = 24


def greedy_continuation(model: Any, tokenizer: Any, prompt: str, max_new_tokens: int = 32) -> str:
    """The greedy continuation of ``prompt``: at each step the argmax token, up to ``max_new_tokens``
    new tokens or the end-of-sequence token; the decoded new tokens only (special tokens skipped)."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    encoded = tokenizer(prompt, return_tensors="pt").to(model.device)
    eos = model.config.eos_token_id
    # max_length rather than max_new_tokens: the checkpoint's own max_length would clash with the latter.
    config = GenerationConfig(max_length=encoded.input_ids.shape[1] + max_new_tokens, do_sample=False, num_beams=1,
                              eos_token_id=eos,
                              pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos)
    with torch.no_grad(), finite_logits(model, "generation"):
        output = model.generate(**encoded, generation_config=config)
    # Decoded whole, then the prompt's text cut off: decoding the new tokens alone drops a leading space.
    whole, start = (tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
                    for ids in (output[0], encoded.input_ids[0]))
    return whole[len(start):]


def text_sample(model: Any, tokenizer: Any) -> dict[str, str]:
    """A record's text sample: the greedy continuation of ``SAMPLE_PROMPT`` by ``SAMPLE_TOKENS`` tokens."""
    return {"prompt": SAMPLE_PROMPT, "text": greedy_continuation(model, tokenizer, SAMPLE_PROMPT, SAMPLE_TOKENS)}


# ----------------------------------------------------------------------------------------------- CLI


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to an ``add_subparsers()`` object and return its parser."""
    p = commands.add_parser("generate", help="greedy continuations of prompts by a model (and a second one to "
                            "compare, e.g. the dense model)", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", help="directory written by --save / save_pruned, Hugging Face model directory or hub "
                   "id (default: the stories260K-mha fixture in the shared directory)")
    p.add_argument("--compare", metavar="DIR_OR_ID", help="a second model whose continuations are printed beside")
    p.add_argument("--prompt", action="append", metavar="TEXT",
                   help=f"prompt to continue (repeatable; default {SAMPLE_PROMPT!r})")
    p.add_argument("--max-new-tokens", type=int, default=32)
    add_model_options(p)
    console.add_quiet_option(p)
    p.set_defaults(func=cmd_generate)
    return p


def cmd_generate(args: argparse.Namespace) -> int:
    """``rcpu-bench generate``: check the models, load them, print each prompt's continuations one under another."""
    from rcpu_bench.matrix.experiment import (
        default_model,  # experiment imports this module for record["sample"]
    )

    names = [args.model or default_model(), *([args.compare] if args.compare else [])]
    try:
        if args.max_new_tokens < 1:
            raise ValueError(f"--max-new-tokens must be a positive integer, got {args.max_new_tokens}")
        check_models(names, args)
    except (ValueError, OSError) as error:
        print(f"rcpu-bench: error: {error}", file=sys.stderr)
        return 2
    models = [load_saved_or_model(name, revision=args.revision, dtype=args.dtype, device=args.device)
              for name in names]
    width = max(len(name) for name in names)
    for prompt in args.prompt or [SAMPLE_PROMPT]:
        print(f"prompt: {prompt}")
        for name, loaded in zip(names, models):
            text = greedy_continuation(loaded.model, loaded.tokenizer, prompt, args.max_new_tokens)
            print(f"  {name:<{width}} | {prompt}{text}".rstrip())
    return 0
