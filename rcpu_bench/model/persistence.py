"""Saving and reloading physically pruned models, in a directory any transformers install can load.

A pruned model is saved as a directory with

- ``model.safetensors``: the weights (tied embeddings stored once);
- ``config.json``: the pruned model's config, as its family (``rcpu_bench.model.adapter``) writes it; for
  the Llama family a plain ``LlamaConfig`` when every layer has the same
  head and channel counts, no bias beyond the original config's, and a head count dividing the hidden
  size (transformers 5 rejects a LlamaConfig otherwise): then ``AutoModelForCausalLM.from_pretrained``
  loads it as it is. Otherwise an ``RcpuLlamaConfig`` with per-layer widths and biases, whose
  ``auto_map`` names the configuration and modeling source written beside it (``rcpu_bench.model.hf_format``,
  which explains why remote code and not transformers' own per-layer configuration), so that
  ``from_pretrained(directory, trust_remote_code=True)`` loads it. A non-Llama model (Mistral, Qwen2, ...)
  keeps its original config and loads through ``load_pruned`` only (the manifest says ``"config":
  "original"``);
- ``rcpu_manifest.json``: the shape of every layer (query/kv heads, head size, intermediate size,
  o_proj/down_proj biases), the parameter count, the kind of config written, the method and the provenance;
- ``README.md``: a model card (method, ratio, calibration, parameter count, perplexities);
- the tokenizer files, when a tokenizer is given.

``load_pruned`` builds the model without weights (meta device) from config.json, checks each layer
against the manifest, then loads the weights strictly; it needs nothing but that directory, and also
reads format version 1 (written before version 2: the original config, which it shrinks layer by
layer with the surgery functions).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from rcpu_bench.model.adapter import model_view
from rcpu_bench.model.hf_format import RcpuLlamaConfig, RcpuLlamaForCausalLM, write_source
from rcpu_bench.model.loading import (
    LoadedModel,
    dtype_argument,
    load_config,
    load_model,
    model_source,
    parameter_count,
    resolve_device,
    resolve_dtype,
)
from rcpu_bench.model.views import MODULES, LayerView
from rcpu_bench.records import library_versions

FORMAT = "rcpu-bench-pruned"
FORMAT_VERSION = 2
SUPPORTED_VERSIONS = (1, 2)
MANIFEST = "rcpu_manifest.json"
WEIGHTS = "model.safetensors"
CARD = "README.md"
CONFIG_KINDS = ("llama", "rcpu_llama", "original")


def layer_records(model: PreTrainedModel) -> list[dict[str, Any]]:
    """Per decoder layer: its geometry and whether its attention / MLP consumers (o_proj, down_proj) have a bias."""
    return [{**asdict(view.geometry), **{view.bias_key(m): view.projection(m).bias is not None for m in MODULES}}
            for view in model_view(model).views()]


def build_manifest(model: PreTrainedModel, method: dict | None = None, provenance: dict | None = None,
                   config_kind: str = "original") -> dict:
    """The manifest describing ``model``'s pruned shape and the kind of config.json saved with it."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": WEIGHTS, "config": config_kind,
            "parameter_count": parameter_count(model), "layers": layer_records(model),
            "method": method or {}, "provenance": provenance or {}, "saved_with": library_versions()}


