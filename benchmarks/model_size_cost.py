"""How the cost of one cell grows with the model: the same cell on SmolLM2-135M, Gemma-3-270M and Qwen2.5-Coder-1.5B.

The cell: 20 % of the MLP channels of every layer removed and compensated by the rotation, 128 × 128 WikiText-2
validation calibration windows, the first 128 WikiText-2 test windows as the evaluation profile; each model's cell
is ``rcpu-bench prune`` in a process of its own, so that its peak resident memory (``os.wait4``'s ru_maxrss) is that
of one prune: the model and what pruning and evaluation add. A second process runs the same cell as a one-cell
matrix with zero-shot accuracy (the seven tasks, ``--zeroshot-limit`` documents each): a matrix keeps the dense
model beside the copy it prunes.

Floors, measured in this process before the cells (the model loaded once, then freed): a bare transformers float32
forward of the calibration windows and of the evaluation windows (``model(ids, use_cache=False)`` under
``no_grad``, the fastest of the batch sizes ``--floor-batches``, 8, 16 and 32 unless told,
``real_model_cell.bare_forward``): the tokens a cell must push
through the model at least once. The cell's prune runs the calibration tokens through every layer twice (the dense
pass that streams the statistics, then the pruned layer for the next one), so a cell is at least
2 × calibration + evaluation; the ratio to the plain sum of the floors is reported.

    python benchmarks/model_size_cost.py --out results/benchmarks/model_size_cost
    python benchmarks/model_size_cost.py --floor-batches 16 --zeroshot-models smollm2-135m --out OUT  # shorter

writes OUT.json (command, machine, every figure), OUT.md (the table) and OUT.png / OUT.svg (seconds and peak memory
against parameter count), rewritten after each model. Run it on an idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from real_model_cell import BATCHES, bare_forward
from tabulate import tabulate

from rcpu_bench import data
from rcpu_bench.evaluation import perplexity
from rcpu_bench.model import real_models
from rcpu_bench.model.loading import load_model, parameter_count
from rcpu_bench.records import cpu_model, harness_commit

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-1.5b")
CALIB = "wikitext2-valid:128x128"
PROFILE = "rcpu128[0:128]"
MIB = 2**20


def floors(name: str, batches: tuple[int, ...]) -> dict[str, Any]:
    """The model's parameters and float32 size, and the bare forwards of the cell's calibration and evaluation
    windows (the best of the batch sizes ``batches`` for each)."""
    loaded = load_model(name)
    calib = data.calibration_data(CALIB, loaded.tokenizer).tokens
    windows = torch.stack(perplexity.profile_sequences(PROFILE, loaded.tokenizer, 128))
    parameters = parameter_count(loaded.model)
    result = {"parameters": parameters, "weights_mib": 4 * parameters / MIB,
              "vocabulary": loaded.model.config.vocab_size,
              "calibration_forward": bare_forward(loaded.model, calib, batches), "calibration_tokens": calib.numel(),
              "evaluation_forward": bare_forward(loaded.model, windows, batches), "evaluation_tokens": windows.numel()}
    del loaded
    gc.collect()
    return result


def measured(command: list[str]) -> tuple[float, float]:
    """(wall seconds, peak resident MiB) of ``command`` run as a child process; it must succeed."""
    started = time.perf_counter()
    child = subprocess.Popen(command)
    _, status, usage = os.wait4(child.pid, 0)
    seconds = time.perf_counter() - started
    if os.waitstatus_to_exitcode(status) != 0:
        raise RuntimeError(f"{' '.join(command)} failed with status {os.waitstatus_to_exitcode(status)}")
    return seconds, usage.ru_maxrss / 1024  # Linux: KiB


def prune_cell(name: str, work: Path) -> dict[str, Any]:
    """``rcpu-bench prune`` of the cell: wall seconds, peak RSS, and the record's phases."""
    out = work / f"{name}.jsonl"
    seconds, peak = measured([sys.executable, "-m", "rcpu_bench.cli", "prune", "--model", name, "--scorer",
                              "variance", "--compensator", "procrustes", "--ratio", "0.2", "--prune", "mlp",
                              "--calib", CALIB, "--ppl", PROFILE, "--eval-batch-size", "16", "--out", str(out),
                              "--quiet"])
    record = json.loads(out.read_text().splitlines()[-1])
    phases = record["timing"]["prune_seconds"]
    return {"seconds": seconds, "peak_rss_mib": peak, "run_seconds": record["timing"]["total_seconds"],
            "prune_seconds": sum(phases.values()), "phases": phases, "ppl": record["perplexity"][0]["ppl"],
            "pruning_peak_mib": record["peak_memory_bytes"] / MIB}


