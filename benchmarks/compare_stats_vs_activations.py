"""Statistics path versus the official RCPU stored-activation path: time, peak memory and agreement.

For one LLaMA-7B module (o_proj 4096×4096 or down_proj 4096×11008) and N calibration tokens:

* **stats** (ours): stream the activations batch by batch into ``ActivationStats`` (float64 sums and
  Gram G = Σ x xᵀ), then compensate from G with ``rcpu_bench.compensators`` (float64).
* **official** (RCPU code, methods-spec §2.1): store X (d_in × N) in float32, form Y = W X and
  Z = W_K X_K, then M = Y Zᵀ and a float32 SVD (procrustes), or an explicit ``torch.linalg.inv`` of
  X_K X_Kᵀ + λI (ridge).

Both paths draw the same seeded synthetic activations batch by batch, so they see bit-identical X.
Every (path, module, N, compensator) runs in a fresh subprocess that reports its own time and peak
RSS; a baseline child per module (imports, W, selection, nothing else) gives the memory to subtract.
The compensated weights of the two paths are compared, so the run is also a correctness check.

Usage: python benchmarks/compare_stats_vs_activations.py [--scale 0.05] [--tokens 16384 65536] ...
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

import torch
from tabulate import tabulate
from torch import Tensor

from rcpu_bench.compensators import procrustes, ridge
from rcpu_bench.selection import Selection, select_by_score
from rcpu_bench.stats import ActivationStats

SEED = 0
RATIO = 0.2
LAMBDA = 1e-4  # the official code's default --lam
# Tokens per streamed batch: 8 calibration windows of 128 tokens, one forward batch of a pipeline.
BATCH_TOKENS = 1024
# Largest allowed max|W_ours − W_official| / max|W_official|: the official path is float32 throughout.
TOLERANCE = 1e-3
PATHS = ("stats", "official")
COMPENSATORS = ("procrustes", "ridge")


@dataclass(frozen=True)
class ModuleShape:
    """A linear module W (d_out × d_in) whose input columns are pruned in units of ``unit_size``."""

    name: str
    d_out: int
    d_in: int
    unit_size: int


def module_shapes(scale: float = 1.0) -> dict[str, ModuleShape]:
    """LLaMA-7B o_proj (32 heads of 128 columns) and down_proj (11,008 channels), widths times ``scale``."""
    head_dim = max(1, round(128 * scale))
    hidden = 32 * head_dim
    return {"o_proj": ModuleShape("o_proj", hidden, hidden, head_dim),
            "down_proj": ModuleShape("down_proj", hidden, max(1, round(11008 * scale)), 1)}


def make_weight(shape: ModuleShape) -> Tensor:
    """A seeded float32 weight with unit-variance outputs for unit-variance inputs."""
    generator = torch.Generator().manual_seed(SEED)
    return torch.randn(shape.d_out, shape.d_in, generator=generator) / shape.d_in**0.5


def select_columns(weight: Tensor, shape: ModuleShape, ratio: float = RATIO) -> Selection:
    """Prune the units (heads or channels) with the smallest column norms; data-free, so both paths agree."""
    unit_scores = weight.norm(dim=0).reshape(-1, shape.unit_size).sum(1)
    return select_by_score(unit_scores, ratio).columns(shape.unit_size)


def synthetic_batches(d_in: int, n_tokens: int, batch_tokens: int = BATCH_TOKENS) -> Iterator[Tensor]:
    """Seeded float32 activations, (tokens × d_in) per batch, ``n_tokens`` in all.

    Each channel has its own mean (≈ 0.1·N(0,1)) and scale (log-normal, e^{±0.25}), so the mean adds a
    rank-one term to G as in real activations while G stays well conditioned for float32 solves.
    """
    generator = torch.Generator().manual_seed(SEED + 1)
    mean = 0.1 * torch.randn(d_in, generator=generator)
    scale = torch.exp(0.25 * torch.randn(d_in, generator=generator))
    for start in range(0, n_tokens, batch_tokens):
        yield torch.randn(min(batch_tokens, n_tokens - start), d_in, generator=generator) * scale + mean


def gram_collector(d_in: int, n_tokens: int) -> tuple[ActivationStats, Callable[[Tensor], None]]:
    """Our collector: float64 running sums and Gram matrix, memory independent of ``n_tokens``."""
    stats = ActivationStats.empty(d_in)
    return stats, stats.update


def activation_store(d_in: int, n_tokens: int) -> tuple[Tensor, Callable[[Tensor], None]]:
    """The official collector: every input column kept in a float32 X (d_in × N).

    X is preallocated and filled in place; the reference concatenates per-sample copies, which needs more.
    """
    x = torch.empty(d_in, n_tokens)
    filled = 0

    def store(batch: Tensor) -> None:
        nonlocal filled
        x[:, filled : filled + batch.shape[0]] = batch.T
        filled += batch.shape[0]

    return x, store


def solve_ours(compensator: str, weight: Tensor, stats: ActivationStats, selection: Selection) -> Tensor:
    """Compensate from the statistics with the library's compensator (float64)."""
    solver = {"procrustes": procrustes, "ridge": partial(ridge, lam=LAMBDA)}[compensator]
    return solver(weight, stats, selection.kept, selection.pruned).weight


