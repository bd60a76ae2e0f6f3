"""Readers and document converters for the ``rcpu_<task>`` lm-eval tasks (``!function`` targets).

Every converter turns the local documents into the fields of lm-eval's built-in task, so the YAMLs can
keep the built-in prompt templates verbatim. The MosaicML files lost some of the original structure;
what each converter can and cannot recover is stated in its docstring and checked by the tests.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

from datasets import Dataset, DatasetDict

from rcpu_bench.paths import data_dir as default_data_dir

CHOICE_LABELS = "ABCDEFGH"


def read_split(paths: list[Path]) -> list[dict[str, Any]]:
    """The rows of one split: a JSON-lines file, optionally followed by a ``.lst`` file of integer labels.

    The ``.lst`` form is PIQA's original release (one 0/1 label per line, aligned with the rows); its
    labels become the rows' ``label`` field.
    """
    rows_file, *label_files = paths
    with open(rows_file, encoding="utf-8") as handle:
        rows = [json.loads(line) for line in handle if line.strip()]
    for label_file in label_files:
        labels = [int(line) for line in Path(label_file).read_text(encoding="utf-8").split()]
        if len(labels) != len(rows):
            raise ValueError(f"{label_file} has {len(labels)} labels for the {len(rows)} rows of {rows_file}")
        rows = [{**row, "label": label} for row, label in zip(rows, labels)]
    return rows


def read_local(data_files: dict[str, list[str]], data_dir: str | None = None, **_task_metadata: Any) -> DatasetDict:
    """lm-eval's ``custom_dataset``: each split's files, relative to ``data_dir``, as an in-memory dataset.

    ``data_dir`` defaults to ``rcpu_bench.paths.data_dir()``. lm-eval also passes the task's metadata
    (its version) as keyword arguments; they are not needed here.
    """
    root = Path(data_dir) if data_dir else default_data_dir()
    return DatasetDict({split: Dataset.from_list(read_split([root / f for f in files]))
                        for split, files in data_files.items()})


def strip_prefix(text: str, prefix: str) -> str:
    """``text`` without ``prefix``; a ValueError if it does not start with it."""
    if not text.startswith(prefix):
        raise ValueError(f"expected a document starting with {prefix!r}, got {text[:60]!r}")
    return text[len(prefix):]


def boolq_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """BoolQ passage / question / label from MosaicML's ``"Passage: <p>\\nQuestion: <q>?"`` query.

    Lossless except for one artefact of the Mosaic conversion: every " question" (either case) inside a
    passage became "\\nQuestion" (33 times in 22 passages; no " question" and no other newline is left
    in any passage). The space is restored and the word lower-cased, as the 30 mid-sentence uses read;
    the book title "Snakes in Question" (twice) and one sentence-initial "Questioned" come out in lower
    case, since the original case is lost.
    """
    passage, question = strip_prefix(doc["query"], "Passage: ").rsplit("\nQuestion: ", 1)
    return {"passage": passage.replace("\nQuestion", " question"), "question": question.removesuffix("?"),
            "label": doc["gold"]}


def choice_fields(choices: list[str], gold: int) -> dict[str, Any]:
    """ARC/OpenBookQA ``choices{text,label}`` and ``answerKey``, labelled A, B, C, ... in order.

    The original labels (A-E or 1-5) are gone from the Mosaic form; the prompts use only the choice
    texts and the index of the answer key, which these labels reproduce.
    """
    labels = list(CHOICE_LABELS[:len(choices)])
    return {"choices": {"text": list(choices), "label": labels}, "answerKey": labels[gold]}


def arc_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """ARC question / choices / answerKey from MosaicML's ``"Question: <q>"`` query (the id is not kept)."""
    return {"question": strip_prefix(doc["query"], "Question: "), **choice_fields(doc["choices"], doc["gold"])}


def openbookqa_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """OpenBookQA main question_stem / choices / answerKey (the main config has no fact; the id is not kept)."""
    return {"question_stem": doc["query"], **choice_fields(doc["choices"], doc["gold"])}


def winogrande_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """WinoGrande sentence / option1 / option2 / answer from MosaicML's partial-scoring form.

    Mosaic keeps each option already substituted into the text before the blank (``context_options``)
    and the text after it (``continuation``). The common prefix of the two contexts stands for the text
    before the blank, so ``sentence[:blank] + option`` rebuilds each context exactly and the text after
    the blank is the continuation; where both options start alike (e.g. "the bed" / "the blanket") the
    shared start lands in the prefix, so option1/option2 may be shorter than the originals.
    """
    first, second = doc["context_options"]
    prefix = os.path.commonprefix([first, second])
    return {"sentence": f"{prefix}_ {doc['continuation']}", "option1": first[len(prefix):],
            "option2": second[len(prefix):], "answer": str(doc["gold"] + 1)}


def _convert(dataset: Dataset, fields: Any) -> Dataset:
    """``dataset`` with every document replaced by ``fields(document)``."""
    return dataset.map(fields, remove_columns=dataset.column_names)


def boolq_docs(dataset: Dataset) -> Dataset:
    """``process_docs`` of rcpu_boolq: Mosaic BoolQ to the built-in's fields."""
    return _convert(dataset, boolq_fields)


def arc_docs(dataset: Dataset) -> Dataset:
    """``process_docs`` of rcpu_arc_easy / rcpu_arc_challenge: Mosaic ARC to the built-in's fields."""
    return _convert(dataset, arc_fields)


def openbookqa_docs(dataset: Dataset) -> Dataset:
    """``process_docs`` of rcpu_openbookqa: Mosaic OpenBookQA to the built-in's fields."""
    return _convert(dataset, openbookqa_fields)


def winogrande_docs(dataset: Dataset) -> Dataset:
    """``process_docs`` of rcpu_winogrande: Mosaic WinoGrande to the built-in's fields."""
    return _convert(dataset, winogrande_fields)


def winogrande_text(doc: dict[str, Any]) -> int:
    """The built-in's ``doc_to_text``: the index of the right context (several contexts, one continuation)."""
    return int(doc["answer"]) - 1


def winogrande_target(doc: dict[str, Any]) -> str:
    """The built-in's ``doc_to_target``: the sentence after the blank, stripped."""
    return doc["sentence"].split("_", 1)[1].strip()


def winogrande_choices(doc: dict[str, Any]) -> list[str]:
    """The built-in's ``doc_to_choice``: the sentence up to the blank with each option in it."""
    before = doc["sentence"].split("_", 1)[0]
    return [before + doc["option1"], before + doc["option2"]]


def hellaswag_clean(text: str) -> str:
    """The built-in HellaSwag text cleaning: strip, WikiHow " [title]" to ". ", drop [tags], one "  " to " "."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_fields(doc: dict[str, Any]) -> dict[str, Any]:
    """The built-in HellaSwag preprocessing: query from activity label and context, cleaned endings, gold."""
    context = f"{doc['ctx_a']} {doc['ctx_b'].capitalize()}"
    return {"query": hellaswag_clean(f"{doc['activity_label']}: {context}"),
            "choices": [hellaswag_clean(ending) for ending in doc["endings"]], "gold": int(doc["label"])}


def hellaswag_docs(dataset: Dataset) -> Dataset:
    """``process_docs`` of rcpu_hellaswag: original HellaSwag rows plus the built-in's query / choices / gold."""
    return dataset.map(hellaswag_fields)
