"""Benchmark matrices: validation errors that name the key or value, expansion counts, stable cell ids, overrides."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from registries import builtin_registry, with_plugins
from tiny_matrices import tiny_raw, write_matrix
from tiny_models import STORIES, needs_stories

from rcpu_bench.matrix import cells as matrix_cells
from rcpu_bench.matrix.runner import preflight
from rcpu_bench.matrix.spec import (
    COMPENSATE_VARIANTS,
    SHARED,
    MatrixError,
    apply_overrides,
    expand,
    load_matrix,
    parse_matrix,
    read_matrix,
    shipped_matrices,
)
from rcpu_bench.pruning import methods, options
from rcpu_bench.pruning.options import MODULES

REGISTRY = builtin_registry()
RIDGE_LAMS = [0.01, 1.0, 100.0]


def cells_of(raw):
    return expand(parse_matrix(raw), REGISTRY)


def reversed_keys(value):
    """The same value with every mapping's keys in reverse order."""
    if isinstance(value, dict):
        return {k: reversed_keys(value[k]) for k in reversed(list(value))}
    if isinstance(value, list):
        return [reversed_keys(v) for v in value]
    return value


def test_cells_are_models_by_calibration_sizes_by_methods_by_ratios_with_one_cell_per_lambda():
    raw = tiny_raw(["wanda-sp", "ls-best", {"name": "ridge-fixed", "scorer": "wanda-sp", "compensator": "ridge",
                                            "compensator_params": {"lam": 0.5}}],
                   models=[f"{SHARED}/models/stories260K", f"{SHARED}/models/stories260K-mha"],
                   ratios=[0.1, 0.3], calib={"source": "tinystories", "n_calib": [8, 16], "seqlen": 64},
                   lambdas=RIDGE_LAMS, include_dense=True)
    cells = cells_of(raw)
    assert len(cells) == 2 * (1 + 2 * 2 * (1 + len(RIDGE_LAMS) + 1))
    dense = [c for c in cells if c.method == "original"]
    assert [(c.model_label, c.ratio, c.prune["compensator"]) for c in dense] == [
        ("stories260K", 0.0, "none"), ("stories260K-mha", 0.0, "none")]
    ls = [c for c in cells if c.method == "ls-best"]
    assert sorted({c.lam for c in ls}) == RIDGE_LAMS and all(c.prune["compensator_params"] == {"lam": c.lam}
                                                              for c in ls)
    assert {c.lam for c in cells if c.method_label == "ridge-fixed"} == {0.5}
    assert {c.calib for c in cells} == {"tinystories:8x64:seed=0", "tinystories:16x64:seed=0"}
    assert len({c.id for c in cells}) == len(cells)


def test_skip_and_zeroshot_ratios_shape_what_each_cell_measures():
    raw = tiny_raw(["wanda-sp", "ls-best"], ratios=[0.1, 0.2], lambdas=[1.0, 100.0], include_dense=True,
                   eval=["ppl", "zeroshot"], zeroshot_ratios=[0.2], zeroshot_limit=5,
                   skip=["calibration-ppl", "speed", "sample"], calib={**tiny_raw([])["calib"], "bos": True})
    cells = cells_of(raw)
    evals = {(c.method, c.ratio, c.lam): c.eval for c in cells}
    assert evals[("original", 0.0, None)] == ("ppl", "zeroshot")  # the dense model always: every ratio's reference
    assert evals[("wanda-sp", 0.1, None)] == ("ppl",) and evals[("wanda-sp", 0.2, None)] == ("ppl", "zeroshot")
    assert all(c.zeroshot_limit == (5 if "zeroshot" in c.eval else None) for c in cells)
    skips = {(c.method, c.lam): c.skip for c in cells}
    assert skips[("wanda-sp", None)] == ("calibration-ppl", "speed", "sample")
    assert skips[("ls-best", 1.0)] == ("speed", "sample")  # the λ rule reads the calibration perplexity
    assert all(c.calib.endswith(":bos") and c.experiment().skip == c.skip for c in cells)
    plain = cells_of(tiny_raw(["wanda-sp"]))[0]
    without = {k: v for k, v in plain.to_json().items() if k != "skip"}  # a cell stored before the key existed
    assert plain.skip == () and matrix_cells.cell_id(without) == plain.id
    with pytest.raises(MatrixError, match="skip.*'timing'"):
        cells_of(tiny_raw(["wanda-sp"], skip=["timing"]))


