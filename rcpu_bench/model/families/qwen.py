"""Qwen2/2.5 (q/k/v biases, sliding window on some layers) and Qwen3 (per-head q/k RMSNorms over head_dim,
heads·head_dim ≠ hidden size).

A per-head norm normalises each head on its own, so removing a head leaves the others exact.
"""

from rcpu_bench.model.llama import Family

QWEN2 = Family("Qwen2", ("qwen2",))
QWEN3 = Family("Qwen3", ("qwen3",), head_norms=("q_norm", "k_norm"))
