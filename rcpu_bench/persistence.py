"""Saving and reloading physically pruned models.

``from_pretrained`` cannot rebuild a model whose layers have different head or channel counts
(transformers #33225), so a pruned model is saved as a directory with

- ``model.safetensors``: the weights (tied embeddings stored once);
- ``config.json``: the original, unpruned config;
- ``rcpu_manifest.json``: the shape of every layer (query/kv heads, head size, intermediate size,
  o_proj/down_proj biases), the parameter count, the method and the provenance;
- the tokenizer files, when a tokenizer is given.

``load_pruned`` builds the unpruned model without weights (meta device), shrinks each layer to the
manifest's shape with the surgery functions, then loads the weights strictly; it needs nothing but
that directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from rcpu_bench.models import (LoadedModel, decoder_layers, head_counts, layer_geometries,
                               parameter_count, resolve_device, resolve_dtype)
from rcpu_bench.records import library_versions
from rcpu_bench.surgery import prune_attention, prune_mlp

FORMAT = "rcpu-bench-pruned"
FORMAT_VERSION = 1
SUPPORTED_VERSIONS = (1,)
MANIFEST = "rcpu_manifest.json"
WEIGHTS = "model.safetensors"


def layer_records(model: PreTrainedModel) -> list[dict[str, Any]]:
    """Per decoder layer: its geometry and whether o_proj / down_proj have a bias."""
    return [{**asdict(geometry), "o_proj_bias": layer.self_attn.o_proj.bias is not None,
             "down_proj_bias": layer.mlp.down_proj.bias is not None}
            for geometry, layer in zip(layer_geometries(model), decoder_layers(model))]


def build_manifest(model: PreTrainedModel, method: dict | None = None, provenance: dict | None = None) -> dict:
    """The manifest describing ``model``'s pruned shape."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": WEIGHTS,
            "parameter_count": parameter_count(model), "layers": layer_records(model),
            "method": method or {}, "provenance": provenance or {}, "saved_with": library_versions()}


def save_pruned(model: PreTrainedModel, directory: str | os.PathLike, *, tokenizer: Any = None,
                method: dict | None = None, provenance: dict | None = None, overwrite: bool = False) -> dict:
    """Save a (pruned) model to ``directory`` and return its manifest.

    Everything is written to a temporary directory beside ``directory`` and renamed into place at the
    end, so an interrupted save leaves no half-written model. An existing ``directory`` raises
    FileExistsError unless ``overwrite``.
    """
    target = Path(directory)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    manifest = build_manifest(model, method, provenance)
    text = json.dumps(manifest, indent=2)  # a non-JSON method/provenance fails before anything is written
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        save_model(model, str(staging / WEIGHTS), metadata={"format": "pt"})
        model.config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / MANIFEST).write_text(text)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _publish(staging: Path, target: Path) -> None:
    """Move the finished ``staging`` directory to ``target``, replacing what was there."""
    if target.exists():
        retired = staging.with_suffix(".old")
        target.rename(retired)
        staging.rename(target)
        shutil.rmtree(retired)
    else:
        staging.rename(target)


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a directory written by ``save_pruned``, checked for format and version."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} was not written by save_pruned "
                                "(load an unpruned checkpoint with rcpu_bench.models.load_model)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path} has format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                         f"supported: {FORMAT!r} version {', '.join(map(str, SUPPORTED_VERSIONS))}")
    return manifest


def _placeholder(linear: nn.Linear, *shape: int) -> Tensor:
    """A weightless (meta) tensor standing in for a compensated weight or bias while reshaping."""
    return torch.empty(linear.out_features, *shape, device="meta")


