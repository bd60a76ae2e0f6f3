"""Inference speed of a model: tokens per second of the prefill and of decoding with the KV cache.

Measured on random token ids (speed does not depend on them), so no data or tokenizer is needed and
the caller's random state is untouched. Reported beside the model's size in every experiment record
(``record["inference"]``): the dense cell of a matrix gives the dense figure, so a pruned model's
speed-up is the ratio of two records measured the same way.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import torch

from rcpu_bench import console
from rcpu_bench.model.loading import add_model_options

BATCH_SIZE = 1
PROMPT_TOKENS = 128
NEW_TOKENS = 32
REPEATS = 3


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(device: torch.device, step: Any) -> tuple[Any, float]:
    """``step()``'s result and its wall-clock seconds, the device synchronized before and after."""
    _synchronize(device)
    started = time.perf_counter()
    result = step()
    _synchronize(device)
    return result, time.perf_counter() - started


def prefill_and_decode(model: Any, ids: torch.Tensor, new_tokens: int) -> tuple[float, float]:
    """Seconds of one prefill (a forward pass over ``ids`` filling the KV cache) and of ``new_tokens``
    decode steps (each a forward pass of the previous step's greedy token per sequence, on the cache)."""
    device = ids.device

    def decode(output: Any) -> None:
        cache = output.past_key_values
        for _ in range(new_tokens):
            token = output.logits[:, -1:].argmax(dim=-1)
            output = model(token, past_key_values=cache, use_cache=True)
            cache = output.past_key_values

    with torch.no_grad():
        output, prefill = _timed(device, lambda: model(ids, use_cache=True))
        _, decoding = _timed(device, lambda: decode(output))
    return prefill, decoding


def check_counts(**counts: int) -> None:
    """ValueError naming the first of ``counts`` (batch_size, prompt_tokens, ...) that is not a positive integer."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def rates(runs: list[tuple[float, float]], *, batch_size: int, prompt_tokens: int,
          new_tokens: int) -> tuple[float, float]:
    """(prefill, decode) tokens/s from (prefill seconds, decode seconds) runs: batch_size · prompt_tokens /
    median t_prefill and batch_size · new_tokens / median t_decode."""
    prefill = statistics.median(run[0] for run in runs)
    decode = statistics.median(run[1] for run in runs)
    return batch_size * prompt_tokens / prefill, batch_size * new_tokens / decode


def inference_speed(model: Any, *, batch_size: int = BATCH_SIZE, prompt_tokens: int = PROMPT_TOKENS,
                    new_tokens: int = NEW_TOKENS, repeats: int = REPEATS, seed: int = 0) -> dict[str, Any]:
    """Prefill and decode throughput of ``model`` on its device, after an untimed warm-up (a prefill and one step).

    prefill_tokens_per_s = batch_size · prompt_tokens / t_prefill, decode_tokens_per_s = batch_size ·
    new_tokens / t_decode, each t the median over ``repeats`` runs of a (batch_size × prompt_tokens)
    prompt of random ids followed by ``new_tokens`` greedy decode steps with the KV cache
    (``prefill_and_decode``). Returns exactly batch_size, prompt_tokens, new_tokens,
    prefill_tokens_per_s, decode_tokens_per_s, device and repeats.
    """
    check_counts(batch_size=batch_size, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats)
    limit = model.config.max_position_embeddings
    if prompt_tokens + new_tokens > limit:
        raise ValueError(f"prompt_tokens + new_tokens = {prompt_tokens + new_tokens} exceeds the model's "
                         f"max_position_embeddings {limit}")
    device = next(model.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(model.config.vocab_size, (batch_size, prompt_tokens), generator=generator).to(device)
    prefill_and_decode(model, ids, 1)  # warm-up of both kinds of step (kernels, allocator, lazy initialisation)
    runs = [prefill_and_decode(model, ids, new_tokens) for _ in range(repeats)]
    prefill, decode = rates(runs, batch_size=batch_size, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    return {"batch_size": batch_size, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens,
            "prefill_tokens_per_s": prefill, "decode_tokens_per_s": decode, "device": str(device), "repeats": repeats}


# ----------------------------------------------------------------------------------------------- CLI


ENGINES = ("transformers", "llama.cpp")


def add_parser(commands: Any) -> argparse.ArgumentParser:
    """Add the ``speed`` subcommand to an ``add_subparsers()`` object and return its parser."""
    p = commands.add_parser("speed", help="parameters and inference speed (prefill and decode tokens/s) of models",
                            formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", metavar="DIR_OR_ID",
                   help="saved pruned directory, model directory or hub id (repeatable; default: the "
                   "stories260K-mha fixture in the shared directory)")
    p.add_argument("--engine", action="append", choices=ENGINES,
                   help="inference engine (repeatable; default transformers): llama.cpp times the model exported "
                   "to a temporary GGUF file (rcpu_bench.export.gguf), on the CPU, batch 1")
    p.add_argument("--gguf-outtype", default="float16", help="type of the GGUF matrices timed by llama.cpp")
    p.add_argument("--threads", type=int, help="llama.cpp threads (default: torch's intra-op threads, "
                   "the number transformers runs on)")
    p.add_argument("--eval-batch-size", type=int, default=BATCH_SIZE, help="sequences per timed forward pass")
    p.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS)
    p.add_argument("--new-tokens", type=int, default=NEW_TOKENS)
    p.add_argument("--repeats", type=int, default=REPEATS)
    add_model_options(p)
    console.add_quiet_option(p)
    p.set_defaults(func=cmd_speed)
    return p


def _check_engines(args: argparse.Namespace) -> None:
    """Refuse what llama.cpp timings cannot do, before anything is loaded."""
    if "llama.cpp" not in args.engine:
        return
    from rcpu_bench.evaluation.speed_llama_cpp import require_llama_cpp
    from rcpu_bench.export.gguf import check_dtype

    require_llama_cpp()
    check_dtype(args.gguf_outtype)
    if args.eval_batch_size != 1:
        raise ValueError(f"--eval-batch-size {args.eval_batch_size}: llama.cpp is timed at batch 1 only")
    if args.device != "cpu":
        raise ValueError(f"--device {args.device}: llama.cpp is timed on the CPU only")
    if args.threads is not None and args.threads < 1:
        raise ValueError(f"--threads must be a positive integer, got {args.threads}")


def llama_cpp_speed_of(loaded: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Export a loaded model to a temporary GGUF file and time it in llama.cpp."""
    import tempfile
    from pathlib import Path

    from rcpu_bench.evaluation.speed_llama_cpp import llama_cpp_speed
    from rcpu_bench.export.gguf import export_gguf

    with tempfile.TemporaryDirectory(prefix="rcpu-speed-") as scratch:
        path = Path(scratch) / "model.gguf"
        export_gguf(loaded.model, loaded.tokenizer, path, dtype=args.gguf_outtype)
        return llama_cpp_speed(path, prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                               repeats=args.repeats, threads=args.threads or torch.get_num_threads())