def official_procrustes(weight: Tensor, x: Tensor, kept: Tensor) -> Tensor:
    """RCPU ``rcpu``: Q = U Vᵀ from the float32 SVD of M = Y Zᵀ, new kept columns Q W_K."""
    w_kept = weight[:, kept]
    y, z = weight @ x, w_kept @ x[kept]
    u, _, vh = torch.linalg.svd(y @ z.T, full_matrices=False)
    return (u @ vh) @ w_kept


def official_ridge(weight: Tensor, x: Tensor, kept: Tensor) -> Tensor:
    """RCPU ``propls``: (Y X_Kᵀ + λ W_K) · inv(X_K X_Kᵀ + λI), all float32, explicit inverse."""
    x_kept = x[kept]
    y = weight @ x
    gram_kept = x_kept @ x_kept.T + LAMBDA * torch.eye(len(kept))
    return (y @ x_kept.T + LAMBDA * weight[:, kept]) @ torch.linalg.inv(gram_kept)


def solve_official(compensator: str, weight: Tensor, x: Tensor, selection: Selection) -> Tensor:
    """Compensate from the stored activations as the official code does."""
    return {"procrustes": official_procrustes, "ridge": official_ridge}[compensator](weight, x, selection.kept)


# path -> (collector(d_in, n_tokens) -> (state, fold), solver(compensator, weight, state, selection))
PATH_STEPS = {"stats": (gram_collector, solve_ours), "official": (activation_store, solve_official)}


def timed_fold(batches: Iterator[Tensor], fold: Callable[[Tensor], None]) -> float:
    """Feed every batch to ``fold``; return the seconds spent folding (drawing the data is not counted)."""
    spent = 0.0
    for batch in batches:
        start = time.perf_counter()
        fold(batch)
        spent += time.perf_counter() - start
    return spent


def peak_rss_mib() -> float:
    """This process's peak resident memory (VmHWM) in MiB.

    Not ``ru_maxrss``: a child started by vfork/exec inherits its parent's high-water mark there.
    """
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


@dataclass(frozen=True)
class RunSpec:
    """One measurement, run in its own process; path 'baseline' only builds W and the selection."""

    path: str
    module: str
    tokens: int
    compensator: str
    scale: float
    threads: int
    save: str


def worker(spec: RunSpec) -> dict[str, float]:
    """Collect and compensate one module along one path; save the new weight, report time and peak RSS."""
    torch.set_num_threads(spec.threads)
    shape = module_shapes(spec.scale)[spec.module]
    weight = make_weight(shape)
    selection = select_columns(weight, shape)
    if spec.path == "baseline":
        return {"peak_mib": peak_rss_mib()}
    collector, solver = PATH_STEPS[spec.path]
    state, fold = collector(shape.d_in, spec.tokens)
    collect_s = timed_fold(synthetic_batches(shape.d_in, spec.tokens), fold)
    start = time.perf_counter()
    new_weight = solver(spec.compensator, weight, state, selection)
    solve_s = time.perf_counter() - start
    peak = peak_rss_mib()
    torch.save(new_weight, spec.save)
    return {"collect_s": collect_s, "solve_s": solve_s, "peak_mib": peak}


