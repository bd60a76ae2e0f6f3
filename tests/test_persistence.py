"""save_pruned / load_pruned: round trips, the manifest, atomic writes and corrupt directories. (Loading through
stock transformers / lm-eval: test_hf_format.py; directories of earlier formats: test_migrate.py.)"""

import json
import os

import pytest
import torch
from safetensors import safe_open
from tiny_models import STORIES, apply_plan, logits, needs_stories, random_plan, tiny_config, tiny_model, tokens

from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import load_model, parameter_count
from rcpu_bench.model.manifest import MANIFEST, read_manifest
from rcpu_bench.model.persistence import load_pruned, load_saved, save_pruned
from rcpu_bench.plugins import default_registry

REMOTE_CODE_FILES = ["README.md", "config.json", "configuration_rcpu_pruned.py", "model.safetensors",
                     "modeling_rcpu_pruned.py", MANIFEST]


def pruned_tiny(tie=True, rule="groups"):
    model = tiny_model(tiny_config(tie=tie), attn="sdpa")
    return apply_plan(model, random_plan(model, rule=rule, bias=True, seed=11))


def leftovers(parent, name):
    return [p.name for p in parent.iterdir() if p.name != name]


@pytest.mark.parametrize("tie, rule", [(True, "groups"), (False, "within")])
def test_round_trip_gives_identical_logits_and_counts(tmp_path, tie, rule):
    model = pruned_tiny(tie, rule)
    manifest = save_pruned(model, tmp_path / "pruned", method={"scorer": "variance", "ratio": 0.2})
    assert sorted(p.name for p in (tmp_path / "pruned").iterdir()) == REMOTE_CODE_FILES
    loaded = load_pruned(tmp_path / "pruned")
    ids = tokens(model.config.vocab_size)
    assert torch.equal(logits(loaded.model, ids), logits(model, ids))
    assert manifest["parameter_count"] == parameter_count(model) == parameter_count(loaded.model)
    assert loaded.provenance["parameter_count"] == parameter_count(model)
    assert layer_geometries(loaded.model) == layer_geometries(model)
    assert (loaded.model.lm_head.weight is loaded.model.model.embed_tokens.weight) == tie
    with safe_open(tmp_path / "pruned" / "model.safetensors", "pt") as weights:  # as transformers 4 needs it
        assert "model.embed_tokens.weight" in weights.keys() and ("lm_head.weight" in weights.keys()) != tie
    assert loaded.tokenizer is None and not loaded.model.training
    assert loaded.provenance["method"] == {"scorer": "variance", "ratio": 0.2}
    assert read_manifest(tmp_path / "pruned") == manifest
    assert leftovers(tmp_path, "pruned") == []


