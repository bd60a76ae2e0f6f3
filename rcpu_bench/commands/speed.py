"""``rcpu-bench speed``: parameters and inference speed (prefill and decode tokens/s) of models, one line each per
engine: transformers, and llama.cpp through a temporary GGUF file (:mod:`rcpu_bench.evaluation.speed_llama_cpp`)."""

from __future__ import annotations

import argparse
from typing import Any

import torch
from tabulate import tabulate

from rcpu_bench import console
from rcpu_bench.commands import command
from rcpu_bench.commands.shared import check_models
from rcpu_bench.declaration import positive_int
from rcpu_bench.evaluation.speed import NEW_TOKENS, PROMPT_TOKENS, REPEATS, check_counts, inference_speed
from rcpu_bench.evaluation.speed_llama_cpp import GGUF_DTYPE
from rcpu_bench.experiment import MODEL, add_flags
from rcpu_bench.export.gguf import DTYPES, check_dtype
from rcpu_bench.model.loading import LoadedModel, parameter_count
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import default_model
from rcpu_bench.plugins import default_registry

ENGINES = ("transformers", "llama.cpp")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", action="append", metavar="DIR_OR_ID",
                   help="saved pruned directory, model directory or hub id (repeatable; default: the "
                   "stories260K-mha fixture in the shared directory)")
    p.add_argument("--engine", action="append", choices=ENGINES,
                   help="inference engine (repeatable; default transformers): llama.cpp times the model exported "
                   "to a temporary GGUF file, on the CPU, at batch 1")
    p.add_argument("--gguf-outtype", default=GGUF_DTYPE, choices=DTYPES, help="type of the GGUF matrices llama.cpp "
                   "runs")
    p.add_argument("--threads", type=positive_int, help="llama.cpp threads (default: torch's intra-op threads, the "
                   "number transformers runs on)")
    add_flags(p, ["eval_batch_size"])
    p.add_argument("--prompt-tokens", type=positive_int, default=PROMPT_TOKENS)
    p.add_argument("--new-tokens", type=positive_int, default=NEW_TOKENS)
    p.add_argument("--repeats", type=positive_int, default=REPEATS)
    add_flags(p, MODEL)
    console.add_quiet_option(p)


def check_engines(args: argparse.Namespace) -> None:
    """Refuse what the llama.cpp timings cannot do, before anything is loaded."""
    if "llama.cpp" not in args.engine:
        return
    from rcpu_bench.evaluation.speed_llama_cpp import require_llama_cpp

    require_llama_cpp()
    check_dtype(args.gguf_outtype)
    if args.eval_batch_size != 1:
        raise ValueError(f"--eval-batch-size {args.eval_batch_size}: llama.cpp is timed at batch 1 only "
                         "(pass --eval-batch-size 1)")
    if args.device != "cpu":
        raise ValueError(f"--device {args.device}: llama.cpp is timed on the CPU only")


def llama_cpp_speed_of(loaded: LoadedModel, args: argparse.Namespace) -> dict[str, Any]:
    """Export a loaded model to a temporary GGUF file and time it in llama.cpp."""
    from rcpu_bench.evaluation.speed_llama_cpp import model_speed

    return model_speed(loaded.model, loaded.tokenizer, dtype=args.gguf_outtype, prompt_tokens=args.prompt_tokens,
                       new_tokens=args.new_tokens, repeats=args.repeats,
                       threads=args.threads or torch.get_num_threads())


@command()
def run(args: argparse.Namespace) -> int:
    """Check the models and engines, then one line per model and engine: parameters, prefill and decode tokens/s."""
    names = args.model or [default_model()]
    args.engine = list(dict.fromkeys(args.engine or ["transformers"]))
    if args.eval_batch_size < 1:
        raise ValueError(f"--eval-batch-size {args.eval_batch_size} is not allowed; allowed: an integer >= 1")
    check_counts(batch_size=args.eval_batch_size, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                 repeats=args.repeats)
    check_models(names, args)
    check_engines(args)
    rows = []
    for name in names:
        loaded = load_saved_or_model(name, revision=args.revision, dtype=args.dtype, device=args.device,
                                     registry=default_registry(), trust_remote_code=args.trust_remote_code)
        for engine in args.engine:
            speed = (llama_cpp_speed_of(loaded, args) if engine == "llama.cpp" else
                     inference_speed(loaded.model, batch_size=args.eval_batch_size, prompt_tokens=args.prompt_tokens,
                                     new_tokens=args.new_tokens, repeats=args.repeats))
            rows.append((name, engine, f"{parameter_count(loaded.model):,}", f"{speed['prefill_tokens_per_s']:,.0f}",
                         f"{speed['decode_tokens_per_s']:,.0f}"))
    print(tabulate(rows, headers=["model", "engine", "parameters", "prefill tokens/s", "decode tokens/s"]))
    llama_cpp = (f", llama.cpp {args.threads or torch.get_num_threads()} threads, GGUF {args.gguf_outtype}"
                 if "llama.cpp" in args.engine else "")
    print(f"batch {args.eval_batch_size}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of "
          f"{args.repeats} after a warm-up, on {args.device}, {torch.get_num_threads()} torch threads{llama_cpp}")
    return 0
