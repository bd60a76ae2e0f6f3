"""What a table column shows, read from one run record: perplexity, zero-shot accuracy, sizes, timings, speed.

Every value comes from a record (``rcpu_bench.matrix.store.StoredResult.record``) through an :data:`Extract`;
a value the record does not have is None (an empty cell), never a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from statistics import fmean
from typing import Any, Literal

from rcpu_bench.evaluation.metric_maps import METRIC_MAPS
from rcpu_bench.matrix.store import StoredResult
from rcpu_bench.pruning.timing import PHASES
from rcpu_bench.records import Record

PAPER_PROFILE = "rcpu128"  # the paper's WikiText-2 perplexities use the seqlen-128 protocol
BYTES_PER_PARAMETER = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2}

Better = Literal["lower", "higher"]
Extract = Callable[[Record], Any]  # a value from a run record, None when it has none


@dataclass(frozen=True)
class Metric:
    """What a column shows: its name in the paper CSV, header, direction (None: never marked) and number
    format. ``decimals`` is also the precision at which values tie, so cells that print the same share a mark."""

    key: str
    header: str
    better: Better | None
    decimals: int = 2
    style: Literal["fixed", "grouped", "si", "lambda", "text"] = "fixed"

    def format(self, value: float) -> str:
        if self.style == "si":
            return _si(value)
        if self.style == "lambda":
            return f"{value:.0e}"
        return f"{value:,.{self.decimals}f}" if self.style == "grouped" else f"{value:.{self.decimals}f}"


def _si(value: float) -> str:
    """A count with a K / M / B suffix and two decimals, as the paper writes parameter counts (6.73B)."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}"


PPL = Metric("wikitext2_ppl", "", "lower")
LAMBDA = Metric("lambda", "lambda_best", None, style="lambda")  # the ridge λ a row's run used
TASK_HEADERS = {"boolq": "BoolQ", "piqa": "PIQA", "hellaswag": "Hella", "winogrande": "Wino", "arc_easy": "ARC-e",
                "arc_challenge": "ARC-c", "openbookqa": "OBQA"}
MEAN = Metric("mean", "Mean", "higher")
# Sizes are facts of the pruned model, not scores: never marked. "memory_mib" is the paper's "Memory size":
# the pruned model's weights (parameters × bytes per parameter), not the peak memory of pruning.
PHASE_METRICS = tuple(Metric(f"{phase}_seconds_per_layer", f"{phase} s/layer", "lower", decimals=3)
                      for phase in PHASES)  # every declared phase (rcpu_bench.pruning.timing), where measured
EFFICIENCY = (Metric("params", "Params", None, decimals=0, style="si"),
              Metric("memory_mib", "Model size (MiB)", None, decimals=0, style="grouped"),
              Metric("peak_memory_mib", "Peak memory (MiB)", None, decimals=0, style="grouped"),
              Metric("seconds_per_layer", "Seconds per layer", "lower"),
              *PHASE_METRICS,
              Metric("device", "Device", None, style="text"),
              Metric("prefill_tokens_per_s", "Prefill tok/s", "higher", decimals=0, style="grouped"),
              Metric("decode_tokens_per_s", "Decode tok/s", "higher", decimals=0, style="grouped"))
# llama.cpp's speed of the model's GGUF export (a matrix's eval speed-llama-cpp): columns only where measured.
LLAMA_CPP_SPEED = (Metric("llama_cpp_prefill_tokens_per_s", "llama.cpp (CPU) prefill tok/s", "higher", decimals=0,
                          style="grouped"),
                   Metric("llama_cpp_decode_tokens_per_s", "llama.cpp (CPU) decode tok/s", "higher", decimals=0,
                          style="grouped"))
MEASURED_ONLY = frozenset(m.key for m in (*PHASE_METRICS, *LLAMA_CPP_SPEED))  # columns shown where a run has them
METRICS = {m.key: m for m in (PPL, *(Metric(k, h, "higher") for k, h in TASK_HEADERS.items()), MEAN, *EFFICIENCY,
                                 *LLAMA_CPP_SPEED)}


def ppl_of(profile: str) -> Extract:
    """The perplexity of one profile from a record."""
    def extract(record: Record) -> float | None:
        return record.ppl(profile)
    return extract


def accuracy_of(task: str, metric: str) -> Extract:
    """A zero-shot accuracy in percent from a record."""
    def extract(record: Record) -> float | None:
        value = task_scores(record).get(task, {}).get(metric)
        return None if value is None else 100 * value
    return extract


def task_scores(record: Record) -> dict[str, dict[str, Any]]:
    """A record's zero-shot scores, ``{task: {acc, acc_norm, ...}}`` (fractions), also when nested under ``tasks``
    as ``rcpu_bench.evaluation.zeroshot.evaluate_zeroshot`` returns them; empty when the run had no zero-shot."""
    result = record.zeroshot or {}
    return result.get("tasks", result)


