"""The held-out split end to end: disjoint windows, the pipeline's held-out errors against materialised
activations of the pruned model, the record, cell ids, and the generalisation tables and figures."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from registries import builtin_registry, with_plugins
from test_tables import entry as table_entry
from tiny_models import STORIES_MHA, needs_stories, tiny_config, tiny_model, tokens
from transformers import LlamaForCausalLM

from rcpu_bench import cli, data
from rcpu_bench.matrix.spec import Cell
from rcpu_bench.matrix.store import Entry, StoredResult
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.tables import generalisation
from rcpu_bench.tables.render import render


class WordIds:
    """A tokenizer for a text 'w0 w1 w2 …': token id = the word's number, so a window's ids are its positions."""

    name_or_path = "word-ids"

    def get_vocab(self) -> dict[str, int]:
        return {}

    def __call__(self, texts, verbose: bool = False):
        ids = lambda text: [int(w[1:]) if w[1:].isdigit() else -1 for w in text.split()]  # noqa: E731
        return {"input_ids": ids(texts) if isinstance(texts, str) else [ids(t) for t in texts]}


@pytest.mark.parametrize("n_calib", [1, 16, 64])
def test_holdout_windows_share_no_token_position_with_calibration_windows(tmp_path, n_calib):
    corpus = tmp_path / "positions.txt"
    corpus.write_text(" ".join(f"w{i}" for i in range(4000)), encoding="utf-8")
    spec = data.CalibSpec(f"file:{corpus}", n_calib, 32, seed=3)
    calib = data.calibration_data(spec, WordIds()).tokens
    held = data.holdout_windows(spec, WordIds(), 20)
    assert held.shape == (20, 32)
    assert (held[:, 1:] - held[:, :-1] == 1).all()  # contiguous windows of the stream
    assert not set(calib.flatten().tolist()) & set(held.flatten().tolist())


def test_holdout_windows_refuse_a_stream_without_room(tmp_path):
    corpus = tmp_path / "short.txt"
    corpus.write_text(" ".join(f"w{i}" for i in range(100)), encoding="utf-8")
    with pytest.raises(ValueError, match="than .* can give: 0 disjoint windows"):
        data.holdout_windows(data.CalibSpec(f"file:{corpus}", 8, 32), WordIds(), 4)
    with pytest.raises(ValueError, match="n_windows=0"):
        data.holdout_windows(data.CalibSpec(f"file:{corpus}", 8, 32), WordIds(), 0)


@pytest.mark.parametrize("fields", [{"holdout": -1}, {"holdout": 4, "recollect_mlp": True},
                                    {"holdout": 4, "model_method": "slicegpt"}])
def test_bad_holdout_settings_are_refused(fields):
    registry = with_plugins("rcpu_slicegpt.plugin") if "model_method" in fields else builtin_registry()
    with pytest.raises(ValueError, match="holdout="):
        PruneConfig(**fields).validate(registry)


def test_holdout_count_must_match_the_windows_given():
    with pytest.raises(ValueError, match="holdout=2 but 0 held-out windows"):
        prune_model(tiny_model(tiny_config()), torch.zeros(1, 4, dtype=torch.long), PruneConfig(holdout=2),
                    device="cpu", progress=False, registry=default_registry())


def test_cell_ids_do_not_change_unless_holdout_is_set():
    cell = Cell(matrix="m", model="x", model_label="x", revision=None, method="rcpu-rot", method_label="R", n_calib=8,
                seqlen=32, calib="tinystories:8x32:seed=0", prune=PruneConfig(ratio=0.2).to_dict(),
                ppl_profiles=("rcpu128",), eval=("ppl",), dtype="float32", device="cpu")
    old = replace(cell, prune={k: v for k, v in cell.prune.items() if k != "holdout"})
    assert cell.id == old.id
    assert replace(cell, prune={**cell.prune, "holdout": 4}).id != cell.id


def module_inputs(model, ids, layer: int) -> dict[str, torch.Tensor]:
    """X (N × d_in) of o_proj and down_proj of one layer from a plain forward pass, in float64."""
    captured: dict[str, list[torch.Tensor]] = {"attention": [], "mlp": []}
    block = model.model.layers[layer]
    handles = [proj.register_forward_pre_hook(lambda _m, a, n=name: captured[n].append(a[0]))
               for name, proj in (("attention", block.self_attn.o_proj), ("mlp", block.mlp.down_proj))]
    with torch.no_grad():
        model(ids, use_cache=False)
    for handle in handles:
        handle.remove()
    return {k: torch.cat(v).reshape(-1, v[0].shape[-1]).double() for k, v in captured.items()}


def explicit_error(w, x, new_w, kept) -> float:
    y = x @ w.T
    return float((y - x[:, kept] @ new_w.T).square().sum() / y.square().sum())


def kept_columns(pruned_units: list[int], n_units: int, unit: int) -> torch.Tensor:
    kept = [u for u in range(n_units) if u not in pruned_units]
    return (torch.tensor(kept)[:, None] * unit + torch.arange(unit)).reshape(-1)


@needs_stories
@pytest.mark.parametrize("compensator", [pytest.param("ridge", marks=pytest.mark.slow), "procrustes",
                                         pytest.param("none", marks=pytest.mark.slow)])
def test_held_out_errors_match_materialised_activations_of_the_pruned_model(compensator):
    """Layer 0 sees the held-out windows through the dense embeddings; layer 1 through the pruned layer 0."""
    dense = LlamaForCausalLM.from_pretrained(STORIES_MHA, dtype=torch.float32).eval()
    vocab = dense.config.vocab_size
    calib, held = tokens(vocab, batch=8, length=32, seed=1), tokens(vocab, batch=4, length=32, seed=2)
    model = copy.deepcopy(dense)
    params = {"lam": 1e-2} if compensator == "ridge" else {}
    report = prune_model(model, calib, PruneConfig(ratio=0.25, compensator=compensator, compensator_params=params,
                                                   holdout=4), holdout_ids=held, progress=False,
                                                   registry=default_registry())
    for layer in (0, 1):
        upstream = copy.deepcopy(dense)
        for index in range(layer):
            upstream.model.layers[index] = model.model.layers[index]
        for module, unit in (("attention", dense.config.head_dim), ("mlp", 1)):
            got, module_report = report.layers[layer][module]["generalisation"], report.layers[layer][module]
            block, pruned = model.model.layers[layer], dense.model.layers[layer]
            new_w = (block.self_attn.o_proj if module == "attention" else block.mlp.down_proj).weight.detach().double()
            w = (pruned.self_attn.o_proj if module == "attention" else pruned.mlp.down_proj).weight.detach().double()
            kept = kept_columns(module_report["pruned_units"], module_report["units_total"], unit)
            for key, ids in (("calibration_error", calib), ("holdout_error", held)):
                want = explicit_error(w, module_inputs(upstream, ids, layer)[module], new_w, kept)
                assert got[key] == pytest.approx(want, rel=2e-4, abs=1e-7), (layer, module, key)


@pytest.mark.slow
@needs_stories
def test_prune_cli_records_the_generalisation_summary(tmp_path):
    out = tmp_path / "r.jsonl"
    assert cli.main(["prune", "--model", str(STORIES_MHA), "--calib", "tinystories:4x32", "--holdout", "3",
                     "--compensator", "ridge", "--compensator-param", "lam=1", "--ppl", "tinystories[900:905]",
                     "--quiet", "--out", str(out)]) == 0
    record = json.loads(out.read_text().splitlines()[-1])
    summary = record["generalisation"]
    assert set(summary) == {"holdout_windows", "layers", "calibration_error_mean", "holdout_error_mean",
                            "degrees_of_freedom_total"}
    assert summary["holdout_windows"] == 3 and record["experiment"]["prune"]["holdout"] == 3
    modules = [(r["layer"], r["module"]) for r in summary["layers"]]
    assert modules == [(i, m) for i in range(5) for m in ("attention", "mlp")]
    assert summary["holdout_error_mean"] == pytest.approx(sum(r["holdout_error"] for r in summary["layers"]) / 10)
    assert summary["degrees_of_freedom_total"] == pytest.approx(sum(r["degrees_of_freedom"] for r in summary["layers"]))


def entry(label: str, n_calib: int, lam: float | None, calib_ppl: float, held: float,
          dof: float = 10.0) -> StoredResult:
    """A stored result with the fields the generalisation tables read."""
    layers = [{"layer": 0, "module": m, "calibration_error": held / 2, "holdout_error": held, "degrees_of_freedom": dof}
              for m in ("attention", "mlp")]
    compensator = "ridge" if lam is not None else "procrustes"
    prune = {**PruneConfig(ratio=0.2, compensator=compensator,
                           compensator_params={} if lam is None else {"lam": lam}).to_json(), "holdout": 4}
    stored = table_entry("custom", 0.2, label=label, n_calib=n_calib, prune=prune)
    stored["cell"]["model_label"] = "m"
    stored["record"].update(calibration_ppl=calib_ppl, generalisation={
        "holdout_windows": 4, "layers": layers, "calibration_error_mean": held / 2, "holdout_error_mean": held,
        "degrees_of_freedom_total": 2 * dof})
    return StoredResult.from_entry(Entry.from_json({**stored, "cell_id": f"{label}{n_calib}{lam}"}))


def test_tables_choose_lambda_by_each_rule_and_figures_are_written(tmp_path):
    entries = [entry("Prop.Score+LS (lambda_best)", 4, 1.0, calib_ppl=5.0, held=0.3),
               entry("Prop.Score+LS (lambda_best)", 4, 100.0, calib_ppl=6.0, held=0.1),
               entry("RCPU (Rot.)", 4, None, calib_ppl=7.0, held=0.2)]
    runs = generalisation.generalisation_runs(entries)[("m", 0.2)]
    assert runs["Prop.Score+LS (λ_best: calibration ppl)"][4] is entries[0]
    assert runs["Prop.Score+LS (λ_best: held-out error)"][4] is entries[1]
    assert set(runs) == {"Prop.Score+LS (λ=1e+00)", "Prop.Score+LS (λ=1e+02)", "RCPU (Rot.)",
                         "Prop.Score+LS (λ_best: calibration ppl)", "Prop.Score+LS (λ_best: held-out error)"}
    tables = generalisation.make_tables(entries)
    assert len(tables) == 3
    text = render(tables, "md")
    assert "0.1000" in text and "N_calib=4" in text
    paths = generalisation.write_plots(entries, tmp_path)
    names = sorted(p.name for p in paths)
    stems = ("holdout_error_per_layer_m_0.2_N4", "holdout_error_vs_ncalib_m_0.2")
    assert names == sorted(f"{stem}.{fmt}" for stem in stems for fmt in ("png", "pdf", "svg"))
    assert all(Path(p).stat().st_size > 0 for p in paths)
    without = replace(entries[2], record=replace(entries[2].record, generalisation=None))
    assert generalisation.make_tables([without]) == []
