"""One decoder layer, side by side: rcpu-bench's statistics path versus a replay of the official stored-activation path.

Both paths prune the same random-init LLaMA-7B- or 13B-shaped decoder layer (o_proj and down_proj, ratio
0.2, floor rounding) from the same N calibration tokens (random ids through the embedding, 128-token
windows, batches of 8 windows), on the CPU or a CUDA device:

* **ours**: one pass with ``collect_input_stats`` collecting, per module, the cheapest statistics sufficient
  for the compensator by the pipeline's flop model (``rcpu_bench.statistics.flops``: G = Σ x xᵀ and/or
  C = Σ y xᵀ, ‖Y‖², ``--gram-precision``), then for o_proj and down_proj
  ``rcpu_bench.pruning.layer_pass.prune_module``: the registry's ``variance`` scorer
  (``activation='mean-abs'``, the official statistic), floor selection, the registry's compensator,
  surgery. The set collected and the rotation solver run are recorded per module.
* **official** (docs/methods.md §7, the official code replayed independently): forward hooks store X and Y of
  both modules
  in float32 (preallocated: a lower bound of the reference's concatenated copies, on the same device)
  and a running Σ|x|; score γ_j = ‖W_j‖₂·mean|x_j|·Var(x_j) (float32, population variance), head
  scores summed, threshold sorted[⌊ρn⌋] with score ≥ threshold kept; procrustes: M = Y Zᵀ with
  Z = W_K X_K, ``torch.linalg.svd`` in float32, Q W_K; ridge: (Y X_Kᵀ + λW_K)·inv(X_K X_Kᵀ + λI).

Each path then re-runs the pruned layer (the next layer's inputs). Times per layer are split into
statistics (time inside the hooks), score (+ selection), solve (per module) and forward (the dense pass
without the hook time, plus the pruned re-run). Peak memory: on CUDA ``max_memory_allocated`` above
what the layer and its inputs hold; on the CPU the peak RSS (VmHWM) of a fresh subprocess per variant
minus that of a baseline subprocess that only builds the layer and its inputs. The compensated weights
of the two paths are compared (same selection, max relative difference); a disagreement above 1e-3
exits with status 1. A token count whose official replay would not fit in memory is refused up front.
At the end the side-by-side table is printed per (N, compensator): statistics + score + solve per module,
their total without the layer forward, and the peak memory, official against ours, with the ratio.

Usage: python benchmarks/compare_stats_vs_activations.py [--shape 7b] [--tokens 16384 65536] [--device cpu]
           [--compensator procrustes ridge] [--threads 2] [--scale 0.05] [--gram-precision mixed] [--gram-error]
           [--dtype float64] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from make_random_llama import llama_config
from tabulate import tabulate
from torch import Tensor, nn
from transformers import LlamaForCausalLM

from rcpu_bench import peak_memory
from rcpu_bench.model import capture_layer_inputs, decoder_layers, layer_view, run_layer
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.layer_pass import prune_module
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.timing import Timer
from rcpu_bench.records import cpu_model, harness_commit
from rcpu_bench.selection.select import Selection
from rcpu_bench.statistics.activations import GRAM_PRECISIONS, collect_input_stats
from rcpu_bench.statistics.flops import cheapest_statistics, expected_kept

SEED = 0
RATIO = 0.2
LAMBDA = 1e-4  # the official code's default --lam
SEQLEN = 128
BATCH_WINDOWS = 8
VOCAB = 512  # random ids; the embedding only has to feed the layer
TOLERANCE = 1e-3
MODULES = {"attention": "o_proj", "mlp": "down_proj"}
COMPENSATORS = ("procrustes", "ridge")
GIB = 2**30


@dataclass(frozen=True)
class RunSpec:
    """One measurement, run in its own process; path 'baseline' only builds the layer and its inputs."""

    path: str
    shape: str
    scale: float
    tokens: int
    compensator: str
    gram_precision: str
    gram_error: bool
    device: str
    threads: int
    save: str
    dtype: str = "float64"  # our compensator's compute dtype
    rerun: bool = True  # re-run the pruned layer (part of "forward", not of the compared total)


def build_layer(spec: RunSpec) -> tuple[nn.Module, list]:
    """The seeded random-init decoder layer on the device and its calibration inputs (LayerInput batches)."""
    config = llama_config(spec.shape, spec.scale, layers=1)
    config.vocab_size = VOCAB
    torch.manual_seed(SEED)
    model = LlamaForCausalLM(config).eval()
    device = torch.device(spec.device)
    model.to(device)
    ids = torch.randint(0, VOCAB, (spec.tokens // SEQLEN, SEQLEN), generator=torch.Generator().manual_seed(SEED + 1))
    inputs = capture_layer_inputs(model, ids, BATCH_WINDOWS, device)
    layer = decoder_layers(model)[0]
    return layer, inputs


def projection(layer: nn.Module, module: str) -> nn.Linear:
    return layer_view(layer).projection(module)


def timed(fn: Callable[..., Any], timer: Timer, name: str) -> Callable[..., Any]:
    def wrapper(*args: Any) -> Any:
        with timer(name):
            return fn(*args)
    return wrapper


def statistics_plan(layer: nn.Module, spec: RunSpec, need: str) -> dict[str, frozenset[str]]:
    """The pipeline's choice per module: the cheapest statistics sufficient for ``need`` over N tokens."""
    plan = {}
    for module in MODULES:
        d_out, d_in = projection(layer, module).weight.shape
        plan[module] = cheapest_statistics(need, spec.tokens, d_out, d_in, expected_kept(d_in, RATIO),
                                           spec.gram_precision)
    return plan


