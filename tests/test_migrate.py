"""``rcpu-bench migrate``: stores and saved pruned models of earlier releases brought to today's format, which every
reader alone reads; an earlier one is refused, naming the command."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_model
from test_tables import PRUNE_DEFAULTS
from test_tables import entry as table_entry
from tiny_models import apply_plan, logits, needs_stories, random_plan, tiny_config, tiny_model, tokens

from rcpu_bench.commands import main
from rcpu_bench.matrix.cells import cell_id, expand_shared
from rcpu_bench.matrix.migrate import migrate_entry, migrate_store
from rcpu_bench.matrix.store import Entry, Store, make_entry, read_results
from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.manifest import MANIFEST, read_manifest
from rcpu_bench.model.migrate import migrate_saved
from rcpu_bench.model.persistence import load_pruned, save_pruned
from rcpu_bench.paths import shared_dir
from rcpu_bench.records import library_versions, read_records

RESULTS = Path(__file__).resolve().parent.parent / "results"
ADDED_OPTIONS = ("gram_precision", "model_method", "model_method_params", "allocation", "allocation_params",
                 "holdout", "round_to")


def earlier_entry(ratio: float = 0.1, lam: float = 1.0) -> dict:
    """A store entry as the first releases wrote it: ρ and λ copied beside the cell's prune, no skip or
    zeroshot_limit, the options added later absent, no schema version, experiment fields added later absent, no
    fingerprint."""
    today = table_entry("ls-best", ratio, 14.0, lam=lam)
    cell, record = dict(today["cell"]), dict(today["record"])
    prune = {k: v for k, v in cell["prune"].items() if k not in ADDED_OPTIONS}
    del cell["skip"], cell["zeroshot_limit"], record["schema_version"]
    cell.update(prune=prune, ratio=ratio, lam=lam)
    record.update(experiment={**record["experiment"], "prune": prune},
                  calibration={"source": "wikitext2", "sha256": "cd" * 32})
    return {**today, "cell": cell, "record": record, "cell_id": cell_id(cell)}


def write_store(directory: Path, lines: list[dict]) -> Path:
    directory.mkdir(exist_ok=True)
    (directory / "records.jsonl").write_text("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
    return directory


def test_an_earlier_entry_becomes_todays_with_its_id_and_nothing_else_changed():
    old = earlier_entry()
    new = migrate_entry(old)
    assert new["cell_id"] == old["cell_id"] == cell_id(new["cell"])
    assert "ratio" not in new["cell"] and "lam" not in new["cell"]
    assert new["cell"]["prune"] == new["record"]["experiment"]["prune"] == {**PRUNE_DEFAULTS, "ratio": 0.1,
                                                                           "compensator": "ridge",
                                                                           "compensator_params": {"lam": 1.0}}
    assert (new["cell"]["skip"], new["cell"]["zeroshot_limit"]) == ([], None)
    assert new["record"]["schema_version"] == 1 and new["record"]["experiment"]["skip"] == []
    assert new["record"]["experiment"]["trust_remote_code"] is False
    assert new["fingerprint"] == {"calibration": "cd" * 32}  # what the record knew; the model was never hashed
    assert {k: v for k, v in new["record"].items() if k not in ("experiment", "schema_version")} == {
        k: v for k, v in old["record"].items() if k != "experiment"}
    assert Entry.from_json(new).to_json() == new and migrate_entry(new) == new


def test_copies_of_ratio_or_lambda_that_disagree_with_prune_are_refused():
    old = earlier_entry()
    old["cell"]["lam"] = 5.0
    with pytest.raises(ValueError, match=r"its cell's lam 5.0 disagrees with prune.compensator_params.lam 1.0"):
        migrate_entry(old)


def test_readers_refuse_an_earlier_store_naming_the_command_and_read_it_once_migrated(tmp_path, capsys):
    store = write_store(tmp_path / "store", [earlier_entry(0.1), earlier_entry(0.2), {"not": "an entry"}])
    with pytest.raises(ValueError, match=r"records.jsonl:1: entry .*: stored cell .* has no field zeroshot_limit, "
                                         r"skip; the field\(s\) lam, ratio: .*convert its store with `rcpu-bench "
                                         "migrate"):
        read_results(store)
    assert main(["tables", "--results", str(store), "--table", "ppl"]) == 2
    assert "rcpu-bench migrate" in capsys.readouterr().err
    assert main(["migrate", str(store), "--dry-run"]) == 0
    assert "2 of 2 entries would be brought to today's format" in capsys.readouterr().out
    assert json.loads((store / "records.jsonl").read_text().splitlines()[0]) == earlier_entry(0.1)  # untouched
    assert main(["migrate", str(store)]) == 0
    assert [r.ratio for r in read_results(store).results] == [0.1, 0.2]
    assert read_records(store / "records.jsonl")[2] == {"not": "an entry"}  # kept as it was
    assert migrate_store(store).changed == 0


def test_a_store_being_written_is_not_migrated(tmp_path):
    store = write_store(tmp_path / "store", [earlier_entry()])
    with Store(store).writing(), pytest.raises(OSError, match="being written by another run"):
        migrate_store(store)


@needs_stories
def test_paths_inside_the_shared_fixtures_are_stored_as_shared_and_others_as_given(tmp_path):
    """A finished cell's entry (what the store writes and the trackers log) and a migrated one."""
    fixtures = shared_dir()
    paths = {("experiment", "model"): fixtures / "models" / "stories260K",
             ("calibration", "origin"): fixtures / "data" / "tinystories" / "validation_first1000.jsonl",
             ("zeroshot", "data_dir"): fixtures / "data", ("model_provenance", "name_or_path"): tmp_path}
    entry = table_entry("ls-best", 0.1, 14.0, lam=1.0)
    entry["cell_id"] = cell_id(entry["cell"])
    for (part, key), path in paths.items():
        entry["record"][part] = {**(entry["record"].get(part) or {}), key: str(path)}
    parsed = Entry.from_json(entry)
    with Store(tmp_path / "store").writing() as append:
        append(make_entry(parsed.cell, seconds=1.0, record=parsed.record))
    for stored in (json.loads((tmp_path / "store" / "records.jsonl").read_text()), migrate_entry(entry)):
        written = {(part, key): stored["record"][part][key] for part, key in paths}
        assert written[("model_provenance", "name_or_path")] == str(tmp_path)  # outside the fixtures: as given
        del written[("model_provenance", "name_or_path")]
        assert all(value.startswith("${shared}/") for value in written.values())
        assert {k: Path(expand_shared(v)) for k, v in written.items()} == {k: paths[k] for k in written}