def test_ablation_multiplies_the_methods_by_the_compensated_modules():
    cells = cells_of(tiny_raw(["rcpu-rot"], ratios=[0.1, 0.2, 0.3],
                              ablation={"compensate": list(COMPENSATE_VARIANTS)}))
    assert len(cells) == 12
    assert {tuple(c.prune["compensate"]) for c in cells} == set(COMPENSATE_VARIANTS.values())
    assert {c.method_name() for c in cells} == {"RCPU (Rot.)", "RCPU (Rot.) [compensate: none]",
                                                "RCPU (Rot.) [compensate: attention]",
                                                "RCPU (Rot.) [compensate: mlp]"}


def test_a_product_takes_every_registered_method_and_names_aliases_by_the_paper():
    cells = cells_of(tiny_raw([{"scorers": "all", "compensators": "all"}], lambdas=RIDGE_LAMS))
    per_scorer = sum(len(RIDGE_LAMS) if "lam" in c.params else 1 for c in REGISTRY.methods("compensator"))
    selections = len(REGISTRY.methods("scorer")) + len(REGISTRY.methods("selector"))  # "all": selectors too
    assert len(cells) == selections * per_scorer
    by_pair = {(c.prune["scorer"], c.prune["compensator"]): c for c in cells}
    assert (by_pair["variance", "procrustes"].method, by_pair["variance", "procrustes"].method_label) == (
        "rcpu-rot", "RCPU (Rot.)")
    assert by_pair["wanda-sp", "none"].method == "wanda-sp"
    custom = by_pair["magnitude", "flap-bias"]
    assert (custom.method, custom.method_label) == ("custom", "magnitude+flap-bias")
    assert {c.lam for c in cells if c.prune["compensator"] == "ridge"} == set(RIDGE_LAMS)


def test_cell_ids_ignore_key_order_matrix_name_labels_and_device():
    raw = tiny_raw(["rcpu-rot", {"name": "mine", "scorer": "wanda-sp", "compensator": "ridge",
                                 "scorer_params": {"variant": "paper"}, "compensator_params": {"lam": 1.0}}])
    ids = [c.id for c in cells_of(raw)]
    assert all(re.fullmatch(r"[0-9a-f]{16}", i) for i in ids)
    renamed = {**reversed_keys(raw), "name": "other", "device": "cuda"}
    renamed["models"] = [{"label": "another label", "model": raw["models"][0]["model"]}]
    renamed["methods"][1]["name"] = "renamed"
    assert [c.id for c in cells_of(renamed)] == ids


@pytest.mark.parametrize("change", [
    {"ratios": [0.3]}, {"calib": {**tiny_raw([])["calib"], "seed": 1}},
    {"calib": {**tiny_raw([])["calib"], "n_calib": [16]}}, {"models": [f"{SHARED}/models/stories260K"]},
    {"ppl_profiles": ["tinystories[900:930]"]}, {"dtype": "float64"}, {"prune": {"rounding": "ceil"}},
    {"methods": [{"name": "x", "scorer": "variance", "compensator": "procrustes",
                  "compensator_params": {"dtype": "float32"}}]},
])
def test_cell_ids_change_with_what_the_cell_computes(change):
    (base,) = cells_of(tiny_raw(["rcpu-rot"]))
    (changed,) = cells_of({**tiny_raw(["rcpu-rot"]), **change})
    assert changed.id != base.id


@needs_stories
def test_a_shared_model_path_is_written_portably_so_ids_match():
    (written,) = cells_of(tiny_raw(["rcpu-rot"], models=[f"{SHARED}/models/stories260K"]))
    (absolute,) = cells_of(tiny_raw(["rcpu-rot"], models=[str(STORIES)]))
    assert absolute.model == f"{SHARED}/models/stories260K" and absolute.id == written.id


