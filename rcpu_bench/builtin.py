"""The built-in methods, registered through the ``rcpu_bench`` entry point like any plugin."""

from rcpu_bench.compensation import compensators
from rcpu_bench.selection import scorers
from rcpu_bench.hookspecs import hookimpl


@hookimpl
def register_scorers(register):
    register("magnitude", scorers.magnitude)
    register("wanda-sp", scorers.wanda_sp)
    register("variance", scorers.variance)
    register("flap-wifv", scorers.flap_wifv)


@hookimpl
def register_compensators(register):
    register("none", compensators.none)
    register("flap-bias", compensators.flap_bias)
    register("ridge", compensators.ridge, needs="gram")
    register("procrustes", compensators.procrustes, needs="gram")
    register("scaled-procrustes", compensators.scaled_procrustes, needs="gram")
