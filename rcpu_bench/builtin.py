"""The built-in methods: a plugin like any other, registered in code by ``registry.plugin_manager``."""

from rcpu_bench.compensation import compensators
from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.selection import scorers


@hookimpl
def register_scorers(register: Register) -> None:
    register("magnitude", scorers.magnitude)
    register("wanda-sp", scorers.wanda_sp)
    register("variance", scorers.variance)
    register("flap-wifv", scorers.flap_wifv)


@hookimpl
def register_compensators(register: Register) -> None:
    register("none", compensators.none)
    register("flap-bias", compensators.flap_bias)
    register("ridge", compensators.ridge, needs="gram")
    register("procrustes", compensators.procrustes, needs="cross")
    register("scaled-procrustes", compensators.scaled_procrustes, needs="gram")