@pytest.mark.parametrize("change, message", [
    ({"colour": "red"}, "unknown key 'colour'; allowed keys: name, models, methods, ratios"),
    ({"methods": ["rcpu-rott"]}, "methods[0]: 'rcpu-rott' is not allowed; allowed: wanda-sp, flap, ls-best"),
    ({"methods": ["original"]}, "include_dense: true"),
    ({"methods": [{"name": "x", "scorer": "variance", "compensator": "none", "lamda": 1}]},
     "unknown key 'lamda'; allowed keys: name, scorer, compensator, scorer_params, compensator_params"),
    ({"methods": [{"name": "x", "scorer": "variance"}]}, "missing key 'compensator'"),
    ({"methods": [{"scorers": ["variance"]}]}, "missing key 'compensators'"),
    ({"methods": [{"scorer": "variance", "compensator": "none"}]}, "is not a method; expected a recipe key"),
    ({"eval": ["ppl", "mmlu"]}, "eval[1]: 'mmlu' is not allowed; allowed: ppl, zeroshot"),
    ({"ratios": [1.0]}, "ratio 1.0 is outside (0, 1)"),
    ({"ratios": ["abc"]}, "ratios[0]: 'abc' is not a number"),
    ({"lambdas": [-1]}, "λ -1.0 must be >= 0"),
    ({"calib": {"sourse": "wikitext2"}}, "calib: unknown key 'sourse'; allowed keys: source, n_calib, seqlen, seed"),
    ({"calib": {"source": "c4"}}, "unknown calibration source 'c4'"),
    ({"calib": {"n_calib": [0]}}, "calib.n_calib[0]: 0 is not an integer >= 1"),
    ({"dtype": "int8"}, "dtype: unknown dtype 'int8'; allowed: float32"),
    ({"device": "gpu"}, "device: unknown device 'gpu'"),
    ({"dtype": 5}, "dtype: dtype=5 is not allowed; allowed: a non-empty string"),
    ({"eval_batch_size": 0}, "eval_batch_size: eval_batch_size=0 is not allowed; allowed: an integer >= 1"),
    ({"zeroshot_limit": True}, "zeroshot_limit: zeroshot_limit=True is not allowed; allowed: an integer >= 1"),
    ({"models": [{"model": "x", "revision": ""}]},
     "models[0].revision: revision='' is not allowed; allowed: a non-empty string"),
    ({"ppl_profiles": ["wikitext103"]}, "unknown perplexity profile 'wikitext103'; allowed: rcpu128"),
    ({"ablation": {"compensate": ["q_proj"]}}, "'q_proj' is not allowed; allowed: none, o_proj, down_proj, both"),
    ({"ablation": {"modules": ["none"]}}, "ablation: unknown key 'modules'; allowed keys: compensate"),
    ({"include_dense": "yes"}, "include_dense: 'yes' is not allowed; allowed: true, false"),
    ({"models": [{"path": "x"}]}, "models[0]: unknown key 'path'; allowed keys: model, label, revision"),
    ({"prune": {"prune": ["attn"]}},
     "prune.prune: prune=('attn',) has unknown module(s) ['attn']; allowed: a subset of attention, mlp"),
    ({"prune": {"ratio": 0.5}}, "prune: unknown key 'ratio'"),
    ({"methods": []}, "methods: expected a non-empty list"),
])
def test_bad_matrices_are_refused_naming_the_key_or_value_and_what_is_allowed(change, message):
    with pytest.raises(MatrixError) as error:
        parse_matrix({**tiny_raw(["rcpu-rot"]), **change})
    assert message in str(error.value)


@pytest.mark.parametrize("methods, message", [
    ([{"name": "x", "scorer": "variance", "compensator": "nope"}],
     "unknown compensator 'nope'; registered compensators: flap-bias, none"),
    ([{"scorers": ["nope"], "compensators": "all"}], "methods[0]: unknown scorer 'nope'; registered scorers"),
    ([{"name": "x", "scorer": "variance", "compensator": "procrustes", "compensator_params": {"alpha": 1}}],
     "has no parameter(s) alpha; allowed: dtype"),
    (["rcpu-rot", {"name": "mine", "scorer": "variance", "compensator": "procrustes"}],
     "compute the same thing"),
])
def test_methods_are_checked_against_the_registry(methods, message):
    with pytest.raises(MatrixError) as error:
        cells_of(tiny_raw(methods))
    assert message in str(error.value)


