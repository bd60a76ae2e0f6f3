"""The registered whole-model method and the choice between the reference package and this implementation."""

import importlib.metadata

import pytest
from packaging.requirements import Requirement
from slicegpt_helpers import copy_of

from rcpu_bench.model.loading import parameter_count
from rcpu_bench.plugins import default_registry
from rcpu_slicegpt import reference


def test_registered_method_is_visible_with_its_parameters():
    method = default_registry().get("model-method", "slicegpt")
    assert method.provider.startswith("slicegpt (rcpu-slicegpt")
    assert {"ratio", "budget", "round_to", "batch_size", "slice_head", "center_embeddings"} == set(method.params)
    assert method.params["budget"] == "hidden"


def test_hidden_budget_slices_the_hidden_fraction(stories, calib_ids):
    model = copy_of(stories["stories260K-mha"].model)
    report = default_registry().get("model-method", "slicegpt")(model, calib_ids, ratio=0.2)
    assert report["sliced_hidden_size"] == 48 and report["implementation"] == "rcpu-slicegpt"
    assert "import slicegpt fails" in report["implementation_reason"]


@pytest.mark.parametrize("ratio", [0.1, 0.2])
def test_params_budget_removes_at_least_that_fraction_of_the_dense_parameters(stories, calib_ids, ratio):
    model = copy_of(stories["stories260K-mha"].model)
    dense = parameter_count(model)
    report = default_registry().get("model-method", "slicegpt")(model, calib_ids, ratio=ratio, budget="params")
    assert report["request"]["target_params"] == int((1 - ratio) * dense)
    assert parameter_count(model) <= (1 - ratio) * dense
    assert report["parameters"]["removed_fraction"] >= ratio


def test_bad_budget_is_rejected(stories, calib_ids):
    method = default_registry().get("model-method", "slicegpt")
    with pytest.raises(ValueError, match="budget"):
        method(copy_of(stories["stories260K"].model), calib_ids, ratio=0.2, budget="flops")
    with pytest.raises(ValueError, match="ratio"):
        method(copy_of(stories["stories260K"].model), calib_ids, ratio=1.0, budget="params")


def test_reference_is_not_chosen_here():
    usable, reason = reference.reference_status()
    assert not usable and "import slicegpt fails" in reason


def test_reference_decision_reads_the_declared_transformers_requirement(monkeypatch):
    """This package's own distribution declares transformers>=4.48, which the installed version meets."""
    assert reference.reference_status("rcpu_slicegpt")[0]
    monkeypatch.setattr(reference, "_transformers_requirement", lambda module: Requirement("transformers==4.41.0"))
    usable, reason = reference.reference_status("rcpu_slicegpt")
    assert not usable and "4.41.0" in reason and importlib.metadata.version("transformers") in reason
