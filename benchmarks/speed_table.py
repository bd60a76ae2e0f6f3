"""The measured speed table: dense vs pruned models in transformers and in llama.cpp, on the CPU.

For stories260K-mha (the shared fixture) and a random-init Llama-3.2-1B-shaped model
(``make_random_llama.py --shape llama3.2-1b --dtype float32``), four variants each: dense, uniform 20 %,
uniform 20 % with ``--round-to`` (8 for stories260K-mha, 64 for the 1B shape) and AL-AM 20 %, each pruned by
``rcpu-bench prune ... --save`` (variance × procrustes, calibration ``tinystories:32x128``, perplexity on
``tinystories[0:20]``; the dense one at ``--ratio 0``). Of each saved model: parameters, perplexity (the record's),
transformers prefill / decode tokens/s (float32; :func:`rcpu_bench.evaluation.speed.inference_speed`, as
``rcpu-bench speed``), then for each GGUF type (float16, float32) the model exported by
:func:`rcpu_bench.export.gguf.export_gguf`, its llama.cpp tokens/s
(:func:`rcpu_bench.evaluation.speed_llama_cpp.llama_cpp_speed`, as ``rcpu-bench speed --engine llama.cpp``) and
max |logit_llama.cpp − logit_transformers| over one prompt (float32 KV cache) as a sanity column. All at batch 1,
on ``--threads`` threads for both engines; speed-up = tokens/s ÷ the dense variant's, per engine and GGUF type.

Writes ``OUT.json`` (command, machine: CPU model, threads, library versions, git commit; settings; one row per
model and variant) and ``OUT.md`` (one table per model). Run it once on an idle machine:

    python benchmarks/speed_table.py --threads 8                     # results/benchmarks/speed_cpu.{json,md}
    python benchmarks/speed_table.py --quick --out /tmp/speed_quick  # minutes: tiny shapes, few repeats

Memory (full size, estimated): the 1B shape is 1.24 B parameters, 4.9 GB in float32. Each prune runs in its
own ``rcpu-bench prune`` process: the model (4.9 GB), its calibration statistics (float64 Grams of at most
8192², 0.5 GB each) and the perplexity batch's logits (8 × 512 × 128,256 floats, 2.1 GB, and as much for
their log-softmax): about 10 GB. The measuring process then holds one saved model at a time (≤ 4.9 GB) and
either the float16 arrays being written (2.5 GB) or the float32 GGUF file mapped by llama.cpp (4.9 GB): about
10 GB. So ~16 GB of memory is enough; disk under ``--work``: 4.9 GB (the random model) + 4 × ≤ 4.9 GB (the
saved variants) + one GGUF file at a time (≤ 4.9 GB).
"""

from __future__ import annotations

import argparse
import gc
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rcpu_bench.evaluation.speed import inference_speed
from rcpu_bench.evaluation.speed_llama_cpp import llama_cpp_speed, load_gguf, require_llama_cpp
from rcpu_bench.export.gguf import export_gguf
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import shared_dir
from rcpu_bench.plugins import default_registry
from rcpu_bench.records import cpu_model, harness_commit, read_records

ROOT = Path(__file__).resolve().parent.parent
RCPU_BENCH = [sys.executable, "-m", "rcpu_bench.cli"]  # the rcpu-bench command of this interpreter
GGUF_DTYPES = ("float16", "float32")
PROMPT = "Once upon a time, there was a little girl named Lily. She"
LIBRARIES = ("rcpu-bench", "torch", "transformers", "llama-cpp-python", "gguf")


@dataclass(frozen=True)
class Setting:
    """What one run of the table measures: calibration and perplexity data, prompt and repeats of the timings,
    and the random 1B-shaped model's shrink factors (1.0 and None: the real shape)."""

    calib: str
    ppl: str
    prompt_tokens: int
    new_tokens: int
    repeats: int
    scale: float
    layers: int | None


FULL = Setting("tinystories:32x128", "tinystories[0:20]", 128, 32, 5, 1.0, None)
QUICK = Setting("tinystories:8x64", "tinystories[0:4]", 16, 4, 1, 0.125, 2)


@dataclass(frozen=True)
class Variant:
    key: str  # as --variants-1b names it
    name: str
    options: tuple[str, ...]  # rcpu-bench prune options


VARIANT_KEYS = ("dense", "uniform", "round-to", "al-am")


def variants(round_to: int) -> tuple[Variant, ...]:
    """Dense, uniform 20 %, uniform 20 % with kept widths rounded to a multiple of ``round_to``, AL-AM 20 %."""
    return (Variant("dense", "dense", ("--ratio", "0")),
            Variant("uniform", "uniform 20%", ("--ratio", "0.2")),
            Variant("round-to", f"uniform 20% round-to {round_to}", ("--ratio", "0.2", "--round-to", str(round_to))),
            Variant("al-am", "AL-AM 20%", ("--ratio", "0.2", "--structure", "al-am")))


