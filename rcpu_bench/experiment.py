"""One pruning experiment end to end: load, calibrate, prune, evaluate, record (and optionally save).

The layer of "one run": ``rcpu-bench prune`` runs one :class:`Experiment`, a matrix (:mod:`rcpu_bench.matrix`)
runs one per cell; either way the result is a :class:`rcpu_bench.records.Record`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from rcpu_bench import data, experiment_options
from rcpu_bench.compensation import diagnostics
from rcpu_bench.evaluation import perplexity
from rcpu_bench.evaluation.generation import text_sample
from rcpu_bench.evaluation.speed import inference_speed
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import (
    LoadedModel,
    check_device,
    load_config,
    load_model,
    load_tokenizer,
    model_skeleton,
    model_source,
    parameter_count,
)
from rcpu_bench.model.manifest import check_saved_model
from rcpu_bench.model.persistence import save_pruned
from rcpu_bench.paths import check_new_dir, default_model
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import selection_units
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.records import LayerTiming, Parameters, Perplexity, Record, Timing, environment, library_versions
from rcpu_bench.registry import Registry

DEFAULT_CALIB = "tinystories:128x128"
DEFAULT_PPL_PROFILES = ("rcpu128",)
# Measurements a run may leave out of its record (the matrix key ``skip``): the perplexity on the calibration windows
# (the λ rule's input, so λ-grid cells keep it), the inference speed, and the greedy text sample.
SKIPPABLE = ("calibration-ppl", "speed", "sample")

log = logging.getLogger(__name__)


@dataclass
class Experiment:
    """What to prune and how to evaluate it; every field lands in the result record."""

    model: str = field(default_factory=default_model)
    prune: PruneConfig = field(default_factory=PruneConfig)
    calib: str = DEFAULT_CALIB
    ppl_profiles: tuple[str, ...] = DEFAULT_PPL_PROFILES
    revision: str | None = experiment_options.default("revision")
    trust_remote_code: bool = experiment_options.default("trust_remote_code")
    dtype: str = experiment_options.default("dtype")
    device: str = experiment_options.default("device")
    eval_batch_size: int = experiment_options.default("eval_batch_size")
    data_dir: str | None = None
    save_dir: str | None = None
    skip: tuple[str, ...] = ()  # of SKIPPABLE

    def validate(self, registry: Registry, *, here: bool = True) -> None:
        """Every check before the model is loaded: names and ranges, the device, the model's files (a saved
        directory against its manifest's checksums) and the budgets its shape decides (units per layer under the
        allocation, round_to, a depth method's layers), the calibration and held-out windows its tokenizer cuts from
        the source, the profiles' data and the --save destination. Each failure is a one-line ValueError or OSError
        naming the bad value. ``here=False`` (the experiment runs elsewhere, on a Ray worker) checks the device's
        name, not that it exists.
        """
        self.prune.validate(registry)
        unknown = [item for item in self.skip if item not in SKIPPABLE]
        if unknown:
            raise ValueError(f"skip {', '.join(map(repr, unknown))}: not a measurement a run can leave out; allowed: "
                             f"{', '.join(SKIPPABLE)}")
        for name in ("dtype", "device", "eval_batch_size"):
            experiment_options.BY_NAME[name].check(getattr(self, name))
        if here:
            check_device(self.device)
        check_saved_model(self.model)
        config, commit = load_config(self.model, self.revision,
                                     prune=() if self.prune.model_method else self.prune.prune,
                                     trust_remote_code=self.trust_remote_code)
        skeleton = model_skeleton(config, self.trust_remote_code)
        geometries = layer_geometries(skeleton)
        self.prune.check_budget(skeleton, registry)
        for module in self.prune.unpruned_modules(geometries):
            n, what = selection_units(geometries[0], module, self.prune.gqa_rule)
            log.warning(f"ratio={self.prune.ratio} prunes none of the {n} {what} of {module} in any layer "
                        f"(⌊ρ·n⌋ = 0, rounding={self.prune.rounding!r}): only the other modules are pruned")
        self._check_calibration(load_tokenizer(model_source(self.model), commit or self.revision,
                                               trust_remote_code=self.trust_remote_code),
                                config.max_position_embeddings)
        for profile in self.ppl_profiles:
            perplexity.profile_source(profile, self.data_dir)
        if self.save_dir:
            check_new_dir(self.save_dir, "--save directory")
        method = self.prune.model_method
        if self.save_dir and method and registry.get("model-method", method).save is None:
            raise ValueError(f"the model method {self.prune.model_method!r} registered no save function; drop --save")

    def _check_calibration(self, tokenizer: Any, max_positions: int) -> None:
        """Cut the calibration (and held-out) windows now, as the run will (they are cached): a source too short
        for the seqlen or the held-out count fails here, not after the model is loaded."""
        data.calibration_data(self.calib, tokenizer, data_dir=self.data_dir, max_positions=max_positions)
        if self.prune.holdout:
            data.holdout_windows(self.calib, tokenizer, self.prune.holdout, data_dir=self.data_dir)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_experiment(experiment: Experiment, *, registry: Registry | None = None, progress: bool = True,
                   load: Callable[..., LoadedModel] = load_model,
                   evaluate: Callable[[Any, Any], dict[str, Any]] | None = None,
                   reuse_capture: Callable[[Callable[[], Any]], Any] | None = None,
                   keep_record: Callable[[Record], None] | None = None) -> Record:
    """Run one experiment and return its result record.

    ``load`` (load_model's signature) supplies the dense model, which the run prunes in place, so it must
    return a model of its own: the matrix runner passes a cache that reads each model once and hands out copies.
    ``evaluate(model, tokenizer)`` evaluates the pruned model further; its fields join the record
    (:meth:`Record.add`: the matrix runner's zero-shot accuracy). ``reuse_capture`` goes to prune_model: the
    matrix runner's cache of layer-0 inputs (rcpu_bench.matrix.reuse). ``keep_record(record)`` is called with the
    finished record before the model is saved (prune's ``--out``), so a failing save loses no record.
    """
    registry = registry or default_registry()
    experiment.validate(registry)
    started = time.perf_counter()
    # With offloading the model stays in CPU memory and each layer visits the device while it is pruned.
    home = "cpu" if experiment.prune.offload else experiment.device
    loaded = load(experiment.model, dtype=experiment.dtype, device=home, revision=experiment.revision,
                  trust_remote_code=experiment.trust_remote_code)
    model, tokenizer = loaded.model, loaded.tokenizer
    calib = data.calibration_data(experiment.calib, tokenizer, data_dir=experiment.data_dir,
                                  max_positions=model.config.max_position_embeddings)
    holdout = experiment.prune.holdout
    holdout_ids = (data.holdout_windows(experiment.calib, tokenizer, holdout, data_dir=experiment.data_dir)
                   if holdout else None)
    params_before = parameter_count(model)
    # A saved model's card shows its perplexity beside the dense model's, measured here before pruning (not with
    # --offload: the dense model then does not fit the device whole).
    with_dense = experiment.save_dir and not experiment.prune.offload
    dense_ppl = tuple(Perplexity.from_json(perplexity.perplexity(
        model, tokenizer, profile, batch_size=experiment.eval_batch_size, data_dir=experiment.data_dir)).summary()
        for profile in experiment.ppl_profiles) if with_dense else None
    report = prune_model(model, calib.tokens, experiment.prune, registry=registry, device=experiment.device,
                         progress=progress, holdout_ids=holdout_ids, reuse_capture=reuse_capture,
                         validated=True, holdout_source=lambda n: data.holdout_windows(
                             experiment.calib, tokenizer, n, data_dir=experiment.data_dir))
    params_after = parameter_count(model)
    model.to(experiment.device)
    calib_nll, calib_targets = (perplexity.sequence_nll(model, list(calib.tokens),
                                                        batch_size=experiment.eval_batch_size, desc="ppl calibration")
                                if "calibration-ppl" not in experiment.skip else (None, None))
    ppl = tuple(Perplexity.from_json(perplexity.perplexity(model, tokenizer, profile,
                                                           batch_size=experiment.eval_batch_size,
                                                           data_dir=experiment.data_dir))
                for profile in experiment.ppl_profiles)
    record = Record(
        experiment=experiment.to_dict(),
        model_provenance=loaded.provenance,
        calibration=calib.provenance.as_dict(),
        versions=library_versions(),
        environment=environment(experiment.device),
        parameters=Parameters(params_before, params_after, 1 - params_after / params_before),
        perplexity=ppl,
        # On the calibration windows themselves: the paper's rule for choosing the ridge λ (appendix bestlam).
        calibration_ppl=math.exp(calib_nll / calib_targets) if calib_targets else None,
        timing=Timing(time.perf_counter() - started, report.seconds,
                      tuple(LayerTiming(layer["layer"], layer["seconds"]) for layer in report.layers)),
        layers=[{k: v for k, v in layer.items() if k != "seconds"} for layer in report.layers],
        peak_memory_bytes=report.peak_memory_bytes,
        # Inference speed beside the size, and greedy text to read before / after pruning.
        inference=inference_speed(model) if "speed" not in experiment.skip else None,
        sample=text_sample(model, tokenizer) if "sample" not in experiment.skip else None,
        generalisation=diagnostics.summary(report.layers, holdout) if holdout else None,
        method_report=report.method_report,
        dense_perplexity=dense_ppl,
    )
    if evaluate:
        record.add(evaluate(model, tokenizer))
    if keep_record:
        keep_record(record)
    if experiment.save_dir and experiment.prune.model_method:
        registry.get("model-method", experiment.prune.model_method).save(
            model, experiment.save_dir, tokenizer=tokenizer, report=report.method_report)
    elif experiment.save_dir:
        save_pruned(model, experiment.save_dir, tokenizer=tokenizer, method=experiment.prune.to_dict(),
                    provenance=loaded.provenance, record=record)
    return record