def _reshape_layer(layer: nn.Module, record: dict[str, Any]) -> None:
    """Shrink an unpruned layer to the manifest record's head and channel counts (weights are dummies)."""
    attn, mlp = layer.self_attn, layer.mlp
    n_heads, n_kv_heads = head_counts(attn, attn.head_dim)
    kept_kv_heads = torch.arange(record["n_kv_heads"])
    per_group = torch.arange(record["n_heads"] // record["n_kv_heads"])
    kept_heads = (kept_kv_heads[:, None] * (n_heads // n_kv_heads) + per_group).reshape(-1)
    o_bias = _placeholder(attn.o_proj) if record["o_proj_bias"] and attn.o_proj.bias is None else None
    prune_attention(attn, kept_heads, kept_kv_heads, _placeholder(attn.o_proj, len(kept_heads) * attn.head_dim), o_bias)
    down_bias = _placeholder(mlp.down_proj) if record["down_proj_bias"] and mlp.down_proj.bias is None else None
    prune_mlp(mlp, torch.arange(record["intermediate"]), _placeholder(mlp.down_proj, record["intermediate"]), down_bias)


def build_skeleton(config: PretrainedConfig, records: list[dict[str, Any]], dtype: torch.dtype) -> PreTrainedModel:
    """A weightless (meta) model of ``config`` whose layers have the shapes in ``records``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    layers = decoder_layers(model)
    if len(records) != len(layers):
        raise ValueError(f"{MANIFEST} describes {len(records)} layers but the config has {len(layers)}")
    for i, (layer, record) in enumerate(zip(layers, records)):
        try:
            _reshape_layer(layer, record)
        except (KeyError, ValueError, ZeroDivisionError) as error:
            raise ValueError(f"{MANIFEST} layer {i} {record} does not fit the config: {error}") from error
    built = layer_records(model)
    if built != records:
        bad = next(i for i, (a, b) in enumerate(zip(built, records)) if a != b)
        raise ValueError(f"{MANIFEST} layer {bad} is {records[bad]} but the config builds {built[bad]}")
    return model


def load_pruned(directory: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Rebuild a model saved by ``save_pruned``, in eval mode, from its directory alone.

    The weights are loaded strictly (every tensor present, shapes equal) and the parameter count is
    checked against the manifest's. The tokenizer is None when none was saved.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    config = AutoConfig.from_pretrained(directory)
    model = build_skeleton(config, manifest["layers"], resolve_dtype(dtype))
    return materialize(model, directory, manifest["weights"], manifest["parameter_count"], dtype=dtype, device=device,
                       method=manifest["method"], source=manifest["provenance"])


def materialize(skeleton: PreTrainedModel, directory: Path, weights: str, expected_count: int, *, dtype: str,
                device: str, **provenance: Any) -> LoadedModel:
    """Fill a weightless (meta) model of the saved shape from ``directory``: strict load, parameter count checked.

    Shared by every saved-model format (ours and the model-method plugins'); ``provenance`` joins the record.
    """
    torch_device = resolve_device(device)
    skeleton.to_empty(device=torch_device)
    skeleton.init_weights()  # computes the non-persistent buffers (RoPE inv_freq) and re-ties the embeddings
    load_model(skeleton, directory / weights, strict=True, device=str(torch_device))
    count = parameter_count(skeleton)
    if count != expected_count:
        raise ValueError(f"the rebuilt model has {count} parameters; the manifest says {expected_count}")
    tokenizer = AutoTokenizer.from_pretrained(directory) if (directory / "tokenizer_config.json").is_file() else None
    info = {"name_or_path": str(directory), "dtype": dtype, "device": device,
            "config_class": type(skeleton.config).__name__, "model_class": type(skeleton).__name__,
            "parameter_count": count, **provenance}
    return LoadedModel(skeleton.eval(), tokenizer, info)


def load_saved(directory: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu",
               registry: Any = None) -> LoadedModel:
    """Load a directory written by ``save_pruned`` or by a whole-model method's saver (named in its manifest)."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a saved pruned model")
    manifest = json.loads(path.read_text())
    if manifest.get("format") == FORMAT or "model_method" not in manifest:
        return load_pruned(directory, dtype=dtype, device=device)
    from rcpu_bench.registry import default_registry  # the registry imports the plugins, which import this module

    method = (registry or default_registry()).get("model-method", manifest["model_method"])
    if method.load is None:
        raise ValueError(f"the model method {method.name!r} ({method.provider}) registered no load function")
    return method.load(directory, dtype=dtype, device=device)