def run_ours(layer: nn.Module, inputs: list, spec: RunSpec, timer: Timer) -> dict[str, Any]:
    """The statistics path through the library (one stats pass, prune_module per module); returns results."""
    registry = default_registry()
    params: dict[str, Any] = {"dtype": spec.dtype} | ({"lam": LAMBDA} if spec.compensator == "ridge" else {})
    config = PruneConfig(scorer="variance", scorer_params={"activation": "mean-abs"}, compensator=spec.compensator,
                         compensator_params=params, ratio=RATIO, gram_precision=spec.gram_precision)
    config.validate(registry)
    methods = registry.resolve(scorer=config.scorer, compensator=config.compensator)
    projections = {m: projection(layer, m) for m in MODULES}
    plan = statistics_plan(layer, spec, methods.needs(True))
    dense = {m: p.weight.detach().clone() for m, p in projections.items()} if spec.gram_error else {}
    with collect_input_stats(projections, with_gram=[m for m in MODULES if "gram" in plan[m]],
                             with_cross=[m for m in MODULES if "cross" in plan[m]],
                             gram_precision=spec.gram_precision) as stats, \
            collect_input_stats(projections if spec.gram_error else {}, gram_precision="float64") as reference:
        for module, accumulator in stats.items():
            accumulator.update = timed(accumulator.update, timer, f"{MODULES[module]} statistics")
        for module, accumulator in reference.items():
            accumulator.update = timed(accumulator.update, timer, f"{MODULES[module]} float64 check")
        with timer("pass"):
            run_layer(layer, inputs)
    results: dict[str, Any] = {}
    for module in MODULES:
        module_timer = Timer(timer.device)
        report = prune_module(layer_view(layer), module, stats[module], config, methods, module_timer)
        for part, seconds in module_timer.seconds.items():
            timer.seconds[f"{MODULES[module]} {part}"] = seconds
        mapping = layer_view(layer).units(module, config.gqa_rule)
        pruned_units = torch.tensor(report["pruned_units"], dtype=torch.long)
        results[module] = {"weight": projection(layer, module).weight.detach().cpu(),
                           "pruned_columns": columns_of(pruned_units, mapping.unit_size),
                           "statistics": "+".join(sorted(plan[module])) or "moments",
                           "solver": report["info"].get("solver", "")}
        if spec.gram_error:
            results[module] |= gram_error(dense[module], stats[module], reference[module], results[module], spec)
    return results


