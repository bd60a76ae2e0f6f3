"""Zero-shot evaluation: all seven tasks offline through lm-eval, requests equal to the built-in tasks',
no answers shared between models, the ``eval`` command on a pruned directory, and clear errors."""

from __future__ import annotations

import argparse
import copy
import json
import logging
import socket
from importlib import metadata

import pytest
import torch
from datasets import Dataset, DatasetDict
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import TaskIndex
from lm_eval.tasks._yaml_loader import load_yaml
from tiny_models import STORIES, needs_stories, or_missing

from rcpu_bench import zeroshot
from rcpu_bench.models import load_model
from rcpu_bench.paths import data_dir
from rcpu_bench.persistence import save_pruned
from rcpu_bench.pipeline import PruneConfig, prune_model
from rcpu_bench.records import read_records
from rcpu_bench.tasks import utils
from rcpu_bench.zeroshot import METRIC_MAPS, TASKS, add_parser, builtin_yaml, evaluate_zeroshot, local_task_config


DATA = or_missing(data_dir)
ZEROSHOT = DATA / "zeroshot"
needs_zeroshot_data = pytest.mark.skipif(not ZEROSHOT.is_dir(), reason=f"zero-shot data not found ({ZEROSHOT})")
# The Mosaic-form tasks and their converters to the built-in's document fields.
CONVERTERS = {"boolq": utils.boolq_fields, "winogrande": utils.winogrande_fields, "arc_easy": utils.arc_fields,
              "arc_challenge": utils.arc_fields, "openbookqa": utils.openbookqa_fields}
EVAL_SPLITS = ("training_split", "validation_split", "test_split")


def local_rows(task: str) -> list[dict]:
    """The rows of ``task``'s local files as they are (Mosaic or original form)."""
    return utils.read_split([DATA / name for name in zeroshot.local_data_files(task)])


def builtin_documents(task: str, n: int) -> list[dict]:
    """The first ``n`` local documents in the built-in task's field format."""
    rows = local_rows(task)[:n]
    return [CONVERTERS[task](row) for row in rows] if task in CONVERTERS else rows


def builtin_spec_on(task: str, documents: list[dict]) -> dict:
    """The built-in task's own config, its dataset replaced by ``documents`` in every split it names."""
    spec = load_yaml(builtin_yaml(task), resolve_func=True)
    dataset = Dataset.from_list(documents)
    splits = [spec[key] for key in EVAL_SPLITS if spec.get(key)]
    spec["custom_dataset"] = lambda **_: DatasetDict({split: dataset for split in splits})
    return spec


def requests(spec: dict, limit: int) -> list[tuple]:
    """(document, choice, (context, continuation)) of every 0-shot loglikelihood request, in order."""
    task = TaskManager(include_defaults=False).load([spec])["tasks"][spec["task"]]
    task.set_config(key="num_fewshot", value=0)
    task.build_all_requests(limit=limit)
    assert all(instance.request_type == "loglikelihood" for instance in task.instances)
    return [(instance.doc_id, instance.idx, instance.arguments) for instance in task.instances]


@pytest.fixture(scope="module")
def stories():
    return load_model(str(STORIES))


def scores(result: dict) -> dict:
    return {task: (t["acc"], t.get("acc_norm")) for task, t in result["tasks"].items()}


# ------------------------------------------------------------------------------- the tasks themselves


@needs_zeroshot_data
@pytest.mark.parametrize("task", TASKS)
def test_requests_equal_the_builtin_tasks_on_the_same_documents(task):
    n = 12
    builtin = requests(builtin_spec_on(task, builtin_documents(task, n)), n)
    ours = requests(local_task_config(task, DATA), n)
    assert len(builtin) >= 2 * n and ours == builtin


