"""The depth baselines as plugins: whole-model methods registered through the ``register_model_methods`` hook with
their ``check=`` (the layer count their ratio matches), as a third-party model method would be."""

from rcpu_bench.hookspecs import Register, hookimpl
from rcpu_bench.methods.depth.layers import check_ratio
from rcpu_bench.methods.depth.replaceme import replaceme
from rcpu_bench.methods.depth.shortgpt import shortgpt


@hookimpl
def register_model_methods(register: Register) -> None:
    register("shortgpt", shortgpt, check=check_ratio, description="ShortGPT: remove the layers of lowest block "
             "influence BI = 1 − E[cos(x_in, x_out)], as many as match width pruning's parameters at ratio "
             "(Men et al. 2024)")
    register("replaceme", replaceme, check=check_ratio, description="ReplaceMe (LS): replace the closest run of "
             "layers by a linear map T merged into the preceding down_proj, parameter-matched "
             "(Shopkhoev et al. 2025)")