def columns_of(units: Tensor, unit_size: int) -> Tensor:
    """Input columns of the given units (heads of ``unit_size`` columns, or channels when 1), sorted."""
    return (units.sort().values[:, None] * unit_size + torch.arange(unit_size)).reshape(-1)


def gram_error(weight: Tensor, stats, reference, result: dict[str, Any], spec: RunSpec) -> dict[str, float]:
    """‖G − G₆₄‖_F/‖G₆₄‖_F and ‖C − W G₆₄‖_F/‖W G₆₄‖_F for what was collected, and the weight compensated
    from G₆₄ against ours (max relative difference)."""
    registry = default_registry()
    pruned = result["pruned_columns"].to(weight.device)
    kept_mask = torch.ones(weight.shape[1], dtype=torch.bool, device=weight.device)
    kept_mask[pruned] = False
    kept = kept_mask.nonzero().squeeze(1)
    params = {"lam": LAMBDA} if spec.compensator == "ridge" else {}
    from_float64 = registry.compensator(spec.compensator)(weight, reference, kept, pruned, **params).weight.cpu()
    g64 = reference.gram
    errors = {"weight_rel_diff_vs_float64": max_relative_difference(result["weight"], from_float64)}
    if stats.gram is not None:
        errors["gram_rel_frobenius_error"] = float((stats.gram - g64).norm() / g64.norm())
    if stats.cross is not None:
        wg64 = weight.to(torch.float64) @ g64
        errors["cross_rel_frobenius_error"] = float((stats.cross - wg64).norm() / wg64.norm())
    return errors