@pytest.mark.parametrize("task", TASKS)
def test_configs_copy_the_builtin_prompts_metrics_and_version(task):
    """Template fields verbatim; function fields (WinoGrande's) are checked by behaviour below."""
    ours, builtin = local_task_config(task), load_yaml(builtin_yaml(task), resolve_func=True)
    for key in ("output_type", "metric_list", "metadata", "target_delimiter", "fewshot_delimiter", "description",
                "doc_to_text", "doc_to_target", "doc_to_choice"):
        if not callable(builtin.get(key)):
            assert ours.get(key) == builtin.get(key), key
    evaluated = "test_split" if builtin.get("test_split") else "validation_split"
    assert ours.get(evaluated) == builtin[evaluated] and ours["task"] == f"rcpu_{task}"


@needs_zeroshot_data
def test_copied_functions_behave_as_the_builtins_on_every_local_document():
    hellaswag = load_yaml(builtin_yaml("hellaswag"), resolve_func=True)["process_docs"]
    raw = Dataset.from_list(local_rows("hellaswag"))
    assert utils.hellaswag_docs(raw).to_list() == hellaswag(raw).to_list()
    winogrande = load_yaml(builtin_yaml("winogrande"), resolve_func=True)
    for row in local_rows("winogrande"):
        doc = utils.winogrande_fields(row)
        assert utils.winogrande_text(doc) == winogrande["doc_to_text"](doc)
        assert utils.winogrande_target(doc) == winogrande["doc_to_target"](doc)
        assert utils.winogrande_choices(doc) == winogrande["doc_to_choice"](doc)


@needs_zeroshot_data
def test_converted_documents_rebuild_the_mosaic_files_exactly():
    """What the Mosaic form holds is recovered losslessly; only BoolQ's documented artefact is undone."""
    for row in local_rows("boolq"):
        doc = utils.boolq_fields(row)
        passage = doc["passage"].replace(" question", "\nQuestion")
        assert f"Passage: {passage}\nQuestion: {doc['question']}?" == row["query"]
        assert ["no", "yes"][doc["label"]] == row["choices"][row["gold"]]
    for task in ("arc_easy", "arc_challenge", "openbookqa"):
        for row in local_rows(task):
            doc = CONVERTERS[task](row)
            question = f"Question: {doc['question']}" if "question" in doc else doc["question_stem"]
            assert (question, doc["choices"]["text"], doc["choices"]["label"].index(doc["answerKey"])) == (
                row["query"], row["choices"], row["gold"])
    for row in local_rows("winogrande"):
        doc = utils.winogrande_fields(row)
        assert utils.winogrande_choices(doc) == row["context_options"]
        assert (utils.winogrande_target(doc), utils.winogrande_text(doc)) == (row["continuation"], row["gold"])


@needs_zeroshot_data
def test_the_boolq_artefact_is_what_the_converter_assumes():
    """Mosaic turned every " question" in a passage into "\\nQuestion": no other newline, none left."""
    passages = [utils.strip_prefix(row["query"], "Passage: ").rsplit("\nQuestion: ", 1)[0] for row in local_rows("boolq")]
    assert sum(p.count("\n") for p in passages) == sum(p.count("\nQuestion") for p in passages) == 33
    assert not any(" question" in p.lower() for p in passages)


@needs_zeroshot_data
def test_mosaic_piqa_strips_whitespace_so_the_original_files_are_used():
    """The Mosaic PIQA equals the original release up to surrounding whitespace, which it dropped."""
    mosaic = utils.read_split([ZEROSHOT / "mosaic_icl" / "piqa.jsonl"])
    original = local_rows("piqa")
    stripped = [[row["sol1"].strip(), row["sol2"].strip()] for row in original]
    assert [m["choices"] for m in mosaic] == stripped
    assert [m["gold"] for m in mosaic] == [row["label"] for row in original]
    assert sum([row["sol1"], row["sol2"]] != s for row, s in zip(original, stripped)) > 100


# ----------------------------------------------------------------------------------- evaluation