@pytest.mark.parametrize("store", sorted(RESULTS.glob("**/records.jsonl")), ids=lambda p: p.parent.name)
def test_every_committed_store_is_todays_format(store):
    assert migrate_store(store.parent, dry_run=True).changed == 0


# --- saved models ----------------------------------------------------------------------------------


def pruned_tiny(tie: bool = True, rule: str = "groups"):
    model = tiny_model(tiny_config(tie=tie), attn="sdpa")
    return apply_plan(model, random_plan(model, rule=rule, bias=True, seed=11))


def save_format_1(model, directory: Path) -> None:
    """A format-1 directory as its specification describes it: the original config, no checksums."""
    directory.mkdir()
    save_model(model, str(directory / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(directory)  # surgery leaves the config unpruned: the original one
    head_dim = model.config.head_dim
    layers = [{"n_heads": layer.self_attn.q_proj.out_features // head_dim,
               "n_kv_heads": layer.self_attn.k_proj.out_features // head_dim, "head_dim": head_dim,
               "intermediate": layer.mlp.up_proj.out_features, "o_proj_bias": layer.self_attn.o_proj.bias is not None,
               "down_proj_bias": layer.mlp.down_proj.bias is not None} for layer in model.model.layers]
    manifest = {"format": "rcpu-bench-pruned", "format_version": 1, "weights": "model.safetensors",
                "parameter_count": sum(p.numel() for p in model.parameters()), "layers": layers,
                "method": {"scorer": "variance"}, "provenance": {"name_or_path": "org/base"},
                "saved_with": library_versions()}
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2))


def save_format_2(model, directory: Path) -> None:
    """Format 2 wrote the Llama-only RcpuLlamaConfig: the Llama config flat, plus per-layer lists and bias flags,
    and recorded no checksum of config.json."""
    save_pruned(model, directory)
    for name in ("configuration_rcpu_pruned.py", "modeling_rcpu_pruned.py"):
        (directory / name).unlink()
    saved = json.loads((directory / "config.json").read_text())
    base = saved.pop("base_config")
    biases = saved.pop("layer_added_biases")
    format_2 = {**base, **saved, "model_type": "rcpu_llama", "architectures": ["RcpuLlamaForCausalLM"],
                "auto_map": {"AutoConfig": "configuration_rcpu_llama.RcpuLlamaConfig",
                             "AutoModelForCausalLM": "modeling_rcpu_llama.RcpuLlamaForCausalLM"},
                "layer_o_proj_bias": ["self_attn.o_proj" in names for names in biases],
                "layer_down_proj_bias": ["mlp.down_proj" in names for names in biases]}
    (directory / "config.json").write_text(json.dumps(format_2))
    manifest = json.loads((directory / MANIFEST).read_text())
    weights = {"model.safetensors": manifest["sha256"]["model.safetensors"]}
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format_version": 2, "config": "rcpu_llama",
                                                  "sha256": weights}))


