"""The harness's own methods: a plugin like any other, registered in code by ``plugins.plugin_manager`` (the peers'
methods are plugins of their own, ``rcpu_bench.methods``)."""

from rcpu_bench.compensation import compensators, diagnostics
from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.pruning import allocation
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
    register("none", compensators.none, dof=diagnostics.no_dof)
    register("flap-bias", compensators.flap_bias, dof=diagnostics.bias_dof)
    register("ridge", compensators.ridge, needs="gram", dof=diagnostics.ridge_dof)
    register("procrustes", compensators.procrustes, needs="output_cross", dof=diagnostics.rotation_dof)
    register("scaled-procrustes", compensators.scaled_procrustes, needs="gram", dof=diagnostics.scaled_rotation_dof)
