"""The model card of a saved pruned model: a ``README.md`` in the Hugging Face Hub's convention.

YAML front matter (what the Hub and ``huggingface_hub.ModelCard`` read): ``base_model`` (the hub id of the model
it was pruned from, where known), ``license`` (the source's, where known), ``library_name: transformers``,
``pipeline_tag`` and ``tags``. Then the card: the recipe (the ``rcpu-bench prune`` command that reproduces it, with
its calibration and seed), the parameter counts, the evaluation beside the dense model (recovery = dense perplexity
÷ pruned perplexity, 100 % when pruning cost nothing), the format and how to load it, and the harness version.
"""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import yaml

from rcpu_bench.records import Record
from rcpu_bench.version import __version__

TITLE = "# Pruned model (rcpu-bench)"
# The hub ids of the real models the harness converts (rcpu_bench.model.real_models), for ``base_model``.
BASE_MODELS = {"smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct", "gemma3-270m": "google/gemma-3-270m"}
LOADING = {
    "family": ["`family`: config.json is the model family's own config (model_type `{family}`) with the pruned head "
               "and channel counts, because every layer was pruned alike.",
               "Load with `AutoModelForCausalLM.from_pretrained(directory)`: no remote code."],
    "per_layer": ["`per_layer`: the layers have their own widths (or a bias the family lacks), which the family's own "
                  "config cannot describe, so config.json is an `RcpuPrunedConfig`: the family's config (model_type "
                  "`{family}`) plus per-layer counts.",
                  "Load with `AutoModelForCausalLM.from_pretrained(directory)` after `import rcpu_bench.model` (which "
                  "registers the format: no remote code, no prompt), or without rcpu-bench with "
                  "`trust_remote_code=True` (transformers runs `modeling_rcpu_pruned.py` from this directory)."],
}
RECIPE_FLAGS = (("scorer", "--scorer"), ("compensator", "--compensator"), ("ratio", "--ratio"),
                ("rounding", "--rounding"), ("gqa_rule", "--gqa-rule"), ("statistics", "--statistics"),
                ("structure", "--structure"), ("allocation", "--allocation"), ("model_method", "--model-method"))


def front_matter(manifest: dict[str, Any]) -> dict[str, Any]:
    """The card's metadata: base model and license where the source says them, the library, the task and tags."""
    provenance = manifest.get("provenance") or {}
    real = provenance.get("real_model") or {}
    source: Any = real.get("name") or provenance.get("name_or_path")  # a JSON value, unchecked
    method = manifest.get("method") or {}
    meta: dict[str, Any] = {}
    base = BASE_MODELS.get(source) or (source if _hub_id(source) else None)
    if base:
        meta["base_model"] = base
    if real.get("license"):
        meta["license"] = real["license"]
    meta["library_name"] = "transformers"
    meta["pipeline_tag"] = "text-generation"
    meta["tags"] = ["rcpu-bench", "pruned", "structured-pruning",
                    *(str(method[key]) for key in ("scorer", "compensator", "model_method") if method.get(key))]
    return meta


def _hub_id(name: Any) -> bool:
    return isinstance(name, str) and name.count("/") == 1 and not name.startswith((".", "/", "~"))


def source_name(provenance: dict[str, Any]) -> Any:
    """The model pruned, as the card names it: a real model's name, a Hub id, or a local directory's own name (never
    its path on the machine that pruned it); None when not recorded."""
    source: Any = (provenance.get("real_model") or {}).get("name") or provenance.get("name_or_path")
    if isinstance(source, str) and not _hub_id(source) and ("/" in source or "\\" in source):
        return Path(source).name
    return source