def model_card(manifest: dict, record: dict | None = None) -> str:
    """The README.md of a saved model: method, ratio, calibration, parameter count and perplexities.

    The calibration, the parameter counts before pruning and the perplexities come from the experiment's
    result ``record`` when one is given; without it the card says they were not recorded.
    """
    record = record or {}
    method = manifest["method"]
    source = manifest["provenance"].get("name_or_path", "not recorded")
    loading = {"llama": "`AutoModelForCausalLM.from_pretrained(directory)` (a plain Llama config)",
               "rcpu_llama": "`AutoModelForCausalLM.from_pretrained(directory, trust_remote_code=True)`: the "
                             "layers have their own widths, built by `modeling_rcpu_llama.py` in this directory",
               "original": "`rcpu_bench.model.persistence.load_pruned(directory)` only (not a Llama config)"}
    lines = ["# Pruned model (rcpu-bench)", "", f"Pruned from `{source}` by rcpu-bench.", "",
             "| | |", "|---|---|"]
    named = [("model method", "model_method"), ("scorer", "scorer"), ("compensator", "compensator"),
             ("ratio", "ratio"), ("structure", "structure"), ("statistics", "statistics")]
    lines += [f"| {label} | `{method[key]}` |" for label, key in named if method.get(key) is not None]
    calibration = record.get("calibration")
    lines.append(f"| calibration | {_calibration_text(calibration) if calibration else 'not recorded'} |")
    before = record.get("parameters", {}).get("before")
    count = f"{manifest['parameter_count']:,}" + (f" (of {before:,} before pruning)" if before else "")
    lines += [f"| parameters | {count} |", "", "## Perplexity", ""]
    ppl = record.get("perplexity") or []
    if ppl:
        lines += ["| profile | dataset | perplexity | windows × length |", "|---|---|---|---|"]
        lines += [f"| {p['profile']} | {p.get('dataset')} | {p['ppl']:.4f} | {p.get('n_windows')} × {p.get('seqlen')} |"
                  for p in ppl]
    else:
        lines.append("Not recorded (saved without an experiment record).")
    lines += ["", "## Loading", "", (f"Load with {loading[manifest['config']]}, or with "
                                      "`rcpu_bench.model.persistence.load_pruned(directory)`. Per-layer shapes and "
                                      f"provenance: `{MANIFEST}`."), ""]
    return "\n".join(lines)


def _calibration_text(calibration: dict) -> str:
    """One line of a calibration provenance record: source and split, windows × length, seed."""
    return (f"{calibration.get('source')}/{calibration.get('split')}: {calibration.get('n_samples')} × "
            f"{calibration.get('seqlen')} tokens, seed {calibration.get('seed')}")


