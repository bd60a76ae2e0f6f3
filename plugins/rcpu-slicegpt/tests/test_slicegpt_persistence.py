"""Saving and reloading sliced models: same logits, built from the directory alone, loaded strictly."""

import json

import pytest
import torch
from slicegpt_helpers import copy_of

from rcpu_bench.model.loading import parameter_count
from rcpu_slicegpt import load_sliced, save_sliced, slice_model
from rcpu_slicegpt.persistence import SLICING_CONFIG


@pytest.fixture(params=[("stories260K", False), ("stories260K-mha", True)], ids=["gqa", "mha-sliced-head"])
def saved(request, stories, calib_ids, tmp_path):
    """A sliced stories model (30 %) and the directory it was saved to."""
    name, slice_head = request.param
    model = copy_of(stories[name].model)
    report = slice_model(model, calib_ids, sparsity=0.3, slice_head=slice_head)
    save_sliced(model, tmp_path / "sliced", tokenizer=stories[name].tokenizer, report=report)
    return model, tmp_path / "sliced"


def test_round_trip_gives_identical_logits_and_generation(saved, calib_ids):
    model, directory = saved
    loaded = load_sliced(directory)
    assert torch.equal(loaded.model(calib_ids[:4]).logits, model(calib_ids[:4]).logits)
    assert parameter_count(loaded.model) == parameter_count(model)
    prompt = loaded.tokenizer("Once upon a time", return_tensors="pt").input_ids
    settings = {"max_new_tokens": 12, "do_sample": False, "pad_token_id": model.config.eos_token_id}
    assert torch.equal(loaded.model.generate(prompt, **settings), model.generate(prompt, **settings))


def test_saved_directory_holds_the_dense_config_and_per_layer_dims(saved):
    model, directory = saved
    config = json.loads((directory / "config.json").read_text())
    assert config["hidden_size"] == 64 and config["tie_word_embeddings"] is False
    slicing = json.loads((directory / SLICING_CONFIG).read_text())
    assert [layer["attn_in"] for layer in slicing["layers"]] == [40] * 5
    assert slicing["parameter_count"] == parameter_count(model)
    assert slicing["report"]["sliced_hidden_size"] == 40


def test_a_slicing_config_that_does_not_fit_the_weights_fails_strictly(saved):
    _, directory = saved
    path = directory / SLICING_CONFIG
    slicing = json.loads(path.read_text())
    slicing["layers"][2]["mlp_in"] = 48
    path.write_text(json.dumps(slicing))
    with pytest.raises(RuntimeError, match="size mismatch|shape"):
        load_sliced(directory)


def test_save_refuses_a_dense_model_and_an_existing_directory(saved, stories, tmp_path):
    model, directory = saved
    with pytest.raises(ValueError, match="not sliced"):
        save_sliced(stories["stories260K"].model, tmp_path / "dense")
    with pytest.raises(FileExistsError):
        save_sliced(model, directory)
    with pytest.raises(FileNotFoundError, match=SLICING_CONFIG):
        load_sliced(tmp_path)


def test_save_is_atomic_through_the_shared_writer(saved, tmp_path):
    model, _ = saved

    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_sliced(model, tmp_path / "broken", tokenizer=BrokenTokenizer())
    assert not (tmp_path / "broken").exists() and not list(tmp_path.glob(".broken.*"))
    save_sliced(model, tmp_path / "sliced", overwrite=True)  # replaces the fixture's directory whole
    assert not (tmp_path / "sliced" / "tokenizer_config.json").exists()