def test_every_shipped_matrix_validates_with_its_cell_count():
    registry = with_plugins("rcpu_slicegpt.plugin")  # the real-model matrices list SliceGPT
    counts = {name: len(expand(load_matrix(name), registry)) for name in shipped_matrices()}
    per_scorer = sum(13 if "lam" in c.params else 1 for c in REGISTRY.methods("compensator"))
    full = 1 + 3 * (len(REGISTRY.methods("scorer")) + len(REGISTRY.methods("selector"))) * per_scorer
    paper = 3 * 2 * 3 * (4 + 13) + 3  # 3 models × 2 N_calib × 3 ratios × (4 methods + 13 λ) + 3 dense
    ncalib = 9 * (7 + 2)  # 9 N_calib × (7 λ of ls-best + rcpu-rot + rcpu-rot-scale)
    # 3 selections × (4 compensators + 3 λ of ridge) × 4 allocations × 2 ratios × 2 N_calib, 2 depth methods × 2 × 2,
    # the dense model
    factorial = 3 * (4 + 3) * 4 * 2 * 2 + 2 * 2 * 2 + 1
    # real models: 10 methods (ls-best: 3 λ) × 3 ratios + dense; at 20 % only; Gemma without SliceGPT; the
    # allocations: 2 compensators × 4 allocations × 2 ratios + dense; the peers: 3 methods + dense; quick: 5 methods
    # + dense; zero-shot: 4 methods (ls-best: 3 λ) + dense; Qwen: 12 methods (2 of them ls-best: 3 λ) × 2 ratios + dense
    real = {"real-smollm2": 12 * 3 + 1, "real-smollm2-tinystories": 12 + 1, "real-gemma3": 11 * 3 + 1,
            "real-smollm2-allocation": 2 * 4 * 2 + 1, "real-smollm2-peers": 3 + 1, "quick": 6,
            "real-smollm2-zeroshot": 6 + 1, "real-qwen2.5-coder-1.5b": 16 * 2 + 1,
            "real-qwen2.5-coder-1.5b-code": 16 * 2 + 1}
    assert counts == {"ablation": 12, "factorial": factorial, "full": full, "ncalib": ncalib, "paper": paper,
                      "smoke": 46, **real}


@needs_stories
def test_the_smoke_matrix_passes_every_check_before_work_offline():
    cells = expand(load_matrix("smoke"), REGISTRY)
    preflight(cells, REGISTRY)
    methods = {(c.prune["scorer"], c.prune["compensator"]) for c in cells if c.method != "original"}
    assert len(methods) == 2 * 5 + 1 and {c.ratio for c in cells} == {0.0, 0.1, 0.2, 0.3}


def test_the_paper_matrix_has_the_papers_models_methods_and_settings():
    cells = expand(load_matrix("paper"), REGISTRY)
    assert {c.model for c in cells} == {"huggyllama/llama-7b", "meta-llama/Llama-2-13b-hf", "lmsys/vicuna-7b-v1.3"}
    assert {c.method_label for c in cells} == {"Original", "WANDA-sp", "FLAP", "Prop.Score+LS (lambda_best)",
                                               "RCPU (Rot.)", "RCPU (Rot.+Scale)"}
    assert {c.calib for c in cells} == {"wikitext2:128x128:seed=0", "wikitext2:512x128:seed=0"}
    assert {c.eval for c in cells} == {("ppl", "zeroshot")} and {c.ppl_profiles for c in cells} == {("rcpu128",)}
    assert all(tuple(c.prune["compensate"]) == MODULES for c in cells)


def test_overrides_replace_models_and_ratios_and_set_dotted_keys():
    matrix = load_matrix("smoke", model="meta-llama/Llama-2-7b-hf", ratios="0.1, 0.25",
                         sets=["calib.n_calib=[8, 16]", "prune.batch_size=4", "eval=[ppl]", "lambdas=[1.0]"])
    assert [(m.model, m.label) for m in matrix.models] == [("meta-llama/Llama-2-7b-hf", "Llama-2-7b-hf")]
    assert matrix.ratios == (0.1, 0.25) and matrix.calib.n_calib == (8, 16) and matrix.lambdas == (1.0,)
    assert {c.prune["batch_size"] for c in expand(matrix, REGISTRY)} == {4}
    relabelled = load_matrix("smoke", sets=["models.0.label=tiny"])
    assert relabelled.models[0].label == "tiny"