def cmd_speed(args: argparse.Namespace) -> int:
    """``rcpu-bench speed``: check the models, then one line per model and engine: parameters, prefill and decode
    tokens/s."""
    from tabulate import tabulate

    from rcpu_bench.evaluation.eval_command import check_models, load_saved_or_model
    from rcpu_bench.matrix.experiment import (
        default_model,  # experiment imports this module for record["inference"]
    )
    from rcpu_bench.model.loading import parameter_count

    names = args.model or [default_model()]
    args.engine = list(dict.fromkeys(args.engine or ["transformers"]))
    rows = []
    try:
        check_models(names, args)
        _check_engines(args)
        for name in names:
            loaded = load_saved_or_model(name, revision=args.revision, dtype=args.dtype, device=args.device)
            for engine in args.engine:
                speed = (llama_cpp_speed_of(loaded, args) if engine == "llama.cpp" else
                         inference_speed(loaded.model, batch_size=args.eval_batch_size,
                                         prompt_tokens=args.prompt_tokens, new_tokens=args.new_tokens,
                                         repeats=args.repeats))
                rows.append((name, engine, f"{parameter_count(loaded.model):,}",
                             f"{speed['prefill_tokens_per_s']:,.0f}", f"{speed['decode_tokens_per_s']:,.0f}"))
    except (ValueError, OSError, ImportError) as error:
        print(f"rcpu-bench: error: {error}", file=sys.stderr)
        return 2
    print(tabulate(rows, headers=["model", "engine", "parameters", "prefill tokens/s", "decode tokens/s"]))
    threads = args.threads or torch.get_num_threads()
    print(f"batch {args.eval_batch_size}, prompt {args.prompt_tokens} tokens, {args.new_tokens} new tokens, median of "
          f"{args.repeats} after a warm-up, on {args.device}, {torch.get_num_threads()} torch threads"
          + (f", llama.cpp {threads} threads, GGUF {args.gguf_outtype}" if "llama.cpp" in args.engine else ""))
    return 0
