"""Phi-3: fused projections, ``qkv_proj`` (rows q|k|v) and ``gate_up_proj`` (rows gate|up).

Pruning selects rows inside the fused matrices (``rcpu_bench.model.surgery.stacked``). Phi-3's attention
reads its query-head count from ``config.num_attention_heads`` at run time, so a pruned attention gets its
own count (``rcpu_bench.model.llama.ConfigOverride``).
"""

from rcpu_bench.model.llama import Family

PHI3 = Family("Phi3", ("phi3",), attention_producers=("qkv_proj",),
              mlp_producers=("gate_up_proj",), counts_in_config=True)
