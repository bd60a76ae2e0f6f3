"""The built-in methods: a plugin like any other, registered in code by ``plugins.plugin_manager``."""

from rcpu_bench.compensation import compensators
from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.pruning import allocation, depth
from rcpu_bench.selection import obs, scorers


@hookimpl
def register_scorers(register: Register) -> None:
    register("magnitude", scorers.magnitude)
    register("wanda-sp", scorers.wanda_sp)
    register("variance", scorers.variance)
    register("flap-wifv", scorers.flap_wifv)


@hookimpl
def register_selectors(register: Register) -> None:
    register("obs", obs.obs, needs="gram", description="Greedy OBS removal by ε_S = tr(W_S [(H⁻¹)_SS]⁻¹ W_Sᵀ), "
             "H = G + λI, exact inverse downdate; batch > 1: SlimGPT's batched greedy (ZipLM, SlimGPT, Týr-the-Pruner)")


@hookimpl
def register_allocations(register: Register) -> None:
    register("uniform", allocation.uniform)
    register("log-increase", allocation.log_increase, description="SlimGPT's incremental ratio "
             "ρ_l = ρ + s·(ln(1+l)/ln L − mean), mean ρ (SlimGPT, Ling et al. 2024)")


@hookimpl
def register_compensators(register: Register) -> None:
    register("none", compensators.none)
    register("flap-bias", compensators.flap_bias)
    register("ridge", compensators.ridge, needs="gram")
    register("procrustes", compensators.procrustes, needs="output_cross")
    register("scaled-procrustes", compensators.scaled_procrustes, needs="gram")


@hookimpl
def register_model_methods(register: Register) -> None:
    register("shortgpt", depth.shortgpt, description="ShortGPT: remove the layers of lowest block influence "
             "BI = 1 − E[cos(x_in, x_out)], as many as match width pruning's parameters at ratio (Men et al. 2024)")
    register("replaceme", depth.replaceme, description="ReplaceMe (LS): replace the closest run of layers by a "
             "linear map T merged into the preceding down_proj, parameter-matched (Shopkhoev et al. 2025)")
