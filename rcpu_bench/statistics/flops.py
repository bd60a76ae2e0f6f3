"""Which statistics a module collects: the cheapest sufficient set by a flop count (issue 19).

A method declares the most it reads (``needs``, paper notation: W d_out × d_in, K the k kept columns):

* ``"moments"``: N, Σx, Σ|x|, Σx² and ‖Y‖² (cheap, always collected);
* ``"cross"``: also Y X_Kᵀ (Procrustes: M = Y Zᵀ = Y X_Kᵀ W_Kᵀ), from C = Σ y xᵀ (its columns K) or from
  G (W G[:,K]);
* ``"gram"``: also the blocks of G (ridge: G_KK and W_D G_DK; OBS; the objective and held-out diagnostics;
  scaled Procrustes, which reads Y X_Kᵀ as W G[:,K] from the same G).

So the sufficient sets are {} for "moments", {C} or {G} for "cross", and {G} for "gram", and the cheapest
by this model is collected (ties: the set without C). Costs, in flops of float32 products (G and C are
float32 products summed in float64 in "mixed" precision; W G[:,K] is a float64 product, weighted by
``FLOAT64_COST``):

    collect G (upper block triangle)              N·d_in²
    collect C                                     2·N·d_out·d_in
    Y X_Kᵀ = W G[:,K] from G, for "cross"         FLOAT64_COST · 2·d_out·d_in·k

E.g. LLaMA-7B at N = 16,384, ratio 0.2: o_proj (4096 → 4096, k ≈ 3277) {G} 5.0e11 < {C} 5.5e11;
down_proj (11,008 → 4096, k ≈ 8807) {C} 1.5e12 < {G} 3.6e12. For "cross", G wins when
N·d_in + FLOAT64_COST·2·d_out·k < 2·N·d_out, i.e. for outputs as wide as the inputs and many tokens.
G_KK alone cannot be collected: K is chosen from the same pass's moments, so G is collected whole and
the solvers read only its blocks. {G, C} is never collected: a "gram" method that also reads Y X_Kᵀ
(scaled Procrustes) would gain from C only with fewer tokens than about FLOAT64_COST·k.

The "float64" precision is the reference path: it collects G alone (every quantity follows from it).
k is not known before the selection; the model uses k = d_in − ⌊ratio·d_in⌋.
"""

from __future__ import annotations

import math

NEEDS: tuple[str, ...] = ("moments", "cross", "gram")  # each reads at least what the one before reads
SUFFICIENT: dict[str, tuple[frozenset[str], ...]] = {
    "moments": (frozenset(),),
    "cross": (frozenset({"cross"}), frozenset({"gram"})),
    "gram": (frozenset({"gram"}),),
}
# A float64 product's cost in float32-product flops on the CPU: 4096³ takes 1.74 s against 0.81 s on a
# 2-core Zen 3 (2 threads, MKL), 2.1x. (Equal rates on an H100's non-tensor cores; the choice changes only
# where the two sets' costs are within this factor of each other.)
FLOAT64_COST = 2.0


def strongest(*needs: str) -> str:
    """The need that covers all of ``needs`` (they are ordered: moments < cross < gram)."""
    for need in needs:
        if need not in NEEDS:
            raise ValueError(f"unknown statistics need {need!r}; allowed: {', '.join(NEEDS)}")
    return max(needs, key=NEEDS.index, default="moments")


def expected_kept(d_in: int, ratio: float) -> int:
    """k = d_in − ⌊ratio·d_in⌋, the model's stand-in for the kept columns chosen later."""
    return d_in - math.floor(ratio * d_in)


def statistics_flops(kinds: frozenset[str], need: str, n: int, d_out: int, d_in: int, k: int) -> float:
    """Flops (float32-product units) to collect ``kinds`` over N tokens and read from them what ``need`` reads."""
    cost = 0.0
    if "gram" in kinds:
        cost += n * d_in**2
    if "cross" in kinds:
        cost += 2 * n * d_out * d_in
    elif need == "cross" and "gram" in kinds:
        cost += FLOAT64_COST * 2 * d_out * d_in * k
    return cost


def cheapest_statistics(need: str, n: int, d_out: int, d_in: int, k: int,
                        precision: str = "mixed") -> frozenset[str]:
    """The cheapest set sufficient for ``need`` (module docstring); G alone for a "gram"/"cross" need in float64."""
    strongest(need)
    if precision == "float64":
        return frozenset() if need == "moments" else frozenset({"gram"})
    return min(SUFFICIENT[need], key=lambda kinds: (statistics_flops(kinds, need, n, d_out, d_in, k), len(kinds)))