@needs_stories
@needs_zeroshot_data
def test_every_task_runs_offline_and_reports_its_statistics(stories, caplog):
    with caplog.at_level(logging.WARNING, logger="rcpu_bench.zeroshot"):
        result = evaluate_zeroshot(stories.model, stories.tokenizer, limit=6, batch_size=8, source="auto",
                                   metric_map="slicegpt")
    assert result["source"] == "local" and "HF_HUB_OFFLINE is set" in result["source_reason"]
    assert "local files" in caplog.text
    assert set(result["tasks"]) == set(TASKS)
    for task, t in result["tasks"].items():
        builtin = load_yaml(builtin_yaml(task), resolve_func=False)
        has_norm = any(m["metric"] == "acc_norm" for m in builtin["metric_list"])
        expected = {"acc", "acc_stderr"} | ({"acc_norm", "acc_norm_stderr"} if has_norm else set())
        assert expected == set(t) & {"acc", "acc_stderr", "acc_norm", "acc_norm_stderr"}
        assert all(0 <= t[k] <= 1 for k in expected)
        assert (t["n"], t["num_fewshot"], t["version"]) == (6, 0, builtin["metadata"]["version"])
        assert t["metric"] == METRIC_MAPS["slicegpt"][task] and t["value"] == t[t["metric"]]
    assert result["tasks"]["hellaswag"]["n_available"] == 1000 and result["tasks"]["boolq"]["n_available"] == 3270
    assert result["lm_eval_version"] == metadata.version("lm_eval")
    assert (result["batch_size"], result["limit"], result["max_length"], result["examples"]) == (8, 6, 512, 42)
    assert result["seconds"] > 0 and result["examples_per_second"] == pytest.approx(42 / result["seconds"])
    assert len(result["data_files"]) == 8 and all(len(h) == 64 for h in result["data_files"].values())
    json.dumps(result)  # a record field


@needs_stories
@needs_zeroshot_data
def test_two_models_in_one_process_get_their_own_answers(stories):
    """No request cache: a perturbed copy scores differently, and the dense model again scores the same."""
    perturbed = copy.deepcopy(stories.model)
    with torch.no_grad():
        perturbed.model.layers[0].mlp.down_proj.weight.mul_(-4.0)
    run = {"tasks": "piqa,winogrande", "limit": 25, "source": "local"}
    dense = scores(evaluate_zeroshot(stories.model, stories.tokenizer, **run))
    other = scores(evaluate_zeroshot(perturbed, stories.tokenizer, **run))
    again = scores(evaluate_zeroshot(stories.model, stories.tokenizer, **run))
    assert dense == again
    assert all(other[task] != dense[task] for task in dense)


def test_source_resolution_is_recorded_and_never_silent(monkeypatch):
    assert zeroshot.resolve_source("local") == ("local", "requested")
    with pytest.raises(ValueError, match="HF_HUB_OFFLINE is set"):
        zeroshot.resolve_source("hub")
    with pytest.raises(ValueError, match="allowed: auto, local, hub"):
        zeroshot.resolve_source("web")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")

    def unreachable(*args, **kwargs):
        raise OSError("no route")

    monkeypatch.setattr(socket, "create_connection", unreachable)
    used, reason = zeroshot.resolve_source("auto")
    assert used == "local" and "unreachable" in reason and "no route" in reason
    monkeypatch.setattr(socket, "create_connection", lambda *args, **kwargs: socket.socket())
    assert zeroshot.resolve_source("auto") == ("hub", "auto: hub reachable")


@pytest.mark.parametrize("task", TASKS)
def test_hub_source_uses_the_builtin_configs_under_their_names(task):
    plan = zeroshot.ZeroShotPlan((task,), "hub", "requested", None, 16, "paper", DATA)
    (spec,) = zeroshot.task_specs(plan)
    assert TaskIndex.entry_from_path(builtin_yaml(task)).name == zeroshot.lm_eval_name(task, "hub") == task
    assert spec == str(builtin_yaml(task))


