"""SlimLLM's output regression as a plugin: registered through the ``register_compensators`` hook with its degrees of
freedom, as a third-party compensator would be."""

from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.methods.slimllm.regression import affine_rows_dof, slimllm


@hookimpl
def register_compensators(register: Register) -> None:
    register("slimllm", slimllm, needs="gram", dof=affine_rows_dof, description="SlimLLM's per-output-row affine "
             "least squares y_i ≈ a_i ŷ_i + b_i: W̃_K = diag(a) W_K, bias b (SlimLLM, Guo et al. ICML 2025)")