def run(command: list[str]) -> None:
    """Run a command, its output shown; CalledProcessError when it fails."""
    shown = ["rcpu-bench", *command[len(RCPU_BENCH):]] if command[:len(RCPU_BENCH)] == RCPU_BENCH else command
    print("$", " ".join(shown), flush=True)
    subprocess.run(command, check=True)


def random_llama(work: Path, setting: Setting) -> Path:
    """The random-init Llama-3.2-1B-shaped model directory (made once under ``work``)."""
    out = work / "random-llama3.2-1b"
    if not out.exists():
        shrink = [] if setting.layers is None else ["--scale", str(setting.scale), "--layers", str(setting.layers)]
        run([sys.executable, str(ROOT / "benchmarks" / "make_random_llama.py"), "--shape", "llama3.2-1b",
             "--dtype", "float32", "--out", str(out), *shrink])
    return out


def prune(model: Path, variant: Variant, setting: Setting, out: Path) -> dict[str, Any]:
    """``rcpu-bench prune`` the model as ``variant`` says, saved to ``out``; its record (a finished prune in ``--work``
    is reused)."""
    records = out.parent / f"{out.name}.jsonl"
    if records.exists() and (out / "config.json").exists():
        (record,) = read_records(records)
        return record
    records.unlink(missing_ok=True)
    run([*RCPU_BENCH, "prune", "--model", str(model), *variant.options, "--calib", setting.calib,
         "--ppl", setting.ppl, "--save", str(out), "--out", str(records), "--quiet"])
    (record,) = read_records(records)
    return record


def max_logit_difference(model: Any, tokenizer: Any, path: Path) -> float:
    """max |logit_llama.cpp − logit_transformers| over every position of :data:`PROMPT` (float32 KV cache)."""
    ids = tokenizer(PROMPT)["input_ids"]
    with torch.no_grad():
        expected = model(torch.tensor([ids])).logits[0].double().numpy()
    llm = load_gguf(path, n_ctx=len(ids), threads=torch.get_num_threads(), logits_all=True, float32_cache=True)
    llm.eval(ids)
    got = np.array(llm.scores[:len(ids)], dtype=np.float64)
    del llm
    return float(np.abs(got - expected).max())


def speed_fields(speed: dict[str, Any]) -> dict[str, float]:
    return {"prefill_tokens_per_s": speed["prefill_tokens_per_s"], "decode_tokens_per_s": speed["decode_tokens_per_s"]}


def measure(directory: Path, setting: Setting, work: Path) -> dict[str, Any]:
    """Parameters, transformers speed, and per GGUF type llama.cpp speed and the logits check, of a saved model."""
    loaded = load_saved_or_model(str(directory), revision=None, dtype="float32", device="cpu",
                                 registry=default_registry())
    counts = {"prompt_tokens": setting.prompt_tokens, "new_tokens": setting.new_tokens, "repeats": setting.repeats}
    row = {"parameters": parameter_count(loaded.model),
           "transformers": speed_fields(inference_speed(loaded.model, batch_size=1, **counts))}
    for dtype in GGUF_DTYPES:
        path = work / f"{directory.name}.{dtype}.gguf"
        export_gguf(loaded.model, loaded.tokenizer, path, dtype=dtype, overwrite=True)
        try:
            speed = llama_cpp_speed(path, threads=torch.get_num_threads(), **counts)
            row[f"llama.cpp {dtype}"] = {**speed_fields(speed), "logits_max_abs_diff":
                                         max_logit_difference(loaded.model, loaded.tokenizer, path)}
        finally:
            path.unlink()
    del loaded
    gc.collect()
    return row


ENGINES = ("transformers", *(f"llama.cpp {dtype}" for dtype in GGUF_DTYPES))


def add_speedups(rows: list[dict[str, Any]]) -> None:
    """speed-up = tokens/s ÷ the same model's dense tokens/s, per engine, for prefill and decode."""
    dense = {row["model"]: row for row in rows if row["variant"] == "dense"}
    for row in rows:
        for engine in ENGINES:
            base = dense[row["model"]][engine]
            for phase in ("prefill", "decode"):
                key = f"{phase}_tokens_per_s"
                row[engine][f"{phase}_speedup"] = row[engine][key] / base[key]


def machine(threads: int) -> dict[str, Any]:
    versions = {}
    for name in LIBRARIES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return {"cpu": cpu_model(), "threads": threads, "versions": versions, "python": sys.version.split()[0],
            "harness": harness_commit()}