def test_manifest_records_each_layer(tmp_path):
    model = pruned_tiny()
    manifest = save_pruned(model, tmp_path / "m")
    assert manifest["format_version"] == 4 and manifest["config"] == "per_layer" and len(manifest["layers"]) == 3
    for record, geo, layer in zip(manifest["layers"], layer_geometries(model), model.model.layers):
        assert (record["n_heads"], record["n_kv_heads"], record["intermediate"]) == (geo.n_heads, geo.n_kv_heads,
                                                                                     geo.intermediate)
        assert record["n_heads"] * 6 == layer.self_attn.o_proj.in_features
        assert record["o_proj_bias"] and record["down_proj_bias"]
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    base = config["base_config"]  # the family's config, unpruned counts, explicit head_dim
    assert (base["model_type"], base["num_attention_heads"], base["intermediate_size"], base["head_dim"]) == (
        "llama", 6, 20, 6)
    heads = [layer.self_attn.q_proj.out_features // 6 for layer in model.model.layers]
    assert config["layer_num_attention_heads"] == heads
    assert config["layer_intermediate_sizes"] == [layer.mlp.gate_proj.out_features for layer in model.model.layers]
    assert config["layer_added_biases"] == [["mlp.down_proj", "self_attn.o_proj"]] * 3


def test_load_pruned_in_float64(tmp_path):
    model = pruned_tiny()
    save_pruned(model, tmp_path / "m")
    loaded = load_pruned(tmp_path / "m", dtype="float64").model
    assert {p.dtype for p in loaded.parameters()} == {torch.float64}
    ids = tokens(61)
    torch.testing.assert_close(logits(loaded, ids).float(), logits(model, ids), atol=1e-5, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_load_pruned_onto_cuda(tmp_path):
    model = pruned_tiny()
    save_pruned(model, tmp_path / "m")
    loaded = load_pruned(tmp_path / "m", device="cuda").model
    assert {t.device.type for t in [*loaded.parameters(), *loaded.buffers()]} == {"cuda"}
    ids = tokens(61)
    torch.testing.assert_close(logits(loaded, ids.to("cuda")).cpu(), logits(model, ids), atol=1e-5, rtol=0)


@needs_stories
def test_stories_round_trip_with_tokenizer_and_provenance(tmp_path):
    source = load_model(str(STORIES))
    model = apply_plan(source.model, random_plan(source.model, rule="within", seed=2))
    manifest = save_pruned(model, tmp_path / "s", tokenizer=source.tokenizer, provenance=source.provenance)
    assert manifest["provenance"]["name_or_path"] == str(STORIES)
    loaded = load_pruned(tmp_path / "s")
    ids = torch.tensor([loaded.tokenizer("Once upon a time there was").input_ids])
    assert torch.equal(logits(loaded.model, ids), logits(model, ids))
    assert loaded.provenance["source"]["name_or_path"] == str(STORIES)


# --- failures -----------------------------------------------------------------------------------

def test_missing_manifest_and_unknown_version(tmp_path):
    with pytest.raises(FileNotFoundError, match="rcpu_manifest.json not found"):
        load_pruned(tmp_path)
    save_pruned(pruned_tiny(), tmp_path / "m")
    path = tmp_path / "m" / MANIFEST
    manifest = json.loads(path.read_text())
    path.write_text(json.dumps({**manifest, "format_version": 99}))
    with pytest.raises(ValueError, match="version 99; supported: 'rcpu-bench-pruned' version 4"):
        load_pruned(tmp_path / "m")


def test_interrupted_save_leaves_nothing(tmp_path):
    class BrokenTokenizer:
        def save_pretrained(self, directory):
            assert (directory / "model.safetensors").is_file()  # the weights were already written
            raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        save_pruned(pruned_tiny(), tmp_path / "m", tokenizer=BrokenTokenizer())
    assert list(tmp_path.iterdir()) == []


def test_existing_directory_needs_overwrite(tmp_path):
    first, second = pruned_tiny(rule="groups"), pruned_tiny(rule="within")
    save_pruned(first, tmp_path / "m")
    with pytest.raises(FileExistsError, match=r"already exists and is kept as it is; allowed: a new path or an empty "
                                              r"directory \(overwrite=True replaces it\)"):
        save_pruned(second, tmp_path / "m")
    save_pruned(second, tmp_path / "m", overwrite=True)
    assert layer_geometries(load_pruned(tmp_path / "m").model) == layer_geometries(second)
    assert leftovers(tmp_path, "m") == []


def test_existing_empty_directory_is_filled(tmp_path):
    """Regression: --save into an existing empty directory passed validation, then failed after all the work."""
    model = pruned_tiny()
    (tmp_path / "m").mkdir()
    save_pruned(model, tmp_path / "m")
    assert layer_geometries(load_pruned(tmp_path / "m").model) == layer_geometries(model)
    assert leftovers(tmp_path, "m") == []


def test_non_json_method_fails_before_writing(tmp_path):
    with pytest.raises(TypeError, match="not JSON serializable"):
        save_pruned(pruned_tiny(), tmp_path / "m", method={"dtype": torch.float32})
    assert list(tmp_path.iterdir()) == []


# --- integrity: checksums, a confined weights file, no staging left behind -----------------------

def _zero_tensor_bytes(path):
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = bytes(len(data) - header)
    path.write_bytes(bytes(data))


def _random_tensor_bytes(path):
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    data[header:] = torch.randint(0, 256, (len(data) - header,), generator=torch.Generator().manual_seed(0),
                                  dtype=torch.uint8).numpy().tobytes()
    path.write_bytes(bytes(data))


def _flip_one_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("corrupt", [_zero_tensor_bytes, _random_tensor_bytes, _flip_one_byte,
                                     lambda path: path.write_bytes(bytes(path.stat().st_size))])
def test_corrupted_weights_are_refused_by_their_checksum(tmp_path, corrupt):
    save_pruned(pruned_tiny(), tmp_path / "m")
    corrupt(tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors is corrupted or was replaced: its sha256 is [0-9a-f]{64}"):
        load_pruned(tmp_path / "m")


def test_the_manifest_records_the_weights_and_config_sha256(tmp_path):
    import hashlib

    manifest = save_pruned(pruned_tiny(), tmp_path / "m")
    digests = {name: hashlib.sha256((tmp_path / "m" / name).read_bytes()).hexdigest()
               for name in ("model.safetensors", "config.json")}
    assert manifest["sha256"] == digests == read_manifest(tmp_path / "m")["sha256"]


def test_another_models_weights_are_refused(tmp_path):
    save_pruned(pruned_tiny(rule="groups"), tmp_path / "a")
    save_pruned(pruned_tiny(rule="groups"), tmp_path / "b")
    other = tiny_model(tiny_config(), seed=5, attn="sdpa")
    save_pruned(apply_plan(other, random_plan(other, rule="groups", bias=True, seed=11)), tmp_path / "c")
    (tmp_path / "c" / "model.safetensors").replace(tmp_path / "a" / "model.safetensors")
    with pytest.raises(ValueError, match="is corrupted or was replaced"):
        load_pruned(tmp_path / "a")


@pytest.mark.parametrize(("weights", "message"), [
    ("../b/model.safetensors", "allowed: the name of a .safetensors file inside"),
    ("ABSOLUTE", "allowed: the name of a .safetensors file inside"),
    ("", "allowed: the name of a .safetensors file inside"),
    (7, "allowed: the name of a .safetensors file inside"),
    ("config.json", "weights 'config.json' is not allowed; allowed: the name of a .safetensors file inside"),
    ("other.safetensors", "sha256 records no checksum for the weights file 'other.safetensors'"),
])
def test_the_manifest_weights_cannot_point_elsewhere(tmp_path, weights, message):
    save_pruned(pruned_tiny(), tmp_path / "a")
    save_pruned(pruned_tiny(), tmp_path / "b")
    (tmp_path / "a" / "other.safetensors").write_bytes((tmp_path / "b" / "model.safetensors").read_bytes())
    path = tmp_path / "a" / MANIFEST
    weights = str(tmp_path / "b" / "model.safetensors") if weights == "ABSOLUTE" else weights
    path.write_text(json.dumps({**json.loads(path.read_text()), "weights": weights}))
    with pytest.raises(ValueError, match=message):
        load_pruned(tmp_path / "a")


@pytest.mark.slow  # a fresh interpreter importing torch and transformers: seconds
def test_a_killed_save_leaves_staging_that_the_next_save_removes(tmp_path):
    """A process killed mid-save (os._exit: no except, no finally) cannot clean up; the next save does."""
    import subprocess
    import sys

    script = ("import os, sys\nfrom pathlib import Path\nfrom rcpu_bench.atomic_file import write_atomically\n"
              "def write(staging):\n    (staging / 'model.safetensors').write_bytes(bytes(1000))\n    os._exit(9)\n"
              "write_atomically(Path(sys.argv[1]), write)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], capture_output=True, check=False)
    assert done.returncode == 9
    stale = leftovers(tmp_path, "m")
    assert len(stale) == 1 and stale[0].startswith(".m.") and stale[0].endswith(".partial")
    live = tmp_path / f".m.{os.getpid()}.x.partial"  # a save in progress in a live process is left alone
    live.mkdir()
    save_pruned(pruned_tiny(), tmp_path / "m")
    assert leftovers(tmp_path, "m") == [live.name]
    assert (tmp_path / "m" / "model.safetensors").is_file()


def test_a_model_method_save_is_loaded_through_the_registry_given(tmp_path):
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "rcpu-slice", "model_method": "slice"}))
    with pytest.raises(ValueError, match="model method 'slice': pass the registry"):
        load_saved(tmp_path)
    with pytest.raises(ValueError, match="slice"):  # the built-ins hold no such method: the lookup names it
        load_saved(tmp_path, registry=default_registry())