@pytest.mark.parametrize("sets, message", [
    (["ratios"], "expected dotted.key=value"),
    (["models.3.label=x"], "'3' is not an index of a list of 1 items"),
    (["name.first=x"], "'name' holds 'smoke', not a mapping or list"),
    (["calib.sedd=1"], "calib: unknown key 'sedd'"),
])
def test_bad_overrides_are_refused(sets, message):
    with pytest.raises(MatrixError) as error:
        load_matrix("smoke", sets=sets)
    assert message in str(error.value)


def test_a_matrix_file_is_read_with_yaml_1_1_numbers_and_named_after_its_stem(tmp_path):
    path = tmp_path / "mine.yaml"
    path.write_text("models: [m]\nmethods: [ls-best]\nratios: [0.2]\nlambdas: [1e-2, 1.0e+2]\n", encoding="utf-8")
    matrix = load_matrix(str(path))
    assert matrix.name == "mine" and matrix.lambdas == (0.01, 100.0)
    raw, _ = read_matrix(str(write_matrix(tmp_path / "again.yaml", tiny_raw(["rcpu-rot"]))))
    assert apply_overrides(raw, ratios="0.3")["ratios"] == ["0.3"] and raw["ratios"] == [0.2]


def test_an_unknown_matrix_lists_the_shipped_ones():
    shipped = ("ablation, factorial, full, ncalib, paper, quick, real-gemma3, real-qwen2.5-coder-1.5b, "
               "real-qwen2.5-coder-1.5b-code, real-smollm2, real-smollm2-allocation, real-smollm2-peers, "
               "real-smollm2-tinystories, real-smollm2-zeroshot, smoke")
    with pytest.raises(MatrixError, match=f"no matrix file or shipped matrix 'smok'; shipped: {shipped}"):
        load_matrix("smok")


def test_cell_ids_of_the_committed_leaderboard_stay_valid():
    """A change to what a cell hashes would orphan every stored result: the leaderboard's cells (the smoke matrix
    with the full perplexity protocols) must keep their ids."""
    leaderboard = Path(__file__).resolve().parent.parent / "results" / "leaderboard"
    lines = (leaderboard / "records.jsonl").read_text(encoding="utf-8").splitlines()
    stored = {json.loads(line)["cell_id"] for line in lines}
    cells = expand(load_matrix(str(leaderboard / "matrix.yaml")), REGISTRY)
    assert len(cells) == 46 and {cell.id for cell in cells} <= stored


# ------------------------------------------------------------------------- labels from the final configuration


def test_a_recipe_overridden_by_the_matrix_is_not_labelled_as_the_recipe():
    """Regression: methods [rcpu-rot] with prune {statistics: one-shot} was labelled RCPU (Rot.)."""
    (dense, cell) = cells_of(tiny_raw(["rcpu-rot"], prune={"statistics": "one-shot"}, include_dense=True))
    assert cell.prune["statistics"] == "one-shot"
    assert (cell.method, cell.method_label) == ("custom", "variance+procrustes [statistics=one-shot]")
    assert methods.label_of(cell.prune) is None
    assert (dense.method, dense.method_label) == ("original", "Original")  # nothing pruned: no option matters
    stored_before_the_fix = {**cell.to_json(), "method": "rcpu-rot", "method_label": "RCPU (Rot.)"}
    assert methods.cell_label(stored_before_the_fix) == cell.method_label
    (product_cell,) = [c for c in cells_of(tiny_raw([{"scorers": ["variance"], "compensators": ["procrustes"]}],
                                                    prune={"statistics": "one-shot"}))]
    assert product_cell.method_label == cell.method_label and product_cell.id == cell.id


@pytest.mark.parametrize("name, value", [(o.name, o.choices[-1]) for o in options.OPTIONS
                                         if o.recipe and o.kind == "choice"] + [("recollect_mlp", True)])
def test_every_recipe_option_set_away_from_its_default_leaves_the_recipe(name, value):
    (plain,) = cells_of(tiny_raw(["rcpu-rot"]))
    (changed,) = cells_of(tiny_raw(["rcpu-rot"], prune={name: value}))
    assert plain.method_label == "RCPU (Rot.)"
    assert changed.method_label == f"variance+procrustes [{name}={value}]"


