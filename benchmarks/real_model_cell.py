"""Each phase of a real-model matrix cell beside its floor, measured in one process and one run.

Floors (what a cell cannot beat on this machine):

- a bare transformers float32 forward of the cell's calibration windows and of its evaluation windows (``model(ids,
  use_cache=False)`` under ``no_grad``, the fastest of batch sizes 8, 16 and 32), the tokens every cell must push
  through the model at least once;
- llama.cpp's float32 prefill of the same evaluation windows, the dense model exported to a float32 GGUF (the engine
  a CPU user would reach for instead), at batch 1 per window as llama.cpp evaluates a prompt;
- the bare float64 decompositions each compensator's solve needs at the model's shapes, per pruned module: ridge a
  Cholesky of G_KK (k × k) and two triangular solves with d_out right-hand sides; procrustes and scaled-procrustes
  the decomposition of M (d_out × d_out) that their ``auto`` solver runs at that size (an SVD on the CPU below
  ``rotation.CPU_SVD_BELOW``, else an eigendecomposition of MᵀM), and the QR factor of W_K when k < d_out (the
  rotation then acts on W_K's column span); none and flap-bias none.

The harness's phases, per compensator (each a full ``run_experiment`` on a copy of the loaded model, as a matrix
runs a cell): model copy, layer-0 capture and per layer forward, statistics, score, solve (the record's timings),
the calibration perplexity, the evaluation perplexity and writing the record; the peak RSS after each cell (it must
not grow with the number of cells in one process). Then the ratios the targets name: evaluation throughput against
the bare forward, pruning against the bare calibration forward, each layer's solve against its decompositions, the
cell against the sum of its floors.

    python benchmarks/real_model_cell.py --model smollm2-135m --out results/benchmarks/real_model_cell_smollm2

writes ``OUT.json`` (command, machine, threads, libraries, commit, every figure) and ``OUT.md`` (the table). Run
it on an idle machine: other jobs slow linear algebra several-fold.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path
from statistics import fmean
from typing import Any

import torch
from tabulate import tabulate

from rcpu_bench import data, peak_memory
from rcpu_bench.compensation.rotation import auto_solver
from rcpu_bench.evaluation import perplexity
from rcpu_bench.experiment import Experiment, run_experiment
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import LoadedModel, load_model
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.records import append_record, cpu_model, harness_commit

COMPENSATORS = ("none", "flap-bias", "ridge", "procrustes", "scaled-procrustes")
BATCHES = (8, 16, 32)
LIBRARIES = ("rcpu-bench", "torch", "transformers", "llama-cpp-python")


def best_of(repeats: int, run: Callable[[], Any]) -> float:
    """The fastest of ``repeats`` wall-clock runs of ``run()``, in seconds."""
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def bare_forward(model: torch.nn.Module, windows: torch.Tensor,
                 batches: tuple[int, ...] = BATCHES) -> dict[str, float]:
    """Seconds of a plain forward of every window at each batch size in ``batches``, and the best."""
    def run(batch: int) -> None:
        with torch.no_grad():
            for start in range(0, len(windows), batch):
                model(input_ids=windows[start : start + batch], use_cache=False)
    seconds = {f"batch_{b}": best_of(1, lambda b=b: run(b)) for b in batches}
    return {**seconds, "best": min(seconds.values())}


def llama_cpp_prefill(model: LoadedModel, windows: torch.Tensor) -> float | None:
    """Seconds of llama.cpp's float32 prefill of every window (each from an empty cache); None without llama_cpp."""
    try:
        from rcpu_bench.evaluation.speed_llama_cpp import load_gguf
        from rcpu_bench.export.gguf import export_gguf
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as work:
        path = Path(work) / "dense.gguf"
        export_gguf(model.model, model.tokenizer, path, dtype="float32")
        llm = load_gguf(path, n_ctx=windows.shape[1], threads=torch.get_num_threads())
        try:
            def run() -> None:
                for window in windows.tolist():
                    llm.reset()
                    llm.eval(window)
            return best_of(1, run)
        finally:
            llm.close()


