"""Saving and reloading physically pruned models, in a directory any transformers install can load.

A pruned model is saved as a directory with

- ``model.safetensors``: the weights (tied embeddings stored once);
- ``config.json``: the pruned model's config (``saved_config``, the same for every family): the family's own
  config class (``LlamaConfig``, ``Qwen2Config``, ``Gemma2Config``, ...) with the pruned head and channel
  counts and an explicit head_dim when it builds exactly the saved shapes (every layer alike, biases as the
  family has them): then ``AutoModelForCausalLM.from_pretrained(directory)`` loads it with no remote code.
  Otherwise an ``RcpuPrunedConfig`` (``rcpu_bench.model.hf_format``): the family's config plus per-layer
  counts and added biases, loaded by the package's classes (registered when rcpu_bench.model is imported), or,
  without rcpu-bench, by the source written beside it with ``trust_remote_code=True``;
- ``rcpu_manifest.json``: shapes, provenance and checksums (``rcpu_bench.model.manifest``), verified by every
  command before it reads the directory;
- ``README.md``: a model card in the Hugging Face convention (``rcpu_bench.model.model_card``);
- the tokenizer files, when a tokenizer is given.

``load_pruned`` verifies the directory (``manifest.check_saved``), builds the model without weights (meta device)
from config.json, checks each layer against the manifest, then loads the weights strictly; it needs nothing but
that directory. It reads today's format (manifest version 4); ``rcpu-bench migrate`` (``rcpu_bench.model.migrate``)
brings a directory of an earlier format to it.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_model as load_weights
from safetensors.torch import save_file
from torch import Tensor, nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from rcpu_bench.atomic_file import check_free_space, file_sha256, write_atomically
from rcpu_bench.finite import check_parameters
from rcpu_bench.model.adapter import layer_geometries, model_view
from rcpu_bench.model.hf_format import PER_LAYER, RcpuPrunedConfig, write_per_layer_config
from rcpu_bench.model.loading import (
    LoadedModel,
    check_remote_code,
    check_revision,
    dtype_argument,
    load_config,
    load_model,
    load_tokenizer,
    model_skeleton,
    model_source,
    parameter_count,
    resolve_device,
    resolve_dtype,
)
from rcpu_bench.model.manifest import (
    CARD,
    CONFIG,
    MANIFEST,
    WEIGHTS,
    build_manifest,
    check_saved,
    check_saved_model,
    layer_records,
    pruned_directory,
    read_json_manifest,
    read_manifest,
    recorded_sha256,
    saved_by_model_method,
    verify_checksum,
    weights_file,
)
from rcpu_bench.model.model_card import model_card
from rcpu_bench.records import Record

try:
    from huggingface_hub.errors import StrictDataclassError
except ImportError:  # huggingface_hub < 0.35 (the transformers 4.x floor): configs are not strict dataclasses there
    StrictDataclassError = ValueError  # type: ignore[misc,assignment]

CONFIG_KINDS = ("family", "per_layer")  # the family's own config, or the per-layer RcpuPrunedConfig

log = logging.getLogger(__name__)


def save_pruned(model: PreTrainedModel, directory: str | os.PathLike, *, tokenizer: Any = None,
                method: dict | None = None, provenance: dict | None = None, record: Record | None = None,
                overwrite: bool = False) -> dict:
    """Save a (pruned) model to ``directory`` (atomically, see ``write_atomically``) and return its manifest.

    ``record`` (the experiment's result record) supplies the model card's calibration and perplexities.
    """
    kind, config = saved_config(model)
    manifest = build_manifest(model, method, provenance, kind)
    json.dumps(manifest, allow_nan=False)  # a non-JSON method/provenance fails before anything is written
    card = model_card(manifest, record)
    tensors = unique_tensors(model)
    check_free_space(Path(directory).parent, saved_bytes(tensors, tokenizer), f"saving the model to {directory} would",
                     allowed="a directory on a file system with that much free space")

    def write(staging: Path) -> None:
        save_weights(tensors, staging / WEIGHTS)
        if kind == "per_layer":
            write_per_layer_config(config, staging)
        else:
            config.save_pretrained(staging)
        if tokenizer is not None:
            save_tokenizer(tokenizer, staging)
        manifest["sha256"] = {name: file_sha256(staging / name) for name in (WEIGHTS, CONFIG)}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2))
        (staging / CARD).write_text(card)

    write_atomically(directory, write, overwrite=overwrite)
    return manifest


TOKEN_BYTES = 256  # room for one token in the tokenizer files, at most (Gemma-3's 262,144 tokens take 38 MB)


def saved_bytes(tensors: dict[str, Tensor], tokenizer: Any = None) -> int:
    """The bytes a save writes, at most: the tensors, the tokenizer's files, and 1 MiB of config, manifest and card."""
    tokens = len(tokenizer) if hasattr(tokenizer, "__len__") else 0
    return sum(t.numel() * t.element_size() for t in tensors.values()) + tokens * TOKEN_BYTES + 2**20


def save_weights(tensors: dict[str, Tensor], path: Path) -> None:
    """Write ``tensors`` as a safetensors file; a failed write (a full disk) is an OSError, as Python's own writes
    are, not safetensors' SafetensorError."""
    try:
        save_file(tensors, str(path), metadata={"format": "pt"})
    except SafetensorError as error:
        raise OSError(str(error)) from error


def saved_config(model: PreTrainedModel) -> tuple[str, PretrainedConfig]:
    """The config to save for ``model`` (any family), and its kind, checked to build exactly its tensor shapes.

    ``"family"``: the family's own config with the pruned counts (num_attention_heads, num_key_value_heads,
    intermediate_size, head_dim), when every layer is alike and that config builds exactly the model's tensors
    (no bias the family lacks; transformers accepts the counts). Else ``"per_layer"``: an ``RcpuPrunedConfig``
    of the unpruned family config (explicit head_dim) with per-layer counts and added biases.
    """
    geometries = layer_geometries(model)
    first, shapes = geometries[0], tensor_shapes(model)
    base = family_config(model.config, head_dim=first.head_dim)
    if all(geometry == first for geometry in geometries):
        counts = {"num_attention_heads": first.n_heads, "num_key_value_heads": first.n_kv_heads,
                  "intermediate_size": first.intermediate}
        try:
            uniform = type(base).from_dict({**base.to_dict(), **counts})
        except (ValueError, StrictDataclassError):  # e.g. transformers 5's LlamaConfig: heads must divide hidden_size
            uniform = None
        if uniform is not None and tensor_shapes(skeleton(uniform)) == shapes:
            return "family", uniform
    per_layer = {"layer_num_attention_heads": [g.n_heads for g in geometries],
                 "layer_num_key_value_heads": [g.n_kv_heads for g in geometries],
                 "layer_intermediate_sizes": [g.intermediate for g in geometries]}
    plain = RcpuPrunedConfig.of(base, **per_layer, layer_added_biases=[[] for _ in geometries])
    config = RcpuPrunedConfig.of(base, **per_layer, layer_added_biases=added_biases(model, skeleton(plain)))
    built = tensor_shapes(skeleton(config))
    if built != shapes:
        bad = sorted(set(built.items()) ^ set(shapes.items()))[:4]
        raise ValueError(f"cannot save {type(model).__name__}: its family's layers built at the pruned counts "
                         f"differ from the model's (tensors {bad}); the per-layer format expresses head and channel "
                         "counts and added linear biases only")
    return "per_layer", config


def family_config(config: PretrainedConfig, *, head_dim: int) -> PretrainedConfig:
    """``config`` as its family's config class (without the per-layer lists a reloaded per-layer model carries),
    with an explicit ``head_dim``: it no longer equals hidden_size / heads once heads are removed."""
    values = {k: v for k, v in config.to_dict().items() if k not in (*PER_LAYER, "architectures", "auto_map")}
    return type(config).from_dict({**values, "head_dim": head_dim})


def skeleton(config: PretrainedConfig) -> PreTrainedModel:
    """A weightless (meta) causal LM of ``config``."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def tensor_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """Name → shape of every tensor in ``model``'s state dict."""
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def added_biases(model: PreTrainedModel, plain: PreTrainedModel) -> list[list[str]]:
    """Per decoder layer, the linear layers (names inside the layer) with a bias in ``model`` but not in ``plain``
    (the same family built at the same widths): o_proj / down_proj after FLAP's bias compensation."""
    return [sorted(name.removesuffix(".bias") for name in set(layer.state_dict()) - set(built.state_dict())
                   if name.endswith(".bias"))
            for layer, built in zip(model_view(model).layers, model_view(plain).layers, strict=True)]


def save_tokenizer(tokenizer: Any, directory: Path) -> None:
    """Save ``tokenizer``'s files without ``auto_map``: reloading them must never need (or prompt for) remote code."""
    tokenizer.save_pretrained(directory)
    path = directory / "tokenizer_config.json"
    if path.is_file():
        settings = json.loads(path.read_text())
        if settings.pop("auto_map", None) is not None:
            path.write_text(json.dumps(settings, indent=2, ensure_ascii=False) + "\n")


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


def build_skeleton(config: PretrainedConfig, records: list[dict[str, Any]], dtype: torch.dtype, *,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """A weightless (meta) model of ``config`` (which describes the pruned layers), its layers checked against the
    manifest's ``records``."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code, **dtype_argument(dtype))
    built = layer_records(model)
    if len(records) != len(built):
        raise ValueError(f"{MANIFEST} describes {len(records)} layers but the config has {len(built)}")
    if built != records:
        bad = next(i for i, (a, b) in enumerate(zip(built, records, strict=True)) if a != b)
        raise ValueError(f"{MANIFEST} layer {bad} is {records[bad]} but the config builds {built[bad]}")
    return model


def load_pruned(directory: str | os.PathLike, *, dtype: str = "float32", device: str = "cpu",
                trust_remote_code: bool = False) -> LoadedModel:
    """Rebuild a model saved by ``save_pruned``, in eval mode, from its directory alone.

    The weights are loaded strictly (every tensor present, shapes equal) and the parameter count is
    checked against the manifest's. The tokenizer is None when none was saved. No code from the directory
    runs unless ``trust_remote_code`` (the per-layer format is built by this package's classes).
    """
    directory = Path(directory)
    manifest = read_manifest(directory)
    check_saved(directory, manifest)
    model = saved_skeleton(directory, manifest, resolve_dtype(dtype), trust_remote_code=trust_remote_code)
    return materialize(model, directory, manifest["weights"], manifest["parameter_count"], dtype=dtype, device=device,
                       sha256=recorded_sha256(manifest, directory / MANIFEST), method=manifest["method"],
                       source=manifest["provenance"])


def saved_skeleton(directory: Path, manifest: dict[str, Any], dtype: torch.dtype, *,
                   trust_remote_code: bool = False) -> PreTrainedModel:
    """The weightless (meta) model of a checked ``save_pruned`` directory: its config.json built and its layers
    checked against the manifest (``build_skeleton``)."""
    config = read_saved_config(directory, manifest, trust_remote_code=trust_remote_code)
    return build_skeleton(config, manifest["layers"], dtype, trust_remote_code=trust_remote_code)


def read_saved_config(directory: Path, manifest: dict, *, trust_remote_code: bool = False) -> PretrainedConfig:
    """The config.json of a ``save_pruned`` directory, of the kind its manifest names; code from the directory
    runs only with ``trust_remote_code`` (else transformers raises), and never for the per-layer format."""
    kind = manifest.get("config")
    if kind not in CONFIG_KINDS:
        raise ValueError(f"{directory / MANIFEST} has config {kind!r}; allowed: {', '.join(CONFIG_KINDS)}")
    trust = trust_remote_code and kind != "per_layer"
    check_remote_code(str(directory), directory / CONFIG, trust)
    config = AutoConfig.from_pretrained(directory, trust_remote_code=trust)
    if (kind == "per_layer") != isinstance(config, RcpuPrunedConfig):
        raise ValueError(f"{directory / MANIFEST} says config {kind!r} but config.json is a {type(config).__name__}")
    return config


def materialize(skeleton: PreTrainedModel, directory: Path, weights: str, expected_count: int, *, dtype: str,
                device: str, sha256: str | None = None, **provenance: Any) -> LoadedModel:
    """Fill a weightless (meta) model of the saved shape from ``directory``: weights file confined to ``directory``
    and checked against its recorded ``sha256``, strict load, parameter count checked.

    Shared by every saved-model format (ours and the model-method plugins'); ``provenance`` joins the record.
    """
    path = weights_file(directory, weights)
    verify_checksum(path, sha256)
    torch_device = resolve_device(device)
    skeleton.to_empty(device=torch_device)
    skeleton.init_weights()  # re-ties the embeddings (the weights themselves are overwritten below)
    recompute_rotary(skeleton)
    load_weights(skeleton, path, strict=True, device=str(torch_device))
    check_parameters(skeleton, f"saved model {directory}")
    count = parameter_count(skeleton)
    if count != expected_count:
        raise ValueError(f"the rebuilt model has {count} parameters; the manifest says {expected_count}")
    tokenizer = (AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
                 if (directory / "tokenizer_config.json").is_file() else None)
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
               registry: Any = None, trust_remote_code: bool = False) -> LoadedModel:
    """Load a directory written by ``save_pruned``, or by a whole-model method's saver (named in its manifest), with
    the loader that ``registry`` (``rcpu_bench.default_registry()``, say) holds for that method."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} is not a saved pruned model")
    manifest = read_json_manifest(path)
    if not saved_by_model_method(manifest):
        return load_pruned(directory, dtype=dtype, device=device, trust_remote_code=trust_remote_code)
    if registry is None:
        raise ValueError(f"{directory} was saved by the model method {manifest['model_method']!r}: pass the registry "
                         "that holds it (registry=rcpu_bench.default_registry())")
    method = registry.get("model-method", manifest["model_method"])
    if method.load is None:
        raise ValueError(f"the model method {method.name!r} ({method.provider}) registered no load function")
    return method.load(directory, dtype=dtype, device=device)


def check_model_argument(name: str, revision: str | None, trust_remote_code: bool = False) -> None:
    """Reject a missing path, a saved directory that fails its checks (``check_saved_model``) or has no tokenizer,
    an unsupported model, or code shipped with the model without ``trust_remote_code``, before loading."""
    check_revision(name, revision)
    saved = check_saved_model(name)
    if saved is None:
        _, commit = load_config(name, revision, trust_remote_code=trust_remote_code)
        load_tokenizer(model_source(name), commit or revision, trust_remote_code=trust_remote_code)
        return
    directory, manifest = saved
    if not saved_by_model_method(manifest):
        read_saved_config(directory, manifest, trust_remote_code=trust_remote_code)
    if not (directory / "tokenizer_config.json").is_file():
        raise ValueError(f"{directory} has no tokenizer (save_pruned was called without one)")


def weightless_model(name: str, *, revision: str | None = None, trust_remote_code: bool = False
                     ) -> PreTrainedModel | None:
    """A weightless (meta) model of ``name`` with the shapes it will load with (a saved directory built from its
    config and manifest, checked first; any other model from its config), or None for a directory a whole-model
    method saved in its own format: what can be refused on shapes is refused without reading weights."""
    saved = check_saved_model(name)
    if saved is None:
        config, _ = load_config(name, revision, trust_remote_code=trust_remote_code)
        return model_skeleton(config, trust_remote_code)
    directory, manifest = saved
    if saved_by_model_method(manifest):
        return None
    return saved_skeleton(directory, manifest, torch.float32, trust_remote_code=trust_remote_code)


def load_saved_or_model(name: str, *, revision: str | None, dtype: str, device: str, registry: Any,
                        trust_remote_code: bool = False) -> LoadedModel:
    """``load_saved`` for a directory written by save_pruned (or a model method), else ``load_model``; code shipped
    with the model runs only with ``trust_remote_code``."""
    directory = pruned_directory(name)
    if directory is not None:
        return load_saved(directory, dtype=dtype, device=device, registry=registry,
                          trust_remote_code=trust_remote_code)
    return load_model(name, dtype=dtype, device=device, revision=revision, trust_remote_code=trust_remote_code)