def zeroshot_cell(name: str, work: Path, limit: int) -> dict[str, Any]:
    """The same cell with zero-shot accuracy, as a one-cell matrix: wall seconds and peak RSS."""
    matrix = work / f"{name}-zeroshot.yaml"
    matrix.write_text(json.dumps({
        "name": f"cost-{name}", "models": [name], "methods": ["rcpu-rot"], "ratios": [0.2],
        "calib": {"source": "wikitext2-valid", "n_calib": [128], "seqlen": 128}, "eval": ["ppl", "zeroshot"],
        "ppl_profiles": [PROFILE], "zeroshot_limit": limit, "prune": {"prune": ["mlp"]},
        "skip": ["calibration-ppl", "speed", "sample"], "eval_batch_size": 16}))
    seconds, peak = measured([sys.executable, "-m", "rcpu_bench.cli", "run", "--matrix", str(matrix), "--results",
                              str(work / f"{name}-zeroshot"), "--quiet"])
    return {"seconds": seconds, "peak_rss_mib": peak, "limit": limit}


def figures(result: dict[str, Any], out: Path) -> None:
    """Seconds (cell, floors) and peak memory (one prune, zero-shot cell, float32 weights) against parameters."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["models"]
    params = [row["parameters"] / 1e6 for row in rows]
    fig, (time_ax, memory_ax) = plt.subplots(1, 2, figsize=(9, 3.6))
    for label, key in (("cell (prune + evaluation)", "cell_seconds"), ("forward floors", "floor_seconds")):
        time_ax.plot(params, [row[key] for row in rows], marker="o", label=label)
    for label, key in (("one-cell prune", "prune_peak_mib"), ("zero-shot cell (matrix)", "zeroshot_peak_mib"),
                       ("float32 weights", "weights_mib")):
        measured_rows = [row for row in rows if row[key] is not None]
        memory_ax.plot([row["parameters"] / 1e6 for row in measured_rows], [row[key] for row in measured_rows],
                       marker="o", label=label)
    for ax, unit in ((time_ax, "seconds"), (memory_ax, "peak resident memory, MiB")):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("parameters (millions)")
        ax.set_ylabel(unit)
        ax.legend(fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
    fig.suptitle(f"One cell (20 % MLP channels, rotation, {CALIB}, {PROFILE}) by model size", fontsize=9)
    fig.tight_layout()
    for suffix in (".png", ".svg"):
        fig.savefig(out.with_suffix(suffix), dpi=150, metadata={"Date": None} if suffix == ".svg" else None)
    plt.close(fig)


def earlier_rows(rows: list[dict[str, Any]]) -> list[str]:
    """A line for each row measured by an earlier command (:func:`kept_rows`)."""
    return ["", *(f"{row['model']}: measured by `{row['measured_by']['command']}` at commit "
                  f"{row['measured_by']['commit']}" for row in rows if "measured_by" in row)] if any(
        "measured_by" in row for row in rows) else []


def markdown(result: dict[str, Any]) -> str:
    def zeroshot(row: dict[str, Any]) -> tuple[Any, Any]:
        peak = row["zeroshot_peak_mib"]
        return ("not run", "") if peak is None else (f"{peak:,.2f}", f"{peak / row['weights_mib']:,.2f}")

    rows = [(row["model"], f"{row['parameters'] / 1e6:,.0f} M", row["vocabulary"], row["calibration_floor"],
             row["evaluation_floor"], row["prune_seconds"], row["cell_seconds"], row["cell_vs_floors"],
             row["weights_mib"], row["prune_peak_mib"], row["prune_peak_mib"] / row["weights_mib"], *zeroshot(row))
            for row in result["models"]]
    headers = ["model", "parameters", "vocabulary", "calib. forward s", "eval. forward s", "prune s", "cell s",
               "cell / floors", "float32 MiB", "prune peak MiB", "÷ weights", "zero-shot cell peak MiB", "÷ weights"]
    return "\n".join([
        "# One cell by model size", "", f"Command: `{result['command']}`  ",
        f"Machine: {result['machine']['cpu']}, {result['machine']['threads']} threads; commit "
        f"{result['machine']['commit']}; floors: the best of batch sizes {result['settings']['floor_batches']}", "",
        tabulate(rows, headers=headers, tablefmt="github", floatfmt=",.2f"),
        *earlier_rows(result["models"])]) + "\n"


def kept_rows(out: Path, settings: dict[str, Any], measuring: list[str]) -> list[dict[str, Any]]:
    """The rows of OUT.json measured with the same settings for models not measured now (so that one model can be
    measured again alone), each with the command and commit that measured it."""
    path = out.with_suffix(".json")
    if not path.exists():
        return []
    earlier = json.loads(path.read_text())
    if earlier["settings"] != settings:
        return []
    return [{"measured_by": {"command": earlier["command"], "commit": earlier["machine"]["commit"]}, **row}
            if "measured_by" not in row else row for row in earlier["models"] if row["model"] not in measuring]


def write(result: dict[str, Any], out: Path) -> None:
    """OUT.json, OUT.md and the figures of the models measured so far (rewritten after each model)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(result))
    figures(result, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(real_models.MODELS))
    parser.add_argument("--zeroshot-limit", type=int, default=20)
    parser.add_argument("--zeroshot-models", nargs="*", choices=list(real_models.MODELS),
                        help="the models that also run the zero-shot cell (default: every model)")
    parser.add_argument("--floor-batches", nargs="+", type=int, default=list(BATCHES),
                        help="the batch sizes of the bare forwards, the best of which is the floor")
    parser.add_argument("--out", type=Path, required=True, help="OUT: writes OUT.json, OUT.md, OUT.png, OUT.svg")
    args = parser.parse_args(argv)
    zeroshot_models = args.models if args.zeroshot_models is None else args.zeroshot_models
    settings = {"calib": CALIB, "profile": PROFILE, "zeroshot_limit": args.zeroshot_limit,
                "floor_batches": args.floor_batches}
    result: dict[str, Any] = {
        "command": " ".join(["python", "benchmarks/model_size_cost.py", *(argv or sys.argv[1:])]),
        "machine": {"cpu": cpu_model(), "threads": torch.get_num_threads(), **harness_commit()},
        "settings": settings, "models": kept_rows(args.out, settings, args.models)}
    with tempfile.TemporaryDirectory() as work:
        for name in args.models:
            row: dict[str, Any] = {"model": name, **floors(name, tuple(args.floor_batches))}
            row["calibration_floor"] = row["calibration_forward"]["best"]
            row["evaluation_floor"] = row["evaluation_forward"]["best"]
            row["floor_seconds"] = row["calibration_floor"] + row["evaluation_floor"]
            row["cell"] = prune_cell(name, Path(work))
            row["zeroshot"] = zeroshot_cell(name, Path(work), args.zeroshot_limit) if name in zeroshot_models else None
            row |= {"cell_seconds": row["cell"]["run_seconds"], "prune_seconds": row["cell"]["prune_seconds"],
                    "cell_vs_floors": row["cell"]["run_seconds"] / row["floor_seconds"],
                    "prune_peak_mib": row["cell"]["peak_rss_mib"],
                    "zeroshot_peak_mib": row["zeroshot"]["peak_rss_mib"] if row["zeroshot"] else None}
            result["models"] = sorted([*result["models"], row], key=lambda r: r["parameters"])
            write(result, args.out)
            print(f"{name}: cell {row['cell_seconds']:.0f} s ({row['cell_vs_floors']:.2f}x floors), prune peak "
                  f"{row['prune_peak_mib']:,.0f} MiB, zero-shot cell peak {row['zeroshot_peak_mib']} MiB",
                  file=sys.stderr)
    print(markdown(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
