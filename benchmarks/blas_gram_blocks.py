"""One chunk of G's upper block triangle through torch's BLAS and through NumPy's, side by side.

The statistics' cost is float32 block products, ``X[:, i:i+b]ᵀ X[:, i:]`` per block row of
``activations.GRAM_BLOCK`` (``activations.add_gram_upper``, without the float64 adds). torch's x86 CPU
wheels run them on MKL, NumPy's wheels on OpenBLAS; this times the same loop on both, interleaved, and prints
the ratio. It only measures: the package uses torch's BLAS.

    python benchmarks/blas_gram_blocks.py --tokens 4096 --d-in 11008 --threads 2 --rounds 6
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096, help="rows of the chunk (activations.CHUNK_TOKENS)")
    parser.add_argument("--d-in", type=int, default=11008, help="columns: 11008 is a LLaMA-7B down_proj input")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    if min(args.tokens, args.d_in, args.threads, args.rounds) < 1:
        parser.error("--tokens, --d-in, --threads and --rounds must be >= 1")
    os.environ["OPENBLAS_NUM_THREADS"] = str(args.threads)  # read when NumPy loads OpenBLAS
    import numpy
    import torch

    from rcpu_bench.statistics.activations import GRAM_BLOCK

    torch.set_num_threads(args.threads)
    x = torch.randn(args.tokens, args.d_in, generator=torch.Generator().manual_seed(0))
    x_np = x.numpy()  # the same memory

    def upper_blocks(a) -> None:  # a torch tensor or a NumPy array: the same slicing and product
        for start in range(0, args.d_in, GRAM_BLOCK):
            a[:, start : start + GRAM_BLOCK].T @ a[:, start:]

    torch_blas = re.search(r"BLAS_INFO=(\w+)", torch.__config__.show())
    numpy_blas = numpy.__config__.CONFIG["Build Dependencies"]["blas"]
    names = (f"torch ({torch_blas[1] if torch_blas else 'BLAS unknown'})",
             f"numpy ({numpy_blas['name']} {numpy_blas.get('version', '')})")
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name, a in zip(times, (x, x_np)):
            start = time.perf_counter()
            upper_blocks(a)
            times[name].append(time.perf_counter() - start)
    flops = args.tokens * args.d_in**2  # the upper block triangle: N·d_in² (statistics/flops.py)
    print(f"{os.uname().machine}, {args.threads} threads, chunk {args.tokens} x {args.d_in}, blocks of {GRAM_BLOCK}; "
          f"seconds per chunk over {args.rounds} interleaved rounds")
    for name, values in times.items():
        print(f"{name:36s} min {min(values):.2f}  median {statistics.median(values):.2f}  max {max(values):.2f}  "
              f"({flops / min(values) / 1e9:.0f} GFLOPS at the min)")
    torch_median, numpy_median = (statistics.median(v) for v in times.values())
    print(f"numpy / torch, medians: {numpy_median / torch_median:.2f}")


if __name__ == "__main__":
    main()