def test_options_outside_a_recipe_keep_its_label():
    (cell,) = cells_of(tiny_raw(["rcpu-rot"], prune={"batch_size": 2, "gram_precision": "float64",
                                                     "compensator_params": {"solver": "svd"}}))
    assert (cell.method, cell.method_label) == ("rcpu-rot", "RCPU (Rot.)")
    (official,) = cells_of(tiny_raw(["rcpu-official"]))
    assert official.method_label == "RCPU (Rot., official numerics)"


def test_a_named_method_keeps_its_name():
    (cell,) = cells_of(tiny_raw([{"name": "mine", "scorer": "variance", "compensator": "procrustes"}]))
    assert (cell.method, cell.method_label) == ("custom", "mine")


LEADERBOARD = Path(__file__).resolve().parent.parent / "results" / "leaderboard"


def test_the_label_rule_and_the_id_rule_give_the_stored_leaderboard_labels_and_ids():
    lines = [json.loads(line) for line in (LEADERBOARD / "records.jsonl").read_text(encoding="utf-8").splitlines()]
    assert lines
    for line in lines:
        cell = line["cell"]
        assert matrix_cells.cell_id(cell) == line["cell_id"]
        assert methods.cell_label(cell) == cell["method_label"]


def test_cell_field_roles_are_the_old_lists():
    assert set(matrix_cells.NOT_HASHED) == {"matrix", "model_label", "method", "method_label", "device",
                                            "eval_batch_size"}
    assert set(matrix_cells.RUN_FIELDS) == {"model", "revision", "ratio", "n_calib", "seqlen", "calib", "lam", "prune",
                                     "dtype", "zeroshot_limit"}
    assert matrix_cells.HASHED_WHEN_SET == {"zeroshot_limit": None, "skip": []}


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("name: a\nname: b\nmodels: [m]\nmethods: [ls-best]\nratios: [0.2]\n", "name", "1 and 2"),
    ("models: [m]\nmethods: [ls-best]\nratios: [0.2]\nprune:\n  batch_size: 2\n  batch_size: 3\n", "batch_size",
     "5 and 6"),
    ("models: [m]\nmethods:\n  - {name: x, scorer: wanda-sp, scorer: variance}\nratios: [0.2]\n", "scorer", "3 and 3"),
])
def test_a_duplicate_yaml_key_is_refused_with_its_lines(tmp_path, text, key, lines):
    path = tmp_path / "dup.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(MatrixError, match=rf"the key '{key}' is given twice in one mapping, on lines {lines}"):
        load_matrix(str(path))


def test_a_duplicate_key_in_a_set_value_is_refused():
    with pytest.raises(MatrixError, match="the key 'a' is given twice"):
        load_matrix("smoke", sets=["prune={a: 1, a: 2}"])


@pytest.mark.parametrize("name", ["../../x", "a/b", "..", ".", "a\\b", "x..y"])
def test_a_matrix_name_must_stay_inside_results(name):
    with pytest.raises(MatrixError, match=r"name: .* must be a plain name \(no '/', '.' or '..'\): results go to "
                                          "results/<name>"):
        parse_matrix({**tiny_raw(["rcpu-rot"]), "name": name})


def test_a_product_with_allocations_crosses_them_and_al_am_keeps_the_structure_cell():
    cells = cells_of(tiny_raw([{"scorers": ["obs", "variance"], "compensators": ["none"],
                                "allocations": ["uniform", "log-increase", "al-am"]}]))
    allocations = {(c.prune["scorer"], c.prune["allocation"], c.prune["structure"]) for c in cells}
    assert allocations == {(s, a, st) for s in ("obs", "variance") for a, st in
                           (("uniform", "uniform"), ("log-increase", "uniform"), ("uniform", "al-am"))}
    same = cells_of(tiny_raw([{"name": "x", "scorer": "variance", "compensator": "none", "structure": "al-am"}]))
    by_structure = {c.ratio: c.id for c in same}
    assert by_structure == {c.ratio: c.id for c in cells if c.prune["scorer"] == "variance"
                            and c.prune["structure"] == "al-am"}