def save_pruned(model: PreTrainedModel, directory: str | os.PathLike, *, tokenizer: Any = None,
                method: dict | None = None, provenance: dict | None = None, record: dict | None = None,
                overwrite: bool = False) -> dict:
    """Save a (pruned) model to ``directory`` (atomically, see ``write_atomically``) and return its manifest.

    ``record`` (the experiment's result record) supplies the model card's calibration and perplexities.
    """
    kind, config = model_view(model).saved_config(layer_records(model))
    manifest = build_manifest(model, method, provenance, kind)
    text = json.dumps(manifest, indent=2)  # a non-JSON method/provenance fails before anything is written
    card = model_card(manifest, record)

    def write(staging: Path) -> None:
        save_file(unique_tensors(model), str(staging / WEIGHTS), metadata={"format": "pt"})
        config.save_pretrained(staging)
        if kind == "rcpu_llama":
            write_source(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        (staging / MANIFEST).write_text(text)
        (staging / CARD).write_text(card)

    write_atomically(directory, write, overwrite=overwrite)
    return manifest


def unique_tensors(model: nn.Module) -> dict[str, Tensor]:
    """The state dict with each shared tensor (tied embeddings) once, under its first name.

    The first name is the input embeddings', as transformers writes it: transformers 4 fills a tied LM
    head from the embeddings but not the reverse, so a file holding only ``lm_head.weight`` (what
    safetensors' ``save_model`` may keep) loads with the embeddings left on the meta device.
    """
    seen: set[int] = set()
    tensors = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            tensors[name] = tensor.detach().contiguous()
    return tensors


def write_atomically(directory: str | os.PathLike, write: Callable[[Path], None], *, overwrite: bool = False) -> None:
    """Have ``write(staging)`` fill a temporary directory beside ``directory``, then rename it into place.

    An interrupted or failing write leaves nothing behind (and an existing ``directory`` untouched); an
    existing ``directory`` raises FileExistsError unless ``overwrite`` or it is an empty directory (which
    ``Experiment.validate`` accepts for ``--save``, so the save after all the work must too). Every saver uses this.
    """
    target = Path(directory)
    if target.exists() and not overwrite and not (target.is_dir() and not any(target.iterdir())):
        raise FileExistsError(f"{target} already exists; pass overwrite=True to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        write(staging)
        _publish(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


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
                                "(load an unpruned checkpoint with rcpu_bench.model.loading.load_model)")
    manifest = json.loads(path.read_text())
    if manifest.get("format") != FORMAT or manifest.get("format_version") not in SUPPORTED_VERSIONS:
        raise ValueError(f"{path} has format {manifest.get('format')!r} version {manifest.get('format_version')!r}; "
                         f"supported: {FORMAT!r} version {', '.join(map(str, SUPPORTED_VERSIONS))}")
    return manifest


def _placeholder(linear: nn.Linear, *shape: int) -> Tensor:
    """A weightless (meta) tensor standing in for a compensated weight or bias while reshaping."""
    return torch.empty(linear.out_features, *shape, device="meta")


def _reshape_layer(view: LayerView, record: dict[str, Any]) -> None:
    """Shrink an unpruned layer to the manifest record's head and channel counts (weights are dummies)."""
    geometry = view.geometry
    kept_kv_heads = torch.arange(record["n_kv_heads"])
    per_group = torch.arange(record["n_heads"] // record["n_kv_heads"])
    kept_heads = (kept_kv_heads[:, None] * geometry.queries_per_group + per_group).reshape(-1)
    kept_channels = torch.arange(record["intermediate"])
    weights = {"attention": len(kept_heads) * geometry.head_dim, "mlp": len(kept_channels)}
    weight, bias = {}, {}
    for module in MODULES:
        consumer = view.projection(module)
        weight[module] = _placeholder(consumer, weights[module])
        bias[module] = _placeholder(consumer) if record[view.bias_key(module)] and consumer.bias is None else None
    view.prune_heads(kept_heads, kept_kv_heads, weight["attention"], bias["attention"])
    view.prune_channels(kept_channels, weight["mlp"], bias["mlp"])


def build_skeleton(config: PretrainedConfig, records: list[dict[str, Any]], dtype: torch.dtype, *,
                   reshape: bool) -> PreTrainedModel:
    """A weightless (meta) model of ``config`` whose layers must have the shapes in ``records``.

    ``reshape``: ``config`` is the unpruned one (format 1, or a non-Llama model), so each layer is first
    shrunk to its record; else ``config`` already describes the pruned layers. Either way the built
    layers are checked against ``records``.
    """
    with torch.device("meta"):
        if isinstance(config, RcpuLlamaConfig):  # not registered with the Auto classes: no global side effect
            model = RcpuLlamaForCausalLM._from_config(config, **dtype_argument(dtype))
        else:
            model = AutoModelForCausalLM.from_config(config, **dtype_argument(dtype))
    layers = model_view(model).views()
    if len(records) != len(layers):
        raise ValueError(f"{MANIFEST} describes {len(records)} layers but the config has {len(layers)}")
    for i, (layer, record) in enumerate(zip(layers, records, strict=True) if reshape else ()):
        try:
            _reshape_layer(layer, record)
        except (KeyError, ValueError, ZeroDivisionError) as error:
            raise ValueError(f"{MANIFEST} layer {i} {record} does not fit the config: {error}") from error
    built = layer_records(model)
    if built != records:
        bad = next(i for i, (a, b) in enumerate(zip(built, records, strict=True)) if a != b)
        raise ValueError(f"{MANIFEST} layer {bad} is {records[bad]} but the config builds {built[bad]}")
    return model


def load_pruned(directory: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Rebuild a model saved by ``save_pruned`` (format 1 or 2), in eval mode, from its directory alone.

    The weights are loaded strictly (every tensor present, shapes equal) and the parameter count is
    checked against the manifest's. The tokenizer is None when none was saved.
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    kind = manifest.get("config", "original")  # format 1 saved the original config
    if kind not in CONFIG_KINDS:
        raise ValueError(f"{directory / MANIFEST} has config {kind!r}; allowed: {', '.join(CONFIG_KINDS)}")
    config = (RcpuLlamaConfig if kind == "rcpu_llama" else AutoConfig).from_pretrained(directory)
    model = build_skeleton(config, manifest["layers"], resolve_dtype(dtype), reshape=kind == "original")
    return materialize(model, directory, manifest["weights"], manifest["parameter_count"], dtype=dtype, device=device,
                       method=manifest["method"], source=manifest["provenance"])


def materialize(skeleton: PreTrainedModel, directory: Path, weights: str, expected_count: int, *, dtype: str,
                device: str, **provenance: Any) -> LoadedModel:
    """Fill a weightless (meta) model of the saved shape from ``directory``: strict load, parameter count checked.

    Shared by every saved-model format (ours and the model-method plugins'); ``provenance`` joins the record.
    """
    torch_device = resolve_device(device)
    skeleton.to_empty(device=torch_device)
    skeleton.init_weights()  # re-ties the embeddings (the weights themselves are overwritten below)
    recompute_rotary(skeleton)
    load_weights(skeleton, directory / weights, strict=True, device=str(torch_device))
    count = parameter_count(skeleton)
    if count != expected_count:
        raise ValueError(f"the rebuilt model has {count} parameters; the manifest says {expected_count}")
    tokenizer = AutoTokenizer.from_pretrained(directory) if (directory / "tokenizer_config.json").is_file() else None
    info = {"name_or_path": str(directory), "dtype": dtype, "device": device,
            "config_class": type(skeleton.config).__name__, "model_class": type(skeleton).__name__,
            "parameter_count": count, **provenance}
    return LoadedModel(skeleton.eval(), tokenizer, info)


def recompute_rotary(model: nn.Module) -> None:
    """Recompute the non-persistent buffers (RoPE ``inv_freq``) of every rotary-embedding module in place.

    ``to_empty`` leaves buffers uninitialised and they are not in the weights file. transformers 5's
    ``init_weights`` recomputes them, 4.x's does not (under 4.57 the reloaded logits were off by up to
    2.5 without an error), so each module is rebuilt from its own config by its own constructor, on its
    device, and its buffers copied in, keeping each buffer's dtype.
    """
    for module in model.modules():
        if not type(module).__name__.endswith("RotaryEmbedding") or not hasattr(module, "config"):
            continue
        device = next(module.buffers()).device
        with torch.device(device):
            fresh = type(module)(module.config)
        for name, buffer in fresh.named_buffers(recurse=False):
            getattr(module, name).copy_(buffer)
        if hasattr(fresh, "attention_scaling"):
            module.attention_scaling = fresh.attention_scaling


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


def pruned_directory(name: str) -> Path | None:
    """``name`` as a directory written by ``save_pruned`` (it has a manifest), or None."""
    path = Path(name).expanduser()
    return path if (path / MANIFEST).is_file() else None


def check_model_argument(name: str, revision: str | None) -> None:
    """Reject a missing path, a pruned directory without tokenizer, or an unsupported model, before loading."""
    directory = pruned_directory(model_source(name))
    if directory is None:
        load_config(name, revision)
        return
    read_manifest(directory)
    if not (directory / "tokenizer_config.json").is_file():
        raise ValueError(f"{directory} has no tokenizer (save_pruned was called without one)")


def load_saved_or_model(name: str, *, revision: str | None, dtype: str, device: str) -> LoadedModel:
    """``load_saved`` for a directory written by save_pruned (or a model method), else ``load_model``."""
    directory = pruned_directory(name)
    if directory is not None:
        return load_saved(directory, dtype=dtype, device=device)
    return load_model(name, dtype=dtype, device=device, revision=revision)