def decomposition_floor(compensator: str, d_out: int, kept: int, repeats: int = 3) -> float:
    """Seconds of the bare float64 decompositions ``compensator`` needs for one module (module docstring)."""
    if compensator in ("none", "flap-bias"):
        return 0.0
    generator = torch.Generator().manual_seed(0)
    if compensator == "ridge":
        x = torch.randn(2 * kept, kept, dtype=torch.float64, generator=generator)
        gram = x.T @ x + torch.eye(kept, dtype=torch.float64)
        rhs = torch.randn(d_out, kept, dtype=torch.float64, generator=generator)

        def solve() -> None:
            factor = torch.linalg.cholesky(gram)
            half = torch.linalg.solve_triangular(factor.T, rhs, upper=True, left=False)
            torch.linalg.solve_triangular(factor, half, upper=False, left=False)
        return best_of(repeats, solve)
    m = torch.randn(d_out, d_out, dtype=torch.float64, generator=generator)
    wk = torch.randn(d_out, kept, dtype=torch.float64, generator=generator)

    def decompose() -> None:
        if auto_solver(m) == "svd":
            torch.linalg.svd(m)
        else:
            torch.linalg.eigh(m.T @ m)
        if kept < d_out:
            torch.linalg.qr(wk, mode="r")
    return best_of(repeats, decompose)


def peak_rss_mib() -> float:
    """The process's resident high-water mark since it started, in MiB (never reset: its growth across cells shows
    what a cell leaves behind)."""
    return peak_memory.peak_bytes(torch.device("cpu")) / 2**20


class PhaseTimer:
    """Wall-clock seconds of perplexity passes by their progress label (calibration or a profile), and of record
    writing, gathered by wrapping the functions a run calls."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self._nlls = perplexity.sequence_nlls

    def __enter__(self) -> PhaseTimer:
        def timed(model: Any, sequences: Any, *, batch_size: int = 8, desc: str = "perplexity") -> Any:
            started = time.perf_counter()
            try:
                return self._nlls(model, sequences, batch_size=batch_size, desc=desc)
            finally:
                self.seconds[desc] = self.seconds.get(desc, 0.0) + time.perf_counter() - started
        perplexity.sequence_nlls = timed
        return self

    def __exit__(self, *exc: Any) -> None:
        perplexity.sequence_nlls = self._nlls


def run_cell(loaded: LoadedModel, args: argparse.Namespace, compensator: str, out: Path) -> dict[str, Any]:
    """One cell as a matrix runs it, on a copy of ``loaded``; its phases in seconds and the peak RSS after it."""
    experiment = Experiment(model=args.model, prune=PruneConfig(ratio=args.ratio, compensator=compensator,
                                                                prune=tuple(args.prune), **_lam(compensator)),
                            calib=args.calib, ppl_profiles=(args.profile,), eval_batch_size=args.eval_batch_size,
                            skip=tuple(args.skip))
    copied: dict[str, float] = {}

    def load(*_: Any, **__: Any) -> LoadedModel:
        started = time.perf_counter()
        model = LoadedModel(copy.deepcopy(loaded.model), loaded.tokenizer, dict(loaded.provenance))
        copied["seconds"] = time.perf_counter() - started
        return model

    started = time.perf_counter()
    with PhaseTimer() as timer:
        record = run_experiment(experiment, progress=False, load=load)
    written = time.perf_counter()
    append_record(out / "records.jsonl", record)
    writing = time.perf_counter() - written
    total = time.perf_counter() - started
    layers = record.timing["layers"]
    phases = record.timing["prune_seconds"]  # seconds of each pruning phase, summed over the layers
    return {"compensator": compensator, "total": total, "copy": copied["seconds"], "prune": sum(phases.values()),
            **{name: phases.get(name, 0.0) for name in ("capture", "forward", "statistics", "score", "solve")},
            "solve_per_layer": [layer.get("solve", 0.0) for layer in layers],
            "calibration_ppl": timer.seconds.get("ppl calibration", 0.0),
            "evaluation_ppl": timer.seconds.get(f"ppl {args.profile}", 0.0), "record": writing,
            "ppl": record.perplexity[0].ppl, "peak_rss_mib": peak_rss_mib()}


def _lam(compensator: str) -> dict[str, Any]:
    return {"compensator_params": {"lam_rel": 0.01}} if compensator == "ridge" else {}


def ratios(cell: dict[str, Any], floors: dict[str, Any], solve_floor: float, n_layers: int) -> dict[str, float | None]:
    """The targets' ratios of one cell (module docstring)."""
    cell_floor = floors["calibration_forward"] + floors["evaluation_forward"] + solve_floor * n_layers
    if cell["calibration_ppl"]:
        cell_floor += floors["calibration_forward"]
    worst_solve = max(cell["solve_per_layer"]) / solve_floor if solve_floor else None
    return {"evaluation_vs_bare": floors["evaluation_forward"] / cell["evaluation_ppl"],
            "prune_vs_bare_calibration": cell["prune"] / floors["calibration_forward"],
            "worst_layer_solve_vs_decompositions": worst_solve,
            "cell_vs_floors": cell["total"] / cell_floor, "cell_floor": cell_floor}


