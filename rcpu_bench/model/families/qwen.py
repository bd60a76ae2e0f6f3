"""Qwen2/2.5 (q/k/v biases) and Qwen3 (per-head q/k RMSNorms over head_dim, heads·head_dim ≠ hidden size).

A per-head norm normalises each head on its own, so removing a head leaves the others exact.
"""

from rcpu_bench.model.llama import Family

QWEN2 = Family("Qwen2", ("qwen2",), "GQA, q/k/v biases, sliding window on some layers")
QWEN3 = Family("Qwen3", ("qwen3",), "GQA, per-head q/k RMSNorms, heads·head_dim ≠ hidden size",
               head_norms=("q_norm", "k_norm"))