def mean_of(extracts: Sequence[Extract]) -> Extract:
    """The mean of several values of a record, None unless all are there."""
    def extract(record: Record) -> float | None:
        values = [get(record) for get in extracts]
        return None if any(v is None for v in values) else fmean(values)
    return extract


def zeroshot_metrics(metric_map: str) -> tuple[tuple[Metric, Extract], ...]:
    """The seven task columns under a named metric map, then their mean."""
    if metric_map not in METRIC_MAPS:
        raise ValueError(f"unknown metric map {metric_map!r}; allowed: {', '.join(METRIC_MAPS)}")
    tasks = [(METRICS[task], accuracy_of(task, metric)) for task, metric in METRIC_MAPS[metric_map].items()]
    return (*tasks, (MEAN, mean_of([extract for _, extract in tasks])))


def params(record: Record) -> float:
    """Parameters of the pruned model."""
    return record.parameters.after


def model_size_mib(record: Record) -> float | None:
    """The pruned model's weights in MiB, as the paper's "Memory size": parameters × bytes per parameter of the
    run's dtype / 2²⁰ (6,738,415,616 × 4 B = 25,705 MiB for Llama-7B in float32). None without a recorded dtype."""
    dtype = record.experiment.get("dtype")
    if dtype is None:
        return None
    if dtype not in BYTES_PER_PARAMETER:
        raise ValueError(f"no parameter size for dtype {dtype!r}; known: {', '.join(BYTES_PER_PARAMETER)}")
    return params(record) * BYTES_PER_PARAMETER[dtype] / 2**20


def peak_memory_mib(record: Record) -> float:
    return record.peak_memory_bytes / 2**20


def seconds_per_layer(record: Record) -> float | None:
    """Pruning seconds per layer: Σ prune phases / number of layers."""
    timing = record.timing
    return sum(timing.prune_seconds.values()) / len(timing.layers) if timing.layers else None


def phase_per_layer(phase: str) -> Extract:
    """Seconds of one pruning phase per layer: the run's seconds in it (Σ over layers for a phase of the layer loop)
    / number of layers; None when the run did not time it or has no layers (a whole-model method)."""
    def extract(record: Record) -> float | None:
        layers, seconds = record.timing.layers, record.timing.prune_seconds
        return seconds[phase] / len(layers) if layers and phase in seconds else None
    return extract


def device_name(record: Record) -> str | None:
    """The GPU or CPU model the run was measured on (records before rcpu_bench.records.environment: the
    device)."""
    return (record.environment or {}).get("device_name") or record.experiment.get("device")


def inference(key: str) -> Extract:
    """A generation throughput of the pruned model (``Record.inference``), None when it was not measured."""
    return lambda record: (record.inference or {}).get(key)


def llama_cpp_inference(key: str) -> Extract:
    """A throughput of the pruned model's GGUF export in llama.cpp (``Record.inference_llama_cpp``), None when it
    was not measured."""
    return lambda record: (record.inference_llama_cpp or {}).get(key)


EFFICIENCY_EXTRACTS = (params, model_size_mib, peak_memory_mib, seconds_per_layer, *map(phase_per_layer, PHASES),
                       device_name, inference("prefill_tokens_per_s"), inference("decode_tokens_per_s"))
LLAMA_CPP_SPEED_EXTRACTS = (llama_cpp_inference("prefill_tokens_per_s"), llama_cpp_inference("decode_tokens_per_s"))


def _profiles(results: Sequence[StoredResult]) -> list[str]:
    return list(dict.fromkeys(p.profile for result in results for p in result.record.perplexity))


def default_profile(results: Sequence[StoredResult]) -> str:
    """The profile shown unless one is asked for: the paper's (rcpu128) when a result has it, else the store's one
    window range of it (``rcpu128[START:STOP]``, the smoke matrix's subset), else the first profile recorded. Where
    some results have per-window values (written since they were kept), only their profiles count: a store mixing
    today's records with older ones shows today's profile."""
    windowed = [p.profile for result in results for p in result.record.perplexity if p.window_nll is not None]
    found = list(dict.fromkeys(windowed)) or _profiles(results)
    if not found or PAPER_PROFILE in found:
        return PAPER_PROFILE
    subsets = [name for name in found if name.startswith(f"{PAPER_PROFILE}[")]
    return subsets[0] if len(subsets) == 1 else found[0]


def without_profile(results: Sequence[StoredResult], profile: str) -> tuple[int, list[str]]:
    """How many results with perplexities have none under ``profile``, and the profiles they have instead."""
    others = [result for result in results
              if result.record.perplexity and all(p.profile != profile for p in result.record.perplexity)]
    return len(others), _profiles(others)


def check_profile(results: Sequence[StoredResult], profile: str) -> None:
    """Refuse a perplexity profile that no result has while others have perplexities."""
    found = sorted(_profiles(results))
    if found and profile not in found:
        raise ValueError(f"no entry has perplexity profile {profile!r}; profiles in the store: {', '.join(found)}")
