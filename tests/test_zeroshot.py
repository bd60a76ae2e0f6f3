"""Zero-shot evaluation: all seven tasks offline through lm-eval, requests equal to the built-in tasks',
no answers shared between models, the ``eval`` command on a pruned directory, and clear errors."""

from __future__ import annotations

import copy
import json
import logging
import socket
from importlib import metadata
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset, DatasetDict
from lm_eval.tasks import TaskManager
from lm_eval.tasks._index import TaskIndex
from lm_eval.tasks._yaml_loader import load_yaml
from tiny_models import STORIES, needs_stories, or_missing

from rcpu_bench.cli import main
from rcpu_bench.evaluation import zeroshot
from rcpu_bench.evaluation.tasks import utils
from rcpu_bench.evaluation.zeroshot import METRIC_MAPS, TASKS, builtin_yaml, evaluate_zeroshot, local_task_config
from rcpu_bench.model.loading import load_model
from rcpu_bench.model.persistence import save_pruned
from rcpu_bench.paths import data_dir
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.records import read_records

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


@pytest.fixture
def stories(stories_260k):
    return stories_260k["gqa"]


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
    passages = [utils.strip_prefix(row["query"], "Passage: ").rsplit("\nQuestion: ", 1)[0]
                for row in local_rows("boolq")]
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


@pytest.mark.slow
@needs_stories
@needs_zeroshot_data
def test_every_task_runs_offline_and_reports_its_statistics(stories, caplog):
    with caplog.at_level(logging.WARNING, logger="rcpu_bench.evaluation.zeroshot"):
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


@pytest.mark.slow
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
    # these two index all of lm-eval's task YAMLs (~20-40 s; test_check_known_names_close_matches covers the rule)
    pytest.param({"tasks": ("boolq", "pica")}, ValueError, "unknown task 'pica'; close matches: ",
                 marks=pytest.mark.slow),
    ({"tasks": ()}, ValueError, "no task named in ''"),
    pytest.param({"tasks": "lambada_openai"}, ValueError, "task 'lambada_openai' needs its dataset from the Hugging "
                 "Face hub (or another download), not available offline (HF_HUB_OFFLINE is set)",
                 marks=pytest.mark.slow),
    ({"tasks": "mini_choice", "include_path": "/no/such/tasks"}, FileNotFoundError,
     "task include path(s) not found: /no/such/tasks"),
    ({"num_fewshot": -1}, ValueError, "num_fewshot must be an integer >= 0, got -1"),
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


# ------------------------------------------------------------------------ any lm-eval task or group

# A tiny multiple-choice task of our own on local data: proves "any task" without the network.
MINI_DOCS = [{"q": "Once upon a time there was a", "choices": ["girl", "table", "seven"], "gold": 0},
             {"q": "The sun was", "choices": ["hot", "sad"], "gold": 0},
             {"q": "She ate the", "choices": ["run", "apple", "blue"], "gold": 1},
             {"q": "Tom and his mom went to the", "choices": ["park", "happy"], "gold": 0}]
MINI_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "{prompt}"
doc_to_target: gold
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - {{metric: acc, aggregation: mean, higher_is_better: true}}
metadata: {{version: 2.0}}
"""
MINI_GROUP = """group: mini_group
task: [mini_choice, mini_choice_b]
aggregate_metric_list:
  - {metric: acc, aggregation: mean, weight_by_size: true}
metadata: {version: 1.0}
"""
MINI_PROMPTS = {"mini_choice": "{{q}}", "mini_choice_b": "Story: {{q}}"}


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    """Two task YAMLs on one local JSONL file and a group of both (lm-eval's include_path format)."""
    root = tmp_path_factory.mktemp("tasks")
    data = root / "mini.jsonl"
    data.write_text("".join(json.dumps(doc) + "\n" for doc in MINI_DOCS))
    for name, prompt in MINI_PROMPTS.items():
        (root / f"{name}.yaml").write_text(MINI_TASK.format(name=name, data=data, prompt=prompt))
    (root / "mini_group.yaml").write_text(MINI_GROUP)
    return root


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context) in float64, the context / continuation split of lm-eval's causal LMs:
    the tokens of the whole text beyond those of the context alone, the tokenizer's own special tokens (BOS)."""
    whole = tokenizer.encode(context + continuation)
    start = len(tokenizer.encode(context))
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), dim=-1)
    return sum(logp[i - 1, whole[i]].item() for i in range(start, len(whole)))


def choice_scores(model, tokenizer, prompt: str, docs: list[dict]) -> list[list[float]]:
    """Each document's choices scored 0-shot (lm-eval puts its target delimiter, a space, before each)."""
    return [[loglikelihood(model, tokenizer, prompt.replace("{{q}}", doc["q"]), f" {choice}")
             for choice in doc["choices"]] for doc in docs]


