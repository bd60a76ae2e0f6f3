"""Saving and reloading sliced models.

A sliced model is saved as a directory with

- ``model.safetensors``: the weights (the LM head untied from the embeddings);
- ``config.json``: the dense model's config, with ``tie_word_embeddings`` false;
- ``slicegpt_config.json``: the residual widths of every layer (``SlicePlan``), the parameter count
  and the slicing report;
- ``rcpu_manifest.json``: ``{"format": "rcpu-slicegpt", "model_method": "slicegpt"}``, which lets
  ``rcpu_bench.model.load_saved`` (given ``rcpu_bench.default_registry()``, as ``rcpu-bench eval`` does) find this
  plugin's loader;
- the tokenizer files, when a tokenizer is given.

``load_sliced`` builds the dense model from ``config.json`` without weights (meta device), gives it the
sliced structure of the slicing config, then loads the weights strictly: it needs nothing but that directory.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_model
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
)

from rcpu_bench import library_versions
from rcpu_bench.model import (
    MANIFEST,
    LoadedModel,
    dtype_argument,
    file_sha256,
    layer_view,
    materialize,
    model_view,
    parameter_count,
    recorded_sha256,
    resolve_dtype,
    write_atomically,
)
from rcpu_slicegpt.layers import (
    RMSN,
    LayerDims,
    SlicedDecoderLayer,
    SlicePlan,
    set_weight,
)
from rcpu_slicegpt.slicing import check_supported

FORMAT = "rcpu-slicegpt"
FORMAT_VERSION = 1
SLICING_CONFIG = "slicegpt_config.json"
WEIGHTS = "model.safetensors"


def slice_plan(model: nn.Module) -> SlicePlan:
    """The residual widths of a sliced model, read from its layers."""
    layers = model_view(model).layers
    if not all(isinstance(layer, SlicedDecoderLayer) for layer in layers):
        raise ValueError(f"{type(model).__name__} is not sliced: its layers are not SlicedDecoderLayer")
    return SlicePlan(model.config.hidden_size, tuple(layer.dims for layer in layers))


def save_sliced(model: PreTrainedModel, directory: str | os.PathLike, *, tokenizer: Any = None,
                report: dict | None = None, overwrite: bool = False) -> dict:
    """Save a sliced model to ``directory`` and return its slicing config (a JSON-able ``report`` is kept in it).

    Written atomically by ``rcpu_bench.model.persistence.write_atomically``: an interrupted save leaves nothing,
    and an existing ``directory`` raises FileExistsError unless ``overwrite`` (which replaces it whole).
    """
    plan = slice_plan(model)
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": WEIGHTS,
              "hidden_size": plan.hidden_size, "layers": [asdict(dims) for dims in plan.layers],
              "parameter_count": parameter_count(model), "report": report or {}, "saved_with": library_versions()}
    json.dumps(config)  # a non-JSON report fails before anything is written

    def write(staging: Path) -> None:
        save_model(model, str(staging / WEIGHTS), metadata={"format": "pt"})
        model.config.save_pretrained(staging)
        if tokenizer is not None:
            tokenizer.save_pretrained(staging)
        config["sha256"] = {WEIGHTS: file_sha256(staging / WEIGHTS)}  # verified by materialize when loading
        (staging / SLICING_CONFIG).write_text(json.dumps(config, indent=2))
        (staging / MANIFEST).write_text(json.dumps({"format": FORMAT, "format_version": FORMAT_VERSION,
                                                    "model_method": "slicegpt"}))

    write_atomically(directory, write, overwrite=overwrite)
    return config


def read_slicing_config(directory: str | os.PathLike) -> dict:
    """The slicing config of a directory written by ``save_sliced``, checked for format and version."""
    path = Path(directory) / SLICING_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} was not written by save_sliced")
    config = json.loads(path.read_text())
    if config.get("format") != FORMAT or config.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format {config.get('format')!r} version {config.get('format_version')!r}; "
                         f"supported: {FORMAT!r} version {FORMAT_VERSION}")
    return config


def _placeholder(*shape: int) -> torch.Tensor:
    """A weightless (meta) tensor standing in for a sliced weight while the structure is built."""
    return torch.empty(*shape, device="meta")


def _resize(linear: nn.Linear, *, in_features: int | None = None, out_features: int | None = None) -> None:
    """Give a meta linear its sliced shape (its residual-facing side replaced)."""
    n_out = linear.out_features if out_features is None else out_features
    n_in = linear.in_features if in_features is None else in_features
    set_weight(linear, _placeholder(n_out, n_in), None if linear.bias is None else _placeholder(n_out))


def _sliced_layer(layer: nn.Module, dims: LayerDims, config: PretrainedConfig) -> SlicedDecoderLayer:
    """The meta layer reshaped to ``dims``: q/k/v read d_in, o writes d_mid, gate/up read d_mid, down writes d_out."""
    view = layer_view(layer)
    for linear in view.producers("attention"):
        _resize(linear, in_features=dims.attn_in)
    _resize(view.projection("attention"), out_features=dims.mlp_in)
    for linear in view.producers("mlp"):
        _resize(linear, in_features=dims.mlp_in)
    _resize(view.projection("mlp"), out_features=dims.out)
    return SlicedDecoderLayer(view.block("attention"), view.block("mlp"), dims, hidden_size=config.hidden_size,
                              eps=config.rms_norm_eps)


def build_skeleton(config: PretrainedConfig, plan: SlicePlan, dtype: torch.dtype) -> PreTrainedModel:
    """A weightless (meta) model of ``config`` with the sliced structure of ``plan``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, **dtype_argument(dtype))
        check_supported(model)
        view = model_view(model)
        if len(plan.layers) != len(view.layers) or plan.hidden_size != config.hidden_size:
            raise ValueError(f"{SLICING_CONFIG} describes {len(plan.layers)} layers of width {plan.hidden_size}; "
                             f"the config has {len(view.layers)} of width {config.hidden_size}")
        for index, dims in enumerate(plan.layers):
            view.layers[index] = _sliced_layer(view.layers[index], dims, config)
        set_weight(view.embeddings, _placeholder(config.vocab_size, plan.embedding))
        _resize(view.lm_head, in_features=plan.head)
        view.final_norm = RMSN(config.hidden_size, config.rms_norm_eps)
    return model.to(dtype)


def load_sliced(directory: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu") -> LoadedModel:
    """Rebuild a model saved by ``save_sliced``, in eval mode, from its directory alone.

    The weights are loaded strictly (every tensor present, shapes equal) and the parameter count is checked
    against the slicing config's. The tokenizer is None when none was saved.
    """
    directory = Path(directory)
    slicing = read_slicing_config(directory)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=False)  # never code from the directory
    if config.tie_word_embeddings:
        raise ValueError(f"{directory}/config.json ties the LM head to the embeddings; a sliced model never does")
    plan = SlicePlan(slicing["hidden_size"], tuple(LayerDims(**dims) for dims in slicing["layers"]))
    model = build_skeleton(config, plan, resolve_dtype(dtype))
    return materialize(model, directory, slicing["weights"], slicing["parameter_count"], dtype=dtype, device=device,
                       sha256=recorded_sha256(slicing, directory / SLICING_CONFIG), method=slicing["report"])
