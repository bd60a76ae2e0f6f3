"""Minitron's importance score as a plugin: registered through the ``register_scorers`` hook, as a third-party scorer
would be."""

from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.methods.minitron.importance import minitron


@hookimpl
def register_scorers(register: Register) -> None:
    register("minitron", minitron, description="Minitron's activation importance s_j = (E|x_j|)² or ‖X_j‖₂² of the "
             "consumer's input channels; a head's summed score is ‖F_head‖₂² (Minitron, Muralidharan et al. 2024; "
             "NVIDIA ModelOpt)")