def accuracy(scores: list[list[float]], docs: list[dict]) -> float:
    return sum(max(range(len(s)), key=s.__getitem__) == doc["gold"] for s, doc in zip(scores, docs)) / len(docs)


@pytest.mark.slow
@needs_stories
def test_a_group_of_local_tasks_from_an_include_path(stories, task_dir):
    """Any task: our own YAMLs through include_path, the group's acc the size-weighted mean of its tasks'."""
    result = evaluate_zeroshot(stories.model, stories.tokenizer, "mini_group", include_path=task_dir, batch_size=4)
    assert set(result["tasks"]) == {"mini_group", *MINI_PROMPTS}
    for name, prompt in MINI_PROMPTS.items():
        task = result["tasks"][name]
        assert task["acc"] == pytest.approx(accuracy(choice_scores(stories.model, stories.tokenizer, prompt,
                                                                   MINI_DOCS), MINI_DOCS))
        assert (task["n"], task["n_available"], task["version"], task["num_fewshot"]) == (4, 4, 2.0, 0)
    group = result["tasks"]["mini_group"]
    assert group["acc"] == pytest.approx((result["tasks"]["mini_choice"]["acc"] +
                                          result["tasks"]["mini_choice_b"]["acc"]) / 2)
    assert result["mean"] is None and result["metrics"] == {} and result["source"] is None
    assert result["other_tasks"] == ["mini_group"] and result["include_path"] == [str(task_dir)]
    assert result["examples"] == 8
    json.dumps(result)


