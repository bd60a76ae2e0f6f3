"""rcpu-bench: post-training structured pruning of LLaMA-family models with error compensation."""

from rcpu_bench.compensation.compensators import Compensation
from rcpu_bench.hookspecs import hookimpl
from rcpu_bench.model import hf_format  # noqa: F401  (registers the per-layer saved format with the Auto classes)
from rcpu_bench.registry import Method, Registry, Resolved, default_registry
from rcpu_bench.selection.select import Selection, select_by_score
from rcpu_bench.statistics.activations import ActivationStats, collect_input_stats

__version__ = "0.1.0"
__all__ = ["ActivationStats", "Compensation", "Method", "Registry", "Resolved", "Selection", "collect_input_stats",
           "default_registry", "hookimpl", "select_by_score"]