class ActivationStore:
    """The official hook: X and Y of one module stored in float32 (N × d), and a running Σ|x|."""

    def __init__(self, module: nn.Linear, tokens: int, timer: Timer, name: str):
        device = module.weight.device
        self.x = torch.empty(tokens, module.in_features, device=device)
        self.y = torch.empty(tokens, module.out_features, device=device)
        self.abs_sum = torch.zeros(module.in_features, device=device)
        self.filled = 0
        self.timer, self.name = timer, name

    def __call__(self, _module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
        with self.timer(f"{self.name} statistics"):
            x = args[0].detach().reshape(-1, self.x.shape[1])
            stop = self.filled + x.shape[0]
            self.x[self.filled : stop] = x
            self.y[self.filled : stop] = output.detach().reshape(-1, self.y.shape[1])
            self.abs_sum += x.abs().sum(0)
            self.filled = stop


def official_pruned_columns(weight: Tensor, store: ActivationStore, unit_size: int) -> Tensor:
    """γ_j = ‖W_j‖₂·mean|x_j|·Var(x_j) in float32, summed per head; units below sorted[⌊ρn⌋] are pruned."""
    x = store.x
    variance = (x.square().mean(0) - x.mean(0).square()).clamp_min(0)
    score = weight.norm(dim=0) * (store.abs_sum / x.shape[0]) * variance
    units = score.reshape(-1, unit_size).sum(1)
    threshold = units.sort().values[math.floor(RATIO * len(units))]
    return columns_of((units < threshold).nonzero().squeeze(1).cpu(), unit_size)


def official_solve(compensator: str, weight: Tensor, store: ActivationStore, kept: Tensor) -> Tensor:
    """Procrustes: Q W_K from the float32 SVD of M = Y Zᵀ; ridge: (Y X_Kᵀ + λW_K)·inv(X_K X_Kᵀ + λI)."""
    w_kept = weight[:, kept]
    x_kept = store.x[:, kept]
    if compensator == "procrustes":
        u, _, vh = torch.linalg.svd(store.y.T @ (x_kept @ w_kept.T), full_matrices=False)
        return (u @ vh) @ w_kept
    identity = torch.eye(len(kept), device=weight.device)
    return (store.y.T @ x_kept + LAMBDA * w_kept) @ torch.linalg.inv(x_kept.T @ x_kept + LAMBDA * identity)


def run_official(layer: nn.Module, inputs: list, spec: RunSpec, timer: Timer) -> dict[str, Any]:
    """The stored-activation replay: one pass storing X and Y, then score, select, solve and shrink per module."""
    stores = {m: ActivationStore(projection(layer, m), spec.tokens, timer, MODULES[m]) for m in MODULES}
    handles = [projection(layer, m).register_forward_hook(stores[m]) for m in MODULES]
    try:
        with timer("pass"):
            run_layer(layer, inputs)
    finally:
        for handle in handles:
            handle.remove()
    results: dict[str, Any] = {}
    for module in MODULES:
        name, weight = MODULES[module], projection(layer, module).weight.detach()
        unit_size = layer_view(layer).units(module, "group").unit_size
        with timer(f"{name} score"):
            pruned = official_pruned_columns(weight, stores[module], unit_size)
            kept_mask = torch.ones(weight.shape[1], dtype=torch.bool)
            kept_mask[pruned] = False
            kept = kept_mask.nonzero().squeeze(1).to(weight.device)
        with timer(f"{name} solve"):
            new_weight = official_solve(spec.compensator, weight, stores.pop(module), kept)
        layer_view(layer).apply(module, Selection(kept, pruned), new_weight)
        results[module] = {"weight": new_weight.cpu(), "pruned_columns": pruned}
    return results


def worker(spec: RunSpec) -> dict[str, Any]:
    """Build the layer and its inputs, run one path, save its results; report times and memory."""
    torch.set_num_threads(spec.threads)
    torch.set_grad_enabled(False)
    layer, inputs = build_layer(spec)
    device = torch.device(spec.device)
    if spec.path == "baseline":
        return {"peak_mib": peak_memory.peak_bytes(device) / 2**20}
    held = 0  # on the CPU the fresh process's whole peak; the baseline process's is subtracted by the caller
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        held = torch.cuda.memory_allocated(device)
        peak_memory.reset(device)
    timer = Timer(device)
    results = (run_ours if spec.path == "ours" else run_official)(layer, inputs, spec, timer)
    if spec.rerun:
        with timer("forward rerun"):
            run_layer(layer, inputs)
    peak_mib = (peak_memory.peak_bytes(device) - held) / 2**20
    torch.save(results, spec.save)
    return {"seconds": timer.seconds, "peak_mib": peak_mib}


class WorkerFailed(RuntimeError):
    """A measurement's process exited with an error (its last stderr line is the message)."""


def spawn(spec: RunSpec) -> dict[str, Any]:
    """Run ``worker(spec)`` in a fresh interpreter and return its report; WorkerFailed if it fails."""
    env = os.environ | {name: str(spec.threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(spec))],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        print(f"worker {spec} failed:\n{done.stderr[-4000:]}", file=sys.stderr, flush=True)
        raise WorkerFailed(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return json.loads(done.stdout.splitlines()[-1])


def split_seconds(seconds: dict[str, float]) -> dict[str, float]:
    """Per-module statistics/score/solve, forward (dense pass without hook time, plus the pruned re-run), total."""
    parts = {f"{name} {part}": seconds.get(f"{name} {part}", 0.0)
             for name in MODULES.values() for part in ("statistics", "score", "solve")}
    hooks = sum(seconds.get(f"{name} {kind}", 0.0) for name in MODULES.values()
                for kind in ("statistics", "float64 check"))
    parts["compared"] = sum(parts.values())  # statistics + score + solve of both modules: the compared total
    parts["forward"] = seconds["pass"] - hooks + seconds.get("forward rerun", 0.0)
    parts["total"] = parts["compared"] + parts["forward"]
    return parts


def max_relative_difference(ours: Tensor, official: Tensor) -> float:
    """max|ours − official| / max|official|."""
    return float((ours.double() - official.double()).abs().max() / official.double().abs().max())


def needed_bytes(path: str, spec_tokens: int, shape: str, scale: float) -> dict[str, float]:
    """Rough peak bytes of a path beyond the layer: the official one grows with N, ours with d_in² only.

    Both hold the layer's inputs and outputs (4·N·2h). Official: X and Y of o_proj (2·4·N·h) and of
    down_proj (4·N·(i + h)) plus its solve's X_K and Z (4·N·(0.8i + h)). Ours (an upper bound): G of both modules
    (C, h·i, where the flop model takes it instead, is smaller) and about
    six d_in² float64 solve temporaries of down_proj.
    """
    config = llama_config(shape, scale, layers=1)
    h, i, n = config.hidden_size, config.intermediate_size, spec_tokens
    both = 4 * n * 2 * h + 4 * (4 * h * h + 3 * h * i)
    if path == "official":
        return both + 4 * n * (2 * h + i + h) + 4 * n * (0.8 * i + h)
    return both + 8 * (h * h + i * i) + 6 * 8 * i * i


def available_bytes(device: str, limit_gib: float | None) -> float:
    """Free memory on the device (CUDA free memory, or MemAvailable), capped by ``--max-memory-gib``."""
    if torch.device(device).type == "cuda":
        free = torch.cuda.mem_get_info(torch.device(device))[0]
    else:
        with open("/proc/meminfo") as meminfo:
            free = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    return min(free, limit_gib * GIB) if limit_gib else free


def refuse_oversized(args: argparse.Namespace) -> str | None:
    """A message naming each token count whose runs would not fit in the available memory, or None."""
    free = available_bytes(args.device, args.max_memory_gib)
    problems = []
    for tokens in args.tokens:
        for path in ("official", "ours"):
            need = needed_bytes(path, tokens, args.shape, args.scale)
            if need > free:
                problems.append(f"N={tokens}: the {path} path needs about {need / GIB:.1f} GiB, more than the "
                                f"{free / GIB:.1f} GiB available")
    if problems:
        return ("refusing to run (it would swap or be killed): " + "; ".join(problems)
                + ". Pass fewer --tokens, a smaller --scale, or raise --max-memory-gib on a larger machine.")
    return None


def compare(tokens: int, compensator: str, args: argparse.Namespace, base: RunSpec, baseline_mib: float,
            workdir: Path) -> list[dict[str, Any]]:
    """Run every path for one case, ``--repeats`` times in turn; return table rows (one per time part, peak
    memory, agreement). Each time part is the minimum over the repeats (a shared machine only adds time),
    peak memory the maximum; every repeat's figures are kept under ``repeats``."""
    variants = [("official", "mixed")] + [("ours", precision) for precision in args.gram_precision]
    runs: dict[str, list[dict[str, float]]] = {}
    results = {}
    for repeat in range(args.repeats):
        for path, precision in variants:
            label = path if path == "official" else f"ours[{precision}]"
            spec = replace(base, path=path, tokens=tokens, compensator=compensator, gram_precision=precision,
                           gram_error=args.gram_error and path == "ours" and precision == "mixed",
                           save=str(workdir / f"{label}.pt"), rerun=not args.no_rerun)
            report = spawn(spec)
            run = split_seconds(report["seconds"]) | {"peak net MiB": report["peak_mib"] - baseline_mib}
            runs.setdefault(label, []).append(run)
            results[label] = torch.load(spec.save)
            print(f"N={tokens:<7} {compensator:<10} {label:<14} run {repeat + 1}/{args.repeats} " + "  ".join(
                f"{k} {v:.2f}" for k, v in run.items()), flush=True)
    reports = {label: {part: (max if part == "peak net MiB" else min)(run[part] for run in label_runs)
                       for part in label_runs[0]} for label, label_runs in runs.items()}
    rows = []
    for part in reports["official"]:
        row: dict[str, Any] = {"tokens": tokens, "compensator": compensator, "part": part}
        for label, report in reports.items():
            row[label] = report[part]
            row[f"{label} repeats"] = [run[part] for run in runs[label]]
        for label in reports:
            if label != "official":
                row[f"{label}/official"] = report_ratio(reports[label][part], reports["official"][part])
        rows.append(row)
    for module, name in MODULES.items():
        official = results["official"][module]
        for label in reports:
            if label == "official":
                continue
            ours = results[label][module]
            same = torch.equal(ours["pruned_columns"].sort().values, official["pruned_columns"].sort().values)
            row = {"tokens": tokens, "compensator": compensator, "part": f"{name} agreement", "variant": label,
                   "same_selection": same,
                   "max_rel_diff": max_relative_difference(ours["weight"], official["weight"]) if same else math.nan}
            row |= {k: v for k, v in ours.items() if k not in ("weight", "pruned_columns")}
            rows.append(row)
    return rows


def issue_table(rows: list[dict[str, Any]], label: str) -> list[dict[str, Any]]:
    """The side-by-side table per (N, compensator): each module's statistics + score + solve, their total without
    the layer forward, and the peak memory, official replay against ``label`` (e.g. ours[mixed]), with ratios."""
    table = []
    sides = ("official", label)
    cases = dict.fromkeys((r["tokens"], r["compensator"]) for r in rows if "agreement" not in r["part"])
    for tokens, compensator in cases:
        parts = {r["part"]: r for r in rows if (r["tokens"], r["compensator"]) == (tokens, compensator)}
        for name in MODULES.values():
            times = {side: [parts[f"{name} {part}"][side] for part in ("statistics", "score", "solve")]
                     for side in sides}
            chosen = parts[f"{name} agreement"]
            table.append({"N": tokens, "compensator": compensator,
                          "part": f"{name} statistics + score + solve",
                          **{side: " + ".join(f"{t:.2f}" for t in times[side]) for side in sides},
                          "ratio": report_ratio(sum(times[label]), sum(times["official"])),
                          "ours: statistics, solver": f"{chosen.get('statistics')}, {chosen.get('solver') or '-'}"})
        compared = parts["compared"]  # per run, then the minimum (the parts' minima may come from other runs)
        table.append({"N": tokens, "compensator": compensator, "part": "total without the layer forward",
                      **{side: f"{compared[side]:.2f}" for side in sides},
                      "ratio": report_ratio(compared[label], compared["official"])})
        memory = parts["peak net MiB"]
        table.append({"N": tokens, "compensator": compensator, "part": "peak memory (GiB, net)",
                      **{side: f"{memory[side] / 1024:.2f}" for side in sides},
                      "ratio": report_ratio(memory[label], memory["official"])})
    return table


def report_ratio(ours: float, official: float) -> float:
    return ours / official if official > 0 else math.nan


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` (internal) runs one measurement and prints its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=["7b", "13b"], default="7b")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink widths (e.g. 0.05 to validate)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384], help="calibration tokens N "
                        "(multiples of 128; e.g. 16384 65536 262144)")
    parser.add_argument("--compensator", nargs="+", choices=COMPENSATORS, default=list(COMPENSATORS))
    parser.add_argument("--gram-precision", nargs="+", choices=list(GRAM_PRECISIONS), default=["mixed"],
                        help="our Gram precision(s); each is its own variant")
    parser.add_argument("--gram-error", action="store_true", help="also accumulate a float64 G in the mixed run "
                        "and report ‖G − G64‖/‖G64‖ and the weight compensated from G64 (time not counted)")
    parser.add_argument("--dtype", choices=["float64", "float32"], default="float64",
                        help="our compensator's compute dtype (float64: the library's default; float32: the "
                        "official code's, checked at the float32 tolerance)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch/OpenMP threads per run")
    parser.add_argument("--max-memory-gib", type=float, help="refuse runs that need more than this")
    parser.add_argument("--repeats", type=int, default=1, help="run each path this many times, in turn, and take "
                        "each time part's minimum (peak memory: maximum)")
    parser.add_argument("--no-rerun", action="store_true", help="skip the pruned layer's re-run (part of the "
                        "'forward' time, not of the compared total)")
    parser.add_argument("--out", type=Path, help="also write the rows (and settings) as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    bad = [n for n in args.tokens if n <= 0 or n % SEQLEN]
    if bad:
        parser.error(f"--tokens {bad}: each must be a positive multiple of {SEQLEN}")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run every (N, compensator) on both paths, print the table; exit 1 if the paths disagree."""
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(RunSpec(**json.loads(args.worker)))))
        return 0
    refusal = refuse_oversized(args)
    if refusal:
        print(refusal, file=sys.stderr)
        return 2
    config = llama_config(args.shape, args.scale, layers=1)
    print(f"{args.shape} x{args.scale}: hidden {config.hidden_size}, MLP {config.intermediate_size}, "
          f"{config.num_attention_heads} heads; {args.device}, {args.threads} threads", flush=True)
    base = RunSpec("baseline", args.shape, args.scale, SEQLEN * BATCH_WINDOWS, "", "mixed", False, args.device,
                   args.threads, "", args.dtype)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for tokens in args.tokens:
            on_cuda = torch.device(args.device).type == "cuda"
            baseline = 0.0 if on_cuda else spawn(replace(base, tokens=tokens))["peak_mib"]
            for compensator in args.compensator:
                try:
                    rows += compare(tokens, compensator, args, base, baseline, Path(workdir))
                except WorkerFailed as error:  # the other cases still run; the exit status says so
                    rows.append({"tokens": tokens, "compensator": compensator, "part": "failed", "error": str(error)})
    failures = [r for r in rows if r["part"] == "failed"]
    rows = [r for r in rows if r["part"] != "failed"]
    print(tabulate([{k: v for k, v in r.items() if not k.endswith(" repeats")} for r in rows
                    if "agreement" not in r["part"]], headers="keys", floatfmt=".3g"))
    print(tabulate([r for r in rows if "agreement" in r["part"]], headers="keys", floatfmt=".3g"))
    for precision in args.gram_precision:
        print(f"\nSide by side, seconds: official replay against ours[{precision}] (ratio ours/official)")
        print(tabulate(issue_table(rows, f"ours[{precision}]"), headers="keys", floatfmt=".2f"))
    if args.out:
        settings = {"shape": args.shape, "scale": args.scale, "device": args.device, "threads": args.threads,
                    "dtype": args.dtype, "repeats": args.repeats, "rerun": not args.no_rerun,
                    "ratio": RATIO, "lambda": LAMBDA, "seqlen": SEQLEN, "batch_windows": BATCH_WINDOWS,
                    "torch": torch.__version__, "command": " ".join(["python", *sys.argv]), "cpu": cpu_model(),
                    "cuda": torch.cuda.get_device_name() if args.device.startswith("cuda") else None,
                    **harness_commit()}
        args.out.write_text(json.dumps({"settings": settings, "rows": rows, "failed": failures}, indent=2,
                                       default=str))
    failed = [r for r in rows
              if "agreement" in r["part"] and not (r["same_selection"] and r["max_rel_diff"] <= TOLERANCE)]
    for row in failed:
        print(f"MISMATCH N={row['tokens']} {row['compensator']} {row['part']} {row['variant']}: same selection "
              f"{row['same_selection']}, max relative difference {row['max_rel_diff']:.2e} (tolerance {TOLERANCE:g})")
    for row in failures:
        print(f"FAILED N={row['tokens']} {row['compensator']}: {row['error']}")
    return 1 if failed or failures else 0


if __name__ == "__main__":
    sys.exit(main())