@pytest.mark.parametrize("kwargs, error, message", [
    ({"tasks": ("boolq", "mmlu")}, ValueError, f"unknown task(s) ['mmlu']; allowed: {', '.join(TASKS)}"),
    ({"tasks": ()}, ValueError, "allowed: boolq"),
    ({"limit": 0}, ValueError, "limit (examples per task) must be a positive integer, got 0"),
    ({"limit": 2.5}, ValueError, "got 2.5"),
    ({"batch_size": 0}, ValueError, "batch size must be a positive integer"),
    ({"metric_map": "llm-pruner"}, ValueError, "allowed: paper, slicegpt"),
    ({"source": "hub"}, ValueError, "source 'hub' requested"),
    ({"data_dir": "/no/such/data"}, FileNotFoundError, "/no/such/data/zeroshot/mosaic_icl/boolq.jsonl"),
])
def test_bad_requests_fail_before_any_work(kwargs, error, message):
    with pytest.raises(error) as raised:
        evaluate_zeroshot(None, None, **{"source": "local", **kwargs})
    assert message in str(raised.value)


# ------------------------------------------------------------------------------------------ the CLI


def run_eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="rcpu-bench")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["eval", *argv])
    return args.func(args)


@needs_stories
@needs_zeroshot_data
def test_eval_command_on_a_save_pruned_directory(tmp_path, capsys):
    loaded = load_model(str(STORIES))
    calib = torch.randint(3, loaded.model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    config = PruneConfig(ratio=0.25)
    prune_model(loaded.model, calib, config, progress=False)
    save_pruned(loaded.model, tmp_path / "pruned", tokenizer=loaded.tokenizer, method=config.to_dict(),
                provenance=loaded.provenance)
    out = tmp_path / "runs.jsonl"
    code = run_eval(["--model", str(tmp_path / "pruned"), "--tasks", "piqa,winogrande", "--limit", "5",
                     "--batch-size", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "piqa" in printed and "winogrande" in printed and "source: local" in printed
    (record,) = read_records(out)
    assert record["command"] == "eval" and record["model_provenance"]["method"]["ratio"] == 0.25
    assert record["parameters"] == record["model_provenance"]["parameter_count"]
    assert set(record["zeroshot"]["tasks"]) == {"piqa", "winogrande"} and record["zeroshot"]["limit"] == 5


@needs_stories
@pytest.mark.parametrize("args, message", [
    (["--tasks", "boolq,mmlu"], "allowed: boolq, piqa, hellaswag"),
    (["--limit", "0"], "limit (examples per task) must be a positive integer"),
    (["--batch-size", "-1"], "batch size must be a positive integer"),
    (["--data-dir", "/no/such/data"], "zero-shot data file(s) not found"),
    (["--source", "hub"], "HF_HUB_OFFLINE is set"),
    (["--dtype", "int8"], "int8"),
    (["--device", "gpu"], "gpu"),
    (["--model", "/no/such/model"], "/no/such/model"),
])
def test_eval_command_reports_bad_input_before_work(tmp_path, capsys, args, message):
    out = tmp_path / "runs.jsonl"
    code = run_eval(["--model", str(STORIES), "--source", "local", *args, "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and "rcpu-bench: error:" in err and message in err
    assert not out.exists()


@needs_stories
def test_eval_command_rejects_a_pruned_directory_without_tokenizer(tmp_path, capsys):
    save_pruned(load_model(str(STORIES)).model, tmp_path / "m")
    assert run_eval(["--model", str(tmp_path / "m"), "--source", "local"]) == 2
    assert "has no tokenizer" in capsys.readouterr().err


@pytest.mark.parametrize("args", [["--limit", "x"], ["--source", "web"], ["--metric-map", "nope"]])
def test_eval_command_rejects_malformed_options(args, capsys):
    with pytest.raises(SystemExit) as raised:
        run_eval(["--model", "m", *args])
    assert raised.value.code == 2 and "invalid" in capsys.readouterr().err
