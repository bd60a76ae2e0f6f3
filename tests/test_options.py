"""Each option of a run is declared once (rcpu_bench.pruning.options); validation, flags and the reference follow."""

from __future__ import annotations

import argparse
import re
from dataclasses import fields

import pytest

from rcpu_bench import experiment as experiment_options
from rcpu_bench.cli import build_parser
from rcpu_bench.commands import subcommand_parser
from rcpu_bench.declaration import Option
from rcpu_bench.experiment import Experiment
from rcpu_bench.matrix.entries import MODEL_KEYS, PRUNE_KEYS
from rcpu_bench.matrix.spec import TOP_KEYS, Matrix, parse_matrix
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning import options
from rcpu_bench.pruning.options import MODULES, OPTIONS, PruneConfig


def test_the_declaration_is_prune_config():
    assert [o.name for o in OPTIONS] == [f.name for f in fields(PruneConfig)]
    config = PruneConfig()
    assert {o.name: o.default for o in OPTIONS} == config.to_dict() | {"prune": MODULES, "compensate": MODULES}
    config.validate(default_registry())
    assert options.BY_NAME["statistics"].choices == ("sequential", "one-shot")
    assert options.BY_NAME["gram_precision"].choices == ("mixed", "float64")


BAD = {"ratio": 1.0, "rounding": "round", "prune": ("attention", "heads"), "compensate": ["mlp"],
       "gqa_rule": "heads", "head_aggregation": "max", "statistics": "twice", "structure": "global",
       "recollect_mlp": "yes", "offload": 1, "batch_size": 0, "holdout": -1, "gram_precision": "float16",
       "round_to": -8, "allocation": "", "allocation_params": [1],
       "scorer_params": [1],
       "model_method": ""}


@pytest.mark.parametrize("name", BAD)
def test_validate_names_the_bad_value_and_what_is_allowed(name):
    option = options.BY_NAME[name]
    with pytest.raises(ValueError) as error:
        PruneConfig(**{name: BAD[name]}).validate(default_registry())
    message = str(error.value)
    assert name in message or "ratio" in message
    assert repr(BAD[name]) in message or str(BAD[name]) in message
    for choice in option.choices:
        assert choice in message


def test_every_option_has_a_bad_value_tested_or_is_a_registered_name():
    assert set(BAD) | {"scorer", "compensator", "compensator_params", "model_method_params"} == set(options.BY_NAME)


def test_flags_give_the_config_they_spell():
    args = build_parser().parse_args([
        "prune", "--scorer", "wanda-sp", "--compensator", "ridge", "--compensator-param", "lam=1e-2",
        "--compensator-param", "dtype=float32", "--ratio", "0.3", "--rounding", "ceil", "--prune", "mlp",
        "--compensate", "none", "--gqa-rule", "query", "--head-aggregation", "standardized-mean",
        "--statistics", "one-shot", "--structure", "al-am", "--recollect-mlp", "--offload", "--calib-batch-size", "4",
        "--gram-precision", "float64", "--model-method", "slicegpt", "--model-method-param", "budget='params'"])
    assert options.from_args(args) == PruneConfig(
        scorer="wanda-sp", compensator="ridge", ratio=0.3, compensator_params={"lam": 1e-2, "dtype": "float32"},
        rounding="ceil", prune=("mlp",), compensate=(), gqa_rule="query", head_aggregation="standardized-mean",
        statistics="one-shot", structure="al-am", recollect_mlp=True, offload=True, batch_size=4,
        gram_precision="float64", model_method="slicegpt", model_method_params={"budget": "params"})


def test_no_flags_give_the_default_config():
    assert options.from_args(build_parser().parse_args(["prune"])) == PruneConfig()


@pytest.mark.parametrize("argv", [["--scorer-param", "novalue"], ["--prune", "heads"], ["--statistics", "twice"]])
def test_bad_flags_stop_the_parser(argv, capsys):
    with pytest.raises(SystemExit) as stop:
        build_parser().parse_args(["prune", *argv])
    assert stop.value.code == 2
    assert argv[1] in capsys.readouterr().err


def test_coerce_reads_yaml_lists_as_module_tuples_and_checks():
    assert options.coerce("prune", ["mlp"]) == ("mlp",)
    assert options.coerce("compensate", []) == ()
    assert options.from_dict({"compensate": ["attention"], "ratio": 0.5}) == PruneConfig(compensate=("attention",),
                                                                                        ratio=0.5)
    with pytest.raises(KeyError, match="unknown option 'lambda'"):
        options.coerce("lambda", 1.0)
    with pytest.raises(ValueError, match="statistics='twice' is not allowed; allowed: sequential, one-shot"):
        options.coerce("statistics", "twice")


def test_options_added_after_stored_results_are_hashed_only_when_set():
    assert options.HASHED_WHEN_SET == {"gram_precision": "mixed", "model_method": None, "model_method_params": {},
                                       "holdout": 0, "round_to": 0, "allocation": "uniform", "allocation_params": {}}