def recipe_command(manifest: dict[str, Any], record: Record | None) -> str | None:
    """The ``rcpu-bench prune`` command that reproduces the model (None when neither source nor method is known)."""
    provenance, method = manifest.get("provenance") or {}, manifest.get("method") or {}
    source = source_name(provenance)
    if not source or not method:
        return None
    words = ["rcpu-bench", "prune", "--model", source]
    for key, flag in RECIPE_FLAGS:
        if method.get(key) is not None and not (key == "allocation" and method[key] == "uniform"):
            words += [flag, str(method[key])]
    if method.get("prune") and tuple(method["prune"]) != ("attention", "mlp"):
        words += ["--prune", ",".join(method["prune"])]
    for key, flag in (("scorer_params", "--scorer-param"), ("compensator_params", "--compensator-param")):
        words += [part for name, value in (method.get(key) or {}).items() for part in (flag, f"{name}={value!r}")]
    calib = record.experiment.get("calib") if record is not None else None
    if calib:
        words += ["--calib", calib]
    return shlex.join(words)


def evaluation_rows(record: Record) -> list[str]:
    """Markdown rows: each perplexity profile, pruned beside dense (when the run measured the dense model too)."""
    dense = {p.profile: p.ppl for p in record.dense_perplexity or ()}
    rows = []
    for entry in record.perplexity:
        before = dense.get(entry.profile)
        recovery = f"{100 * before / entry.ppl:.1f} %" if before else "not measured"
        rows.append(f"| {entry.profile} | {entry.dataset} | {entry.ppl:.4f} | "
                    f"{f'{before:.4f}' if before else 'not measured'} | {recovery} | "
                    f"{entry.n_windows} × {entry.seqlen} |")
    return rows


def model_card(manifest: dict[str, Any], record: Record | None = None) -> str:
    """The README.md of a saved model (module docstring). The calibration, the parameter counts before pruning and
    the evaluation come from the experiment's result ``record`` when one is given; without it the card says they were
    not recorded."""
    provenance, method = manifest.get("provenance") or {}, manifest.get("method") or {}
    real = provenance.get("real_model") or {}
    source = source_name(provenance)
    weights = f" ({real['title']}, {real['weights']} from {real['package']} {real['package_version']})" if real else ""
    local = " (a local directory)" if source != provenance.get("name_or_path") and not real else ""
    lines = ["---", yaml.safe_dump(front_matter(manifest), sort_keys=False).rstrip(), "---", TITLE, "",
             f"Pruned from `{source or 'not recorded'}`{local}{weights} by rcpu-bench {__version__}.", "",
             "## Recipe", ""]
    command = recipe_command(manifest, record)
    lines += [f"```bash\n{command}\n```", ""] if command else ["Not recorded (saved without a method).", ""]
    named = [("model method", "model_method"), ("scorer", "scorer"), ("compensator", "compensator"),
             ("ratio", "ratio"), ("structure", "structure"), ("statistics", "statistics")]
    lines += ["| | |", "|---|---|", *(f"| {label} | `{method[key]}` |" for label, key in named
                                      if method.get(key) is not None)]
    calibration = record.calibration if record is not None else None
    lines.append(f"| calibration | {_calibration_text(calibration) if calibration else 'not recorded'} |")
    before = record.parameters.before if record is not None else None
    count = f"{manifest['parameter_count']:,}" + (f" (of {before:,} before pruning)" if before else "")
    lines += [f"| parameters | {count} |", "", "## Evaluation", ""]
    rows = evaluation_rows(record) if record is not None else []
    if rows:
        lines += ["| profile | dataset | perplexity | dense | recovery | windows × length |",
                  "|---|---|---|---|---|---|", *rows]
    else:
        lines.append("Not recorded (saved without an experiment record).")
    family = manifest.get("model_type")
    lines += ["", "## Format and loading", "", *(text.format(family=family) for text in LOADING[manifest["config"]]),
              "", "Also `rcpu_bench.model.persistence.load_pruned(directory)`. Per-layer shapes, provenance and "
              "checksums: `rcpu_manifest.json`.", ""]
    return "\n".join(lines)


def _calibration_text(calibration: dict[str, Any]) -> str:
    """One line of a calibration provenance record: source and split, windows × length, seed."""
    return (f"{calibration.get('source')}/{calibration.get('split')}: {calibration.get('n_samples')} × "
            f"{calibration.get('seqlen')} tokens, seed {calibration.get('seed')}")