def markdown(result: dict[str, Any]) -> str:
    floors = result["floors"]
    lines = [f"# Real-model cell, phase by phase: {result['settings']['model']}", "",
             f"Command: `{result['command']}`  ",
             f"Machine: {result['machine']['cpu']}, {result['machine']['threads']} threads; commit "
             f"{result['machine']['commit']}", "",
             "Floors (seconds): calibration forward {calibration_forward:.2f}, evaluation forward "
             "{evaluation_forward:.2f} ({evaluation_tokens:,} tokens, batch {evaluation_batch}), llama.cpp float32 "
             "prefill of the evaluation windows {llama_cpp}".format(
                 **{**floors, "llama_cpp": "n/a" if floors["llama_cpp_prefill"] is None
                    else f"{floors['llama_cpp_prefill']:.2f}"}), ""]
    rows = [(c["compensator"], c["total"], c["copy"], c["forward"], c["statistics"], c["score"], c["solve"],
             c["calibration_ppl"], c["evaluation_ppl"], c["record"], c["peak_rss_mib"],
             c["ratios"]["evaluation_vs_bare"], c["ratios"]["prune_vs_bare_calibration"],
             c["ratios"]["worst_layer_solve_vs_decompositions"], c["ratios"]["cell_vs_floors"])
            for c in result["cells"]]
    headers = ["compensator", "cell s", "copy", "forward", "statistics", "score", "solve", "calib ppl", "eval ppl",
               "record", "peak RSS MiB", "eval / bare (≥ 0.9)", "prune / bare calib (≤ 3)",
               "worst solve / decomp. (≤ 2)", "cell / floors (≤ 2)"]
    lines.append(tabulate(rows, headers=headers, tablefmt="github", floatfmt=".2f", missingval="n/a"))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--ratio", type=float, default=0.2)
    parser.add_argument("--prune", nargs="+", default=["mlp"])
    parser.add_argument("--calib", default="tinystories:128x128")
    parser.add_argument("--profile", default="rcpu128[0:128]")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("--skip", nargs="*", default=["speed", "sample"])
    parser.add_argument("--compensators", nargs="+", default=list(COMPENSATORS))
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", type=Path, required=True, help="OUT: writes OUT.json and OUT.md")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    loaded = load_model(args.model)
    load_seconds = time.perf_counter() - started
    calib = data.calibration_data(args.calib, loaded.tokenizer).tokens
    windows = torch.stack(perplexity.profile_sequences(args.profile, loaded.tokenizer,
                                                       perplexity.get_profile(args.profile).seqlen))
    evaluation = bare_forward(loaded.model, windows)
    floors = {"load": load_seconds, "calibration_forward": bare_forward(loaded.model, calib)["best"],
              "evaluation_forward": evaluation["best"], "evaluation_tokens": windows.numel(),
              "evaluation_batch": min((s, b) for b, s in zip(BATCHES, evaluation.values(), strict=False))[1],
              "evaluation_by_batch": evaluation, "llama_cpp_prefill": llama_cpp_prefill(loaded, windows)}
    geometry = layer_geometries(loaded.model)[0]
    d_out = loaded.model.config.hidden_size
    kept = geometry.intermediate - math.floor(args.ratio * geometry.intermediate)
    cells = []
    with tempfile.TemporaryDirectory() as work:
        for compensator in args.compensators:
            solve_floor = decomposition_floor(compensator, d_out, kept)
            cell = run_cell(loaded, args, compensator, Path(work))
            cell["decompositions_per_layer"] = solve_floor
            cell["ratios"] = ratios(cell, floors, solve_floor, len(cell["solve_per_layer"]))
            cells.append(cell)
            print(f"{compensator}: {cell['total']:.1f} s, ratios {cell['ratios']}", file=sys.stderr)
    result = {"command": " ".join(["python", "benchmarks/real_model_cell.py", *(argv or sys.argv[1:])]),
              "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), **harness_commit(),
                          "libraries": {name: _version(name) for name in LIBRARIES}},
              "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"out": str(args.out)},
              "floors": floors, "cells": cells,
              "rss_growth_mib": cells[-1]["peak_rss_mib"] - cells[0]["peak_rss_mib"] if cells else None,
              "mean_cell_seconds": fmean(c["total"] for c in cells) if cells else None}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(result))
    print(markdown(result))
    return 0


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"


if __name__ == "__main__":
    sys.exit(main())
