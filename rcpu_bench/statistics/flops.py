"""Which statistics a module collects: the cheapest sufficient set by a flop count.

A method declares the most it reads (``needs``, paper notation: W d_out × d_in, K the k kept columns, D the
dropped ones):

* ``"moments"``: N, Σx, Σ|x|, Σx² and ‖Y‖² (cheap, always collected);
* ``"output_cross"``: also M = Y Zᵀ = Y X_Kᵀ W_Kᵀ (Procrustes), from C = Σ y xᵀ (Y X_Kᵀ = C[:,K]), from
  G (Y X_Kᵀ = W G[:,K]), or, when D is fixed before the pass, from S = Σ y yᵀ and C_D = Σ y x_Dᵀ
  ("dropped_cross": Z = Y − W_D X_D, so M = S − C_D W_Dᵀ);
* ``"cross"``: also Y X_Kᵀ itself, from C or G;
* ``"gram"``: also the blocks of G (ridge: G_KK and W_D G_DK; OBS; the objective and held-out diagnostics;
  scaled Procrustes, which reads Y X_Kᵀ as W G[:,K] from the same G).

So the sufficient sets are {} for "moments", {C}, {G} or {S, C_D} for "output_cross", {C} or {G} for
"cross", and {G} for "gram", and the cheapest by this model is collected (ties: the fewer kinds, then the
order listed). Costs, in flops of float32 products (G, C, S and C_D are float32 products summed in float64
in "mixed" precision; the products that turn them into what is read are float64, weighted by
``FLOAT64_COST``):

    collect G (upper block triangle)              N·d_in²
    collect C                                     2·N·d_out·d_in
    collect S and C_D                             N·d_out² + 2·N·d_out·|D|
    Y X_Kᵀ = W G[:,K] from G                      FLOAT64_COST · 2·d_out·d_in·k
    M = Y X_Kᵀ W_Kᵀ from C or G                   FLOAT64_COST · 2·d_out²·k more
    M = S − C_D W_Dᵀ                              FLOAT64_COST · 2·d_out²·|D|

E.g. for "output_cross", LLaMA-7B at N = 16,384, ratio 0.2: o_proj (4096 → 4096, k ≈ 3277) {G} 7.2e11 < {C} 7.7e11;
down_proj (11,008 → 4096, k ≈ 8807) {C} 2.1e12 < {G} 4.2e12; {S, C_D} 4.4e11 and 7.2e11 when the units are
chosen before the pass (FLAP's global AL-AM structure). (For k < d_out the rotation is solved on W_K's
span from B = M P, W_K = P T, rather than from M; the model counts M.) Otherwise K is chosen from the same
pass's moments, so neither {S, C_D} nor G_KK alone can be collected: G is collected whole and the solvers
read its blocks. (Candidates for D chosen from the first chunk's moments do not pay: on a random-init 7B layer the
finally dropped down_proj channels ranked up to 3x the dropped count by the first 4096 tokens' scores, so a
superset that never misses costs nearly C; benchmarks/README.md.)
{G, C} is never collected: a "gram" method that also reads Y X_Kᵀ (scaled Procrustes) would gain from C
only with fewer tokens than about FLOAT64_COST·k.

The "float64" precision is the reference path: it collects G alone (every quantity follows from it).
Without a fixed selection k is not known before the pass; the model uses k = d_in − ⌊ratio·d_in⌋.
"""

from __future__ import annotations

import math

# Each reads at least what the one before reads (the public names: ``hookspecs.Needs``).
NEEDS: tuple[str, ...] = ("moments", "output_cross", "cross", "gram")

SUFFICIENT: dict[str, tuple[frozenset[str], ...]] = {
    "moments": (frozenset(),),
    "output_cross": (frozenset({"cross"}), frozenset({"gram"}), frozenset({"dropped_cross"})),
    "cross": (frozenset({"cross"}), frozenset({"gram"})),
    "gram": (frozenset({"gram"}),),
}
# The sets that need the dropped columns before the pass.
NEEDS_SELECTION = frozenset({"dropped_cross"})
# A float64 product's cost in float32-product flops on the CPU: 4096³ takes 1.74 s against 0.81 s on a
# 2-core Zen 3 (2 threads, MKL), 2.1x. (Equal rates on an H100's non-tensor cores; the choice changes only
# where the two sets' costs are within this factor of each other.)
FLOAT64_COST = 2.0


def strongest(*needs: str) -> str:
    """The need that covers all of ``needs`` (they are ordered: moments < output_cross < cross < gram)."""
    for need in needs:
        if need not in NEEDS:
            raise ValueError(f"unknown statistics need {need!r}; allowed: {', '.join(NEEDS)}")
    return max(needs, key=NEEDS.index, default="moments")


def expected_kept(d_in: int, ratio: float) -> int:
    """k = d_in − ⌊ratio·d_in⌋, the model's stand-in for the kept columns chosen later."""
    return d_in - math.floor(ratio * d_in)


def statistics_flops(kinds: frozenset[str], need: str, n: int, d_out: int, d_in: int, k: int) -> float:
    """Flops (float32-product units) to collect ``kinds`` over N tokens and form from them what ``need`` reads."""
    dropped = d_in - k
    cost = 0.0
    if "gram" in kinds:
        cost += n * d_in**2
    if "cross" in kinds:
        cost += 2 * n * d_out * d_in
    if "dropped_cross" in kinds:
        cost += n * d_out**2 + 2 * n * d_out * dropped
    if need in ("cross", "output_cross") and kinds == {"gram"}:
        cost += FLOAT64_COST * 2 * d_out * d_in * k  # Y X_Kᵀ = W G[:,K]
    if need == "output_cross":
        cost += FLOAT64_COST * 2 * d_out**2 * (dropped if "dropped_cross" in kinds else k)  # M
    return cost


def cheapest_statistics(need: str, n: int, d_out: int, d_in: int, k: int, precision: str = "mixed",
                        selected: bool = False) -> frozenset[str]:
    """The cheapest set sufficient for ``need`` (module docstring); G alone for any need but "moments" in float64.

    ``selected``: the kept columns (k of them) are fixed before the pass, so S and C_D can be collected.
    """
    strongest(need)
    if precision == "float64":
        return frozenset() if need == "moments" else frozenset({"gram"})
    candidates = [kinds for kinds in SUFFICIENT[need] if selected or not kinds & NEEDS_SELECTION]
    return min(candidates, key=lambda kinds: (statistics_flops(kinds, need, n, d_out, d_in, k), len(kinds)))
