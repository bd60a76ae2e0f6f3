"""SliceGPT through rcpu-bench itself: the experiment runner, its saver and the generic loader."""

from __future__ import annotations

import pytest

from rcpu_bench import PruneConfig, default_registry
from rcpu_bench.evaluation.perplexity import perplexity
from rcpu_bench.experiment import Experiment, run_experiment
from rcpu_bench.model.persistence import load_saved
from rcpu_bench.paths import shared_dir
from rcpu_bench.pruning.methods import label_of


@pytest.mark.slow
def test_experiment_slices_saves_and_reloads(tmp_path):
    config = PruneConfig(ratio=0.25, model_method="slicegpt")
    saved = tmp_path / "sliced"
    record = run_experiment(Experiment(model=str(shared_dir() / "models" / "stories260K-mha"), prune=config,
                                       calib="tinystories:16x64", ppl_profiles=("tinystories[900:930]",),
                                       save_dir=str(saved)), progress=False)
    assert record.method_report["budget"] == "hidden"
    assert record.parameters.after != record.parameters.before
    assert record.layers == []
    assert label_of(record.experiment["prune"]) == "SliceGPT"
    loaded = load_saved(saved, registry=default_registry())
    again = perplexity(loaded.model, loaded.tokenizer, "tinystories[900:930]")
    assert again["ppl"] == pytest.approx(record.perplexity[0].ppl, rel=1e-6)
