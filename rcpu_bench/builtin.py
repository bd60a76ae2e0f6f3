"""The built-in methods: a plugin like any other, registered in code by ``plugins.plugin_manager``."""

from rcpu_bench.compensation import compensators, diagnostics, olica, slimllm
from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.pruning import allocation, depth, search
from rcpu_bench.selection import obs, scorers


@hookimpl
def register_scorers(register: Register) -> None:
    register("magnitude", scorers.magnitude)
    register("wanda-sp", scorers.wanda_sp)
    register("variance", scorers.variance)
    register("flap-wifv", scorers.flap_wifv)
    register("minitron", scorers.minitron, description="Minitron's activation importance s_j = (E|x_j|)² or ‖X_j‖₂² "
             "of the consumer's input channels; a head's summed score is ‖F_head‖₂² (Minitron, Muralidharan et al. "
             "2024; NVIDIA ModelOpt)")


@hookimpl
def register_selectors(register: Register) -> None:
    register("obs", obs.obs, needs="gram", description="Greedy OBS removal by ε_S = tr(W_S [(H⁻¹)_SS]⁻¹ W_Sᵀ), "
             "H = G + λI, exact inverse downdate; batch > 1: SlimGPT's batched greedy (ZipLM, SlimGPT, Týr-the-Pruner)")


@hookimpl
def register_allocations(register: Register) -> None:
    register("uniform", allocation.uniform)
    register("log-increase", allocation.log_increase, description="SlimGPT's incremental ratio "
             "ρ_l = ρ + s·(ln(1+l)/ln L − mean), mean ρ (SlimGPT, Ling et al. 2024)")
    register("search", search.search, description="Evolutionary search of per-layer and per-module levels under the "
             "uniform allocation's parameter budget, candidates on disk, fitness KL(dense ‖ pruned) on held-out "
             "tokens (Týr-the-Pruner, Li et al. NeurIPS 2025)")


@hookimpl
def register_compensators(register: Register) -> None:
    register("none", compensators.none, dof=diagnostics.no_dof)
    register("flap-bias", compensators.flap_bias, dof=diagnostics.bias_dof)
    register("ridge", compensators.ridge, needs="gram", dof=diagnostics.ridge_dof)
    register("procrustes", compensators.procrustes, needs="output_cross", dof=diagnostics.rotation_dof)
    register("scaled-procrustes", compensators.scaled_procrustes, needs="gram", dof=diagnostics.scaled_rotation_dof)
    register("slimllm", slimllm.slimllm, needs="gram", dof=diagnostics.affine_rows_dof, description="SlimLLM's "
             "per-output-row affine least squares y_i ≈ a_i ŷ_i + b_i: W̃_K = diag(a) W_K, bias b (SlimLLM, Guo et al. "
             "ICML 2025)")
    register("olica", olica.olica, needs="gram", dof=diagnostics.low_rank_dof, description="Olica's linear "
             "calibration on the kept inputs: "
             "W̃_K = W_K + Δ_r, the rank-r ridge least squares of the pruned error W_D X_D on X_K (Olica, He & Lin "
             "ICML 2025)")


@hookimpl
def register_model_methods(register: Register) -> None:
    register("shortgpt", depth.shortgpt, check=depth.check_ratio, description="ShortGPT: remove the layers of lowest "
             "block influence BI = 1 − E[cos(x_in, x_out)], as many as match width pruning's parameters at ratio "
             "(Men et al. 2024)")
    register("replaceme", depth.replaceme, check=depth.check_ratio, description="ReplaceMe (LS): replace the closest "
             "run of layers by a linear map T merged into the preceding down_proj, parameter-matched "
             "(Shopkhoev et al. 2025)")