def spawn(spec: RunSpec) -> dict[str, float]:
    """Run ``worker(spec)`` in a fresh interpreter and return its report."""
    env = os.environ | {name: str(spec.threads) for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(asdict(spec))],
                          env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"worker {spec} failed:\n{done.stderr}")
    return json.loads(done.stdout.splitlines()[-1])


def max_relative_difference(ours: Tensor, official: Tensor) -> float:
    """max|ours − official| / max|official|."""
    return float((ours - official).abs().max() / official.abs().max())


def compare(module: str, tokens: int, compensator: str, baseline_mib: float, args: argparse.Namespace,
            workdir: Path) -> dict[str, float | int | str]:
    """Run both paths for one case, print a progress line per run, and return the table row."""
    reports, weights = {}, {}
    for path in PATHS:
        save = workdir / f"{path}.pt"
        report = spawn(RunSpec(path, module, tokens, compensator, args.scale, args.threads, str(save)))
        reports[path], weights[path] = report, torch.load(save)
        print(f"{path:>8} {module:>9} N={tokens:<6} {compensator:<10} collect {report['collect_s']:7.2f} s"
              f"  solve {report['solve_s']:7.2f} s  peak {report['peak_mib']:7.0f} MiB"
              f" (net {report['peak_mib'] - baseline_mib:7.0f})", flush=True)
    seconds = {path: reports[path]["collect_s"] + reports[path]["solve_s"] for path in PATHS}
    net = {path: reports[path]["peak_mib"] - baseline_mib for path in PATHS}
    return {"module": module, "tokens": tokens, "compensator": compensator,
            "ours_s": seconds["stats"], "official_s": seconds["official"],
            "time_ratio": seconds["stats"] / seconds["official"],
            "ours_net_mib": net["stats"], "official_net_mib": net["official"],
            "mem_ratio": net["stats"] / net["official"],
            "ours_raw_mib": reports["stats"]["peak_mib"], "official_raw_mib": reports["official"]["peak_mib"],
            "max_rel_diff": max_relative_difference(weights["stats"], weights["official"])}


def baseline_mib(module: str, args: argparse.Namespace) -> float:
    """Peak RSS of a child that only imports torch and builds the module's W and selection."""
    peak = spawn(RunSpec("baseline", module, 0, "", args.scale, args.threads, ""))["peak_mib"]
    print(f"baseline {module:>9} peak {peak:7.0f} MiB", flush=True)
    return peak


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options; ``--worker`` (internal) runs one measurement and prints its JSON report."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", type=float, default=1.0, help="multiply module widths (e.g. 0.05 to validate)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[16384, 65536], help="calibration tokens N")
    parser.add_argument("--modules", nargs="+", choices=["o_proj", "down_proj"], default=["o_proj", "down_proj"])
    parser.add_argument("--compensator", nargs="+", choices=COMPENSATORS, default=list(COMPENSATORS))
    parser.add_argument("--threads", type=int, default=os.cpu_count(), help="torch/OpenMP threads per run")
    parser.add_argument("--out", type=Path, help="also write the table (and settings) as JSON here")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    """Run every (module, N, compensator) on both paths, print the table; exit 1 if the paths disagree."""
    args = parse_args(argv)
    if args.worker:
        print(json.dumps(worker(RunSpec(**json.loads(args.worker)))))
        return 0
    shapes = module_shapes(args.scale)
    print(f"scale {args.scale}: " + ", ".join(f"{s.name} {s.d_out}×{s.d_in}" for s in shapes.values())
          + f"; {args.threads} threads; batches of {BATCH_TOKENS} tokens", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as workdir:
        for module in args.modules:
            base = baseline_mib(module, args)
            rows += [compare(module, tokens, compensator, base, args, Path(workdir))
                     for tokens in args.tokens for compensator in args.compensator]
    print(tabulate(rows, headers="keys", floatfmt=".3g"))
    if args.out:
        settings = {"scale": args.scale, "threads": args.threads, "batch_tokens": BATCH_TOKENS,
                    "ratio": RATIO, "lambda": LAMBDA, "torch": torch.__version__}
        args.out.write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    failed = [row for row in rows if not row["max_rel_diff"] <= TOLERANCE]
    for row in failed:
        print(f"MISMATCH {row['module']} N={row['tokens']} {row['compensator']}: "
              f"max relative difference {row['max_rel_diff']:.2e} > {TOLERANCE:g}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