@pytest.mark.slow
@needs_stories
def test_num_fewshot_and_nothing_written_without_an_output_path(stories, task_dir, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = evaluate_zeroshot(stories.model, stories.tokenizer, "mini_choice", include_path=task_dir,
                               num_fewshot=2, limit=3)
    task = result["tasks"]["mini_choice"]
    assert (task["num_fewshot"], task["n"], result["num_fewshot"], result["output_path"]) == (2, 3, 2, None)
    assert list(tmp_path.iterdir()) == []


def test_check_known_names_close_matches():
    """The rule of ``check_known`` on a stand-in index (the real one takes seconds to build: the test below)."""
    manager = SimpleNamespace(all_tasks=["piqa", "lambada_openai", "boolq"], task_index={"piqa": 0, "boolq": 0})
    zeroshot.check_known(("boolq", "piqa"), manager)
    with pytest.raises(ValueError) as raised:
        zeroshot.check_known(("pica", "qqqzzz", "boolq"), manager)
    message = str(raised.value)
    assert "unknown task 'pica'; close matches: piqa" in message
    assert "unknown task 'qqqzzz'; close matches: none" in message
    assert "'boolq'" not in message


@pytest.mark.slow
def test_unknown_task_names_get_their_close_matches():
    with pytest.raises(ValueError) as raised:
        zeroshot.plan_zeroshot("pica,lambada_opnai,qqqzzz", source="local")
    message = str(raised.value)
    assert "unknown task 'pica'; close matches: " in message and "piqa" in message.split("'pica'")[1]
    assert "unknown task 'lambada_opnai'; close matches: lambada_openai" in message
    assert "unknown task 'qqqzzz'; close matches: none" in message


def test_build_tasks_names_a_dataset_that_cannot_be_had(monkeypatch):
    """The rule of ``build_tasks`` on a stand-in manager whose load fails as a download does (the test below builds
    the real index)."""
    def load(names):
        raise ConnectionError(f"no route to {names[0]}")

    manager = SimpleNamespace(load=load)
    with pytest.raises(ValueError, match="task 'lambada_openai' needs its dataset from the Hugging Face hub .* "
                                         r"\(HF_HUB_OFFLINE is set\): ConnectionError: no route to lambada_openai"):
        zeroshot.build_tasks(("lambada_openai",), manager)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    with pytest.raises(ValueError, match="task 'lambada_openai' could not load its dataset .the download failed.: "):
        zeroshot.build_tasks(("lambada_openai",), manager)


@pytest.mark.slow
def test_a_hub_task_offline_or_failing_is_named(monkeypatch):
    """Offline flags set: the message says so; unset (datasets still offline, as when a download fails): that."""
    with pytest.raises(ValueError, match="task 'lambada_openai' needs its dataset from the Hugging Face hub") as raised:
        zeroshot.plan_zeroshot("lambada_openai")
    assert "HF_HUB_OFFLINE is set" in str(raised.value) and "EleutherAI/lambada_openai" in str(raised.value)
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    with pytest.raises(ValueError, match="task 'lambada_openai' could not load its dataset .the download failed.: "):
        zeroshot.plan_zeroshot("lambada_openai")


# ------------------------------------------------------------------------------------------ the CLI


def run_eval(argv: list[str]) -> int:
    return main(["eval", *argv])


@pytest.mark.slow
@needs_stories
@needs_zeroshot_data
def test_eval_command_on_a_save_pruned_directory(tmp_path, capsys):
    loaded = load_model(str(STORIES))
    calib = torch.randint(3, loaded.model.config.vocab_size, (4, 64), generator=torch.Generator().manual_seed(0))
    config = PruneConfig(ratio=0.25)
    prune_model(loaded.model, calib, config, progress=False, registry=default_registry())
    save_pruned(loaded.model, tmp_path / "pruned", tokenizer=loaded.tokenizer, method=config.to_dict(),
                provenance=loaded.provenance)
    out = tmp_path / "runs.jsonl"
    code = run_eval(["--model", str(tmp_path / "pruned"), "--tasks", "piqa,winogrande", "--limit", "5",
                     "--eval-batch-size", "4", "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "piqa" in printed and "winogrande" in printed and "source: local" in printed
    (record,) = read_records(out)
    assert record["command"] == "eval" and record["model_provenance"]["method"]["ratio"] == 0.25
    assert record["parameters"] == record["model_provenance"]["parameter_count"]
    assert set(record["zeroshot"]["tasks"]) == {"piqa", "winogrande"} and record["zeroshot"]["limit"] == 5


@pytest.mark.slow
@needs_stories
@needs_zeroshot_data
def test_eval_command_on_a_paper_task_and_our_own_with_lm_eval_outputs(tmp_path, task_dir, capsys):
    """A paper task (shipped copy) beside a task from --include-path; lm-eval's results and samples files
    under --output-path hold the same scores, and the logged log-likelihoods equal a direct computation."""
    out, lm_out = tmp_path / "runs.jsonl", tmp_path / "lm-eval"
    code = run_eval(["--model", str(STORIES), "--tasks", "piqa,mini_choice", "--include-path", str(task_dir),
                     "--limit", "3", "--source", "local", "--output-path", str(lm_out), "--log-samples",
                     "--out", str(out)])
    printed = capsys.readouterr().out
    assert code == 0 and "mini_choice" in printed and "piqa" in printed and str(lm_out) in printed
    (record,) = read_records(out)
    result = record["zeroshot"]
    assert set(result["tasks"]) == {"piqa", "mini_choice"} and result["source"] == "local"
    assert result["mean"] == result["tasks"]["piqa"]["acc"] and result["output_path"] == str(lm_out)
    (folder,) = lm_out.iterdir()  # lm-eval's layout: <output>/<model name>/results_<date>.json
    assert folder.name == str(STORIES).replace("/", "__")
    (results_file,) = folder.glob("results_*.json")
    saved = json.loads(results_file.read_text())["results"]
    assert saved["mini_choice"]["acc,none"] == result["tasks"]["mini_choice"]["acc"]
    assert saved["rcpu_piqa"]["acc,none"] == result["tasks"]["piqa"]["acc"]
    assert len(list(folder.glob("samples_rcpu_piqa_*.jsonl"))) == 1
    (samples_file,) = folder.glob("samples_mini_choice_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    stories = load_model(str(STORIES))
    expected = choice_scores(stories.model, stories.tokenizer, MINI_PROMPTS["mini_choice"], MINI_DOCS[:3])
    assert [[float(r[0]) for r in s["filtered_resps"]] for s in samples] == [pytest.approx(e, abs=1e-4)
                                                                          for e in expected]
    assert result["tasks"]["mini_choice"]["acc"] == pytest.approx(accuracy(expected, MINI_DOCS[:3]))


@needs_stories
@pytest.mark.parametrize("args, message", [
    # these two index all of lm-eval's task YAMLs (~20-40 s); the other cases check the command's error path
    pytest.param(["--tasks", "boolq,pica"], "unknown task 'pica'; close matches: ", marks=pytest.mark.slow),
    pytest.param(["--tasks", "piqa,lambada_openai"],
                 "task 'lambada_openai' needs its dataset from the Hugging Face hub", marks=pytest.mark.slow),
    (["--log-samples"], "--log-samples needs --output-path"),
    (["--num-fewshot", "-2"], "num_fewshot must be an integer >= 0, got -2"),
    (["--limit", "0"], "limit (examples per task) must be a positive integer"),
    (["--eval-batch-size", "-1"], "batch size must be a positive integer"),
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
    assert code == 2 and "rcpu-bench eval: error:" in err and message in err
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