def markdown(result: dict[str, Any]) -> str:
    """One table per model: parameters, perplexity, tokens/s and speed-up per engine, the logits check."""
    setting, host = result["setting"], result["machine"]
    lines = ["# Inference speed, dense vs pruned (batch 1, CPU)\n",
             f"`{result['command']}` on {host['cpu']}, {host['threads']} threads; "
             + ", ".join(f"{name} {version}" for name, version in host["versions"].items())
             + f"; commit {host['harness']['commit']}{' (dirty)' if host['harness']['dirty'] is True else ''}.",
             f"Prompt {setting['prompt_tokens']} tokens, {setting['new_tokens']} new tokens, median of "
             f"{setting['repeats']} after a warm-up; transformers in float32; calibration {setting['calib']}, "
             f"perplexity on {setting['ppl']}. Speed-up: tokens/s ÷ the dense model's in the same engine. "
             "Logits Δ: max |logit_llama.cpp − logit_transformers| over one prompt.\n"]
    headers = ["variant", "params", "ppl"] + [f"{engine} {phase} tok/s (×)" for engine in ENGINES
                                              for phase in ("prefill", "decode")]
    headers += [f"{engine} logits Δ" for engine in ENGINES[1:]]
    for model in dict.fromkeys(row["model"] for row in result["rows"]):
        lines += [f"## {model}\n", "| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
        for row in (r for r in result["rows"] if r["model"] == model):
            cells = [row["variant"], f"{row['parameters']:,}", f"{row['ppl']:.3f}"]
            cells += [f"{row[engine][f'{phase}_tokens_per_s']:,.0f} ({row[engine][f'{phase}_speedup']:.2f}×)"
                      for engine in ENGINES for phase in ("prefill", "decode")]
            cells += [f"{row[engine]['logits_max_abs_diff']:.2e}" for engine in ENGINES[1:]]
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="validate: 2-layer 1B shape at 1/8 width, 8x64 "
                        "calibration, 4 stories of perplexity, 16-token prompts, 1 repeat (timings meaningless)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="threads of both engines (default: torch's)")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "benchmarks" / "speed_cpu",
                        help="writes OUT.json and OUT.md")
    parser.add_argument("--work", type=Path, help="directory for the models (default: a temporary one, deleted); "
                        "finished prunes there are reused")
    parser.add_argument("--variants-1b", default=",".join(VARIANT_KEYS), metavar="KEYS",
                        help=f"the 1B shape's variants, comma-separated among {', '.join(VARIANT_KEYS)} (default: all)")
    parser.add_argument("--prune-only", action="store_true", help="prune the variants into --work and stop (the "
                        "pruning need not run on an idle machine; the timing run reuses them)")
    args = parser.parse_args(argv)
    args.variants_1b = tuple(key.strip() for key in args.variants_1b.split(","))
    unknown = sorted(set(args.variants_1b) - set(VARIANT_KEYS))
    if unknown or not args.variants_1b:
        parser.error(f"--variants-1b {','.join(args.variants_1b)}: unknown {unknown}; "
                     f"allowed: {', '.join(VARIANT_KEYS)}")
    if args.prune_only and args.work is None:
        parser.error("--prune-only needs --work DIR (where the timing run finds the pruned models)")
    if args.threads < 1:
        parser.error(f"--threads {args.threads}: allowed: an integer >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    require_llama_cpp()
    setting = QUICK if args.quick else FULL
    torch.set_num_threads(args.threads)
    stories = shared_dir() / "models" / "stories260K-mha"
    with tempfile.TemporaryDirectory(prefix="rcpu-speed-table-") as scratch:
        work = args.work or Path(scratch)
        work.mkdir(parents=True, exist_ok=True)
        models = (("stories260K-mha", stories, 8, VARIANT_KEYS),
                  ("random Llama-3.2-1B shape" + (" (quick: 1/8 width, 2 layers)" if args.quick else ""),
                   random_llama(work, setting), 64, args.variants_1b))
        rows = []
        for label, model, round_to, keys in models:
            for index, variant in enumerate(variants(round_to)):
                if variant.key not in keys:
                    continue
                saved = work / f"{model.name}-{index}"
                record = prune(model, variant, setting, saved)
                if args.prune_only:
                    continue
                rows.append({"model": label, "variant": variant.name, "ppl": record["perplexity"][0]["ppl"],
                             **measure(saved, setting, work)})
                print(json.dumps(rows[-1]), flush=True)
    if args.prune_only:
        print(f"pruned the variants into {work}")
        return 0
    add_speedups(rows)
    command = ["python", "benchmarks/speed_table.py", *(sys.argv[1:] if argv is None else argv)]
    result = {"command": " ".join(command), "machine": machine(args.threads),
              "setting": {**asdict(setting), "quick": args.quick}, "rows": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    json_file, md_file = (args.out.parent / f"{args.out.name}.{suffix}" for suffix in ("json", "md"))
    json_file.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    md_file.write_text(markdown(result), encoding="utf-8")
    print(f"wrote {json_file} and {md_file}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