def test_the_default_pipeline_is_every_recipe_option_but_scorer_and_compensator_at_its_default():
    assert options.is_default_pipeline(PruneConfig(scorer="wanda-sp", compensator="ridge", batch_size=2).to_dict())
    for config in (PruneConfig(statistics="one-shot"), PruneConfig(structure="al-am"), PruneConfig(rounding="ceil"),
                   PruneConfig(model_method="slicegpt")):
        assert not options.is_default_pipeline(config.to_dict())


# ------------------------------------------------------------------- the experiment-level options, declared once

MODEL_COMMANDS = ("prune", "eval", "generate", "speed")


def _actions(command: str) -> dict[str, argparse.Action]:
    return {action.dest: action for action in subcommand_parser(command)._actions}


@pytest.mark.parametrize("name", experiment_options.MODEL)
def test_every_command_that_loads_a_model_takes_the_option_with_one_default_and_help(name):
    option = experiment_options.BY_NAME[name]
    for command in MODEL_COMMANDS:
        action = _actions(command)[name]
        assert (action.option_strings, action.default, action.help) == ([option.flag], option.default, option.help)


def test_eval_batch_size_has_one_default_and_help_on_every_command_that_evaluates():
    option = experiment_options.BY_NAME["eval_batch_size"]
    for command in ("prune", "eval", "speed"):
        action = _actions(command)["eval_batch_size"]
        assert (action.option_strings, action.default, action.help) == (["--eval-batch-size"], 8, option.help)


DECLARED = {**experiment_options.BY_NAME, "zeroshot_limit": {key.name: key for key in TOP_KEYS}["zeroshot_limit"]}


@pytest.mark.parametrize("name, value, message", [
    ("dtype", "int8", "unknown dtype 'int8'; allowed: float32, float64, bfloat16, float16"),
    ("dtype", "", "dtype='' is not allowed; allowed: a non-empty string"),
    ("device", "gpu", "unknown device 'gpu'; allowed: cpu, cuda"),
    ("eval_batch_size", 0, "eval_batch_size=0 is not allowed; allowed: an integer >= 1"),
    ("zeroshot_limit", 2.5, "zeroshot_limit=2.5 is not allowed; allowed: an integer >= 1"),
    ("revision", 3, "revision=3 is not allowed; allowed: a non-empty string"),
])
def test_a_bad_experiment_option_names_the_value_and_what_is_allowed(name, value, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        DECLARED[name].check(value)


@pytest.mark.parametrize("name, value", [("dtype", "bfloat16"), ("device", "cuda:1"), ("eval_batch_size", 1),
                                         ("zeroshot_limit", None), ("revision", None), ("revision", "main")])
def test_a_good_experiment_option_passes(name, value):
    DECLARED[name].check(value)


def test_the_matrix_schema_is_options_and_its_option_keys_are_the_declarations():
    keys = {key.name: key for key in TOP_KEYS}
    assert all(isinstance(key, Option) for key in (*TOP_KEYS, *PRUNE_KEYS, *MODEL_KEYS))
    for name in ("dtype", "device", "eval_batch_size"):
        assert keys[name] is experiment_options.BY_NAME[name]  # the experiment's declaration, not a copy
    assert [key.name for key in TOP_KEYS] == [f.name for f in fields(Matrix)]  # each key a field of the Matrix
    assert (keys["zeroshot_limit"].kind, keys["zeroshot_limit"].default) == ("count", None)
    assert {key.name for key in TOP_KEYS if key.kind == "structure"} == {
        "name", "models", "methods", "ratios", "calib", "lambdas", "eval", "ppl_profiles", "include_dense", "prune",
        "ablation", "zeroshot_ratios", "skip"}
    assert [key.name for key in PRUNE_KEYS] == [o.name for o in OPTIONS if o.name != "ratio"]
    for key in PRUNE_KEYS:  # the declaration, read into the field's type first
        option = options.BY_NAME[key.name]
        assert (key.kind, key.help, key.default, key.choices) == (option.kind, option.help, option.default,
                                                                  option.choices)
    assert MODEL_KEYS[-1] is experiment_options.BY_NAME["revision"]


def test_every_default_of_a_run_setting_comes_from_its_declaration():
    experiment = Experiment()
    for declared in experiment_options.OPTIONS:
        assert getattr(experiment, declared.name) == declared.default
    config = PruneConfig()
    for declared in OPTIONS:
        assert getattr(config, declared.name) == declared.default
    matrix = parse_matrix({"models": ["m"], "methods": ["rcpu-rot"], "ratios": [0.2]}, "m")
    for declared in TOP_KEYS:
        if declared.name not in ("name", "models", "methods", "ratios", "ablation"):
            assert getattr(matrix, declared.name) == declared.default, declared.name


def test_the_pruned_modules_come_in_pruning_order_whatever_order_they_were_given_in():
    assert PruneConfig(prune=("mlp", "attention")).pruned_modules == ("attention", "mlp")
    assert PruneConfig(prune=("mlp",)).pruned_modules == ("mlp",) and PruneConfig(prune=()).pruned_modules == ()
