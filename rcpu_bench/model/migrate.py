"""Saved pruned models written by earlier rcpu-bench releases, brought to today's format (``rcpu-bench migrate``).

This module is the one place that knows the history of the saved format; ``load_pruned`` reads today's (manifest
format 4) alone and refuses an older directory, naming this command. The earlier formats:

1. the original, unpruned config (manifest ``config`` absent or ``"original"``), each layer shrunk on load to the
   manifest's head and channel counts;
2. a ``LlamaConfig`` with the pruned counts (``"llama"``), or the Llama-only per-layer ``RcpuLlamaConfig``
   (``"rcpu_llama"``, per-layer lists and o_proj / down_proj bias flags);
3. today's configs (``"family"``, ``"per_layer"``) without the checksum of config.json.

A directory is migrated by loading it as its format describes (the weights checked against their recorded sha256,
when there is one, strictly loaded, the parameter count checked) and saving the model again with ``save_pruned``
over it, atomically: today's config, manifest (the same method and provenance) and checksums, the tokenizer. The
model card is written anew; the run's perplexities it showed are not in the directory, so it says they were not
recorded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig, PreTrainedModel

from rcpu_bench.model.adapter import model_view
from rcpu_bench.model.hf_format import PER_LAYER, RcpuPrunedConfig
from rcpu_bench.model.loading import LoadedModel, dtype_argument
from rcpu_bench.model.manifest import (
    CONFIG,
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    layer_records,
    read_json_manifest,
    saved_by_model_method,
    verify_checksum,
    weights_file,
)
from rcpu_bench.model.persistence import build_skeleton, materialize, save_pruned
from rcpu_bench.model.views import MODULES, LayerView

EARLIER_VERSIONS = (1, 2, 3)
EARLIER_CONFIGS = ("original", "llama", "rcpu_llama", "family", "per_layer")


def migrate_saved(directory: str | Path, *, dry_run: bool = False) -> int | None:
    """Rewrite a ``save_pruned`` directory of an earlier format in today's; returns the format it had, or None when it
    is today's already (``dry_run``: only say which). ValueError for a directory that is not ``save_pruned``'s."""
    directory = Path(directory)
    path = directory / MANIFEST
    manifest = read_json_manifest(path)
    if saved_by_model_method(manifest):
        raise ValueError(f"{directory} was saved by the model method {manifest['model_method']!r} in its own format; "
                         "allowed: a directory written by save_pruned")
    version = manifest.get("format_version")
    if manifest.get("format") != FORMAT or version not in (*EARLIER_VERSIONS, FORMAT_VERSION):
        raise ValueError(f"{path} has format {manifest.get('format')!r} version {version!r}; allowed: {FORMAT!r} "
                         f"version {', '.join(map(str, (*EARLIER_VERSIONS, FORMAT_VERSION)))}")
    if version == FORMAT_VERSION:
        return None
    if not dry_run:
        loaded = load_earlier(directory, manifest)
        save_pruned(loaded.model, directory, tokenizer=loaded.tokenizer, method=manifest.get("method"),
                    provenance=manifest.get("provenance"), overwrite=True)
    return version


def load_earlier(directory: Path, manifest: dict[str, Any]) -> LoadedModel:
    """The model of a directory of an earlier format (module docstring), on the CPU in float32, checked as it loads."""
    kind = manifest.get("config", "original")
    if kind not in EARLIER_CONFIGS:
        raise ValueError(f"{directory / MANIFEST} has config {kind!r}; allowed: {', '.join(EARLIER_CONFIGS)}")
    checksums = manifest.get("sha256") or {}
    if CONFIG in checksums:
        verify_checksum(directory / CONFIG, checksums[CONFIG])
    if kind == "rcpu_llama":
        config: PretrainedConfig = format_2_per_layer_config(json.loads((directory / CONFIG).read_text()))
    else:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
    if (kind in ("per_layer", "rcpu_llama")) != isinstance(config, RcpuPrunedConfig):
        raise ValueError(f"{directory / MANIFEST} says config {kind!r} but config.json is a {type(config).__name__}")
    records = manifest["layers"]
    skeleton = (reshaped_skeleton(config, records) if kind == "original"
                else build_skeleton(config, records, torch.float32))
    weights = weights_file(directory, manifest.get("weights")).relative_to(directory).as_posix()  # inside it
    return materialize(skeleton, directory, weights, manifest["parameter_count"], dtype="float32", device="cpu",
                       sha256=checksums.get(weights), method=manifest.get("method"), source=manifest.get("provenance"))


def format_2_per_layer_config(saved: dict[str, Any]) -> RcpuPrunedConfig:
    """Format 2's ``RcpuLlamaConfig`` (a Llama config plus per-layer head and channel lists and o_proj /
    down_proj bias flags) as the ``RcpuPrunedConfig`` that builds the same model."""
    saved = dict(saved)
    biases = [[name for name, flag in (("self_attn.o_proj", o_bias), ("mlp.down_proj", down_bias)) if flag]
              for o_bias, down_bias in zip(saved.pop("layer_o_proj_bias"), saved.pop("layer_down_proj_bias"),
                                           strict=True)]
    per_layer = {name: saved.pop(name) for name in PER_LAYER[:3]}
    base = {k: v for k, v in saved.items() if k not in ("architectures", "auto_map", "transformers_version")}
    return RcpuPrunedConfig(base_config={**base, "model_type": "llama"}, **per_layer, layer_added_biases=biases)


def reshaped_skeleton(config: PretrainedConfig, records: list[dict[str, Any]]) -> PreTrainedModel:
    """Format 1: a weightless (meta) model of the unpruned ``config``, each layer shrunk to its manifest record and
    then checked against it."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **dtype_argument(torch.float32))
    layers = model_view(model).views()
    if len(records) != len(layers):
        raise ValueError(f"{MANIFEST} describes {len(records)} layers but the config has {len(layers)}")
    for i, (layer, record) in enumerate(zip(layers, records, strict=True)):
        try:
            _reshape_layer(layer, record)
        except (KeyError, ValueError, ZeroDivisionError) as error:
            raise ValueError(f"{MANIFEST} layer {i} {record} does not fit the config: {error}") from error
    built = layer_records(model)
    if built != records:
        bad = next(i for i, (a, b) in enumerate(zip(built, records, strict=True)) if a != b)
        raise ValueError(f"{MANIFEST} layer {bad} is {records[bad]} but the config builds {built[bad]}")
    return model


def _reshape_layer(view: LayerView, record: dict[str, Any]) -> None:
    """Shrink an unpruned layer to the manifest record's head and channel counts (weights are dummies)."""
    geometry = view.geometry
    kept_kv_heads = torch.arange(record["n_kv_heads"])
    per_group = torch.arange(record["n_heads"] // record["n_kv_heads"])
    kept_heads = (kept_kv_heads[:, None] * geometry.queries_per_group + per_group).reshape(-1)
    kept_channels = torch.arange(record["intermediate"])
    widths = {"attention": len(kept_heads) * geometry.head_dim, "mlp": len(kept_channels)}
    weight: dict[str, Tensor] = {}
    bias: dict[str, Tensor | None] = {}
    for module in MODULES:
        consumer = view.projection(module)
        weight[module] = torch.empty(consumer.out_features, widths[module], device="meta")
        needed = record[view.bias_key(module)] and consumer.bias is None
        bias[module] = torch.empty(consumer.out_features, device="meta") if needed else None
    view.prune_heads(kept_heads, kept_kv_heads, weight["attention"], bias["attention"])
    view.prune_channels(kept_channels, weight["mlp"], bias["mlp"])