def save_format_3(model, directory: Path) -> None:
    """Format 3: today's config, no checksum of config.json."""
    save_pruned(model, directory)
    manifest = json.loads((directory / MANIFEST).read_text())
    del manifest["sha256"]["config.json"]
    (directory / MANIFEST).write_text(json.dumps({**manifest, "format_version": 3}))


@pytest.mark.parametrize("version, save", [(1, save_format_1), (2, save_format_2), (3, save_format_3)])
@pytest.mark.parametrize("tie, rule", [(True, "groups"), (False, "within")])
def test_an_earlier_saved_model_is_refused_then_migrated_to_the_same_model(tmp_path, version, save, tie, rule):
    model = pruned_tiny(tie, rule)
    save(model, tmp_path / "m")
    with pytest.raises(ValueError, match=rf"saved by an earlier rcpu-bench \(format version {version}; this release "
                                         r"reads version 4\): convert it with `rcpu-bench migrate "):
        load_pruned(tmp_path / "m")
    assert migrate_saved(tmp_path / "m", dry_run=True) == version
    assert json.loads((tmp_path / "m" / MANIFEST).read_text())["format_version"] == version  # a dry run writes nothing
    assert migrate_saved(tmp_path / "m") == version
    loaded = load_pruned(tmp_path / "m")
    ids = tokens(model.config.vocab_size)
    assert torch.equal(logits(loaded.model, ids), logits(model, ids))
    assert layer_geometries(loaded.model) == layer_geometries(model)
    manifest = read_manifest(tmp_path / "m")
    assert manifest["format_version"] == 4 and set(manifest["sha256"]) == {"model.safetensors", "config.json"}
    before = {1: {"scorer": "variance"}}.get(version, {})
    assert manifest["method"] == before and migrate_saved(tmp_path / "m") is None
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # written in place, nothing left beside it


@pytest.mark.parametrize("edit, message", [
    (lambda m: m["layers"][0].update(n_heads=5), "layer 0 is .* but the config builds"),
    (lambda m: m["layers"][0].update(n_heads=3), "size mismatch for model.layers.0.self_attn.q_proj.weight"),
    (lambda m: m["layers"][1].update(intermediate=21), "layer 1 .* does not fit the config"),
    (lambda m: m["layers"].pop(), "describes 2 layers but the config has 3"),
    (lambda m: m.update(parameter_count=1), "rebuilt model has .* parameters; the manifest says 1"),
    (lambda m: m.update(config="gpt2"), "config 'gpt2'; allowed: original, llama, rcpu_llama, family, per_layer"),
])
def test_a_corrupt_earlier_directory_is_refused_and_left_as_it_was(tmp_path, edit, message):
    save_format_1(pruned_tiny(), tmp_path / "m")
    path = tmp_path / "m" / MANIFEST
    manifest = json.loads(path.read_text())
    edit(manifest)
    path.write_text(json.dumps(manifest))
    with pytest.raises((ValueError, RuntimeError), match=message):
        migrate_saved(tmp_path / "m")
    assert json.loads(path.read_text()) == manifest


def test_a_format_3_directory_whose_config_was_edited_is_caught_by_the_shapes_it_builds(tmp_path):
    save_format_3(pruned_tiny(), tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["layer_intermediate_sizes"][1] = 3
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="layer 1 is .* but the config builds"):
        migrate_saved(tmp_path / "m")


def test_the_command_checks_every_path_first(tmp_path, capsys):
    save_format_1(pruned_tiny(), tmp_path / "m")
    (tmp_path / "empty").mkdir()
    assert main(["migrate", str(tmp_path / "m"), str(tmp_path / "empty")]) == 2
    assert "is neither a results directory" in capsys.readouterr().err
    assert json.loads((tmp_path / "m" / MANIFEST).read_text())["format_version"] == 1
    assert main(["migrate", str(tmp_path / "m")]) == 0
    assert "format version 1 was brought to today's" in capsys.readouterr().out
