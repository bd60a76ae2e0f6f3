"""Olica's linear calibration as a plugin: registered through the ``register_compensators`` hook with its degrees of
freedom, as a third-party compensator would be."""

from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.methods.olica.calibration import low_rank_dof, olica


@hookimpl
def register_compensators(register: Register) -> None:
    register("olica", olica, needs="gram", dof=low_rank_dof, description="Olica's linear calibration on the kept "
             "inputs: W̃_K = W_K + Δ_r, the rank-r ridge least squares of the pruned error W_D X_D on X_K (Olica, He "
             "& Lin ICML 2025)")
