"""Mixture-of-experts families, refused up front: their MLP is a router over experts, not one MLP.

What is missing: pruning each expert's channels from the statistics of the tokens routed to it (a per-expert
compensation problem), and reporting experts that saw too few calibration tokens.
"""

_MISSING = ("the MLP is a mixture of experts (a router and {experts}); per-expert channel pruning and "
            "compensation from each expert's routed tokens is not implemented")

REFUSED: dict[str, str] = {
    "mixtral": _MISSING.format(experts="experts"),
    "qwen2_moe": _MISSING.format(experts="experts plus a shared expert"),
    "qwen3_moe": _MISSING.format(experts="experts"),
}
