"""Granite: Llama's layers with scalar multipliers (embedding, attention scale, residual, logits).

The multipliers scale whole tensors after the pruned projections' outputs, so pruning stays exact.
"""

from rcpu_bench.model.llama import Family

GRANITE = Family("Granite", ("granite",), logit_divisor="logits_scaling")
