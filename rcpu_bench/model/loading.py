"""Loading supported causal LMs (the families of ``rcpu_bench.model.adapter``) with their provenance.

Nothing here assumes a layer count, a head size or a model name; the architecture is checked by the
adapter on a weightless skeleton before any weights are read.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils.hub import cached_file, extract_commit_hash

from rcpu_bench.model.adapter import check_architecture, check_prunable, supported

DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "float64": torch.float64,
                                  "bfloat16": torch.bfloat16, "float16": torch.float16}
_DEVICE = re.compile(r"^(cpu|mps|(cuda|xpu)(:\d+)?)$")


@dataclass
class LoadedModel:
    """A model in eval mode, its tokenizer (None when none was saved with it), and where it came from."""

    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase | None
    provenance: dict[str, Any]


def dtype_argument(dtype: torch.dtype) -> dict[str, torch.dtype]:
    """The keyword giving ``from_pretrained`` / ``from_config`` a dtype in the installed transformers.

    transformers 4.56 renamed ``torch_dtype`` to ``dtype`` (the old name still works in 5.x, with a
    deprecation warning; the new one is ignored before 4.56).
    """
    renamed = Version(transformers.__version__).release >= (4, 56)
    return {"dtype" if renamed else "torch_dtype": dtype}


def add_model_options(parser: Any) -> None:
    """The ``--revision``, ``--dtype`` and ``--device`` options every command that loads a model takes."""
    parser.add_argument("--revision", help="hub revision (branch, tag or commit) to pin")
    parser.add_argument("--dtype", default="float32", help=f"model dtype: {', '.join(DTYPES)} (the paper uses float32)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")


def resolve_dtype(name: str) -> torch.dtype:
    """The torch dtype called ``name`` (one of ``DTYPES``)."""
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; allowed: {', '.join(DTYPES)}")
    return DTYPES[name]


def resolve_device(name: str) -> torch.device:
    """The torch device called ``name``: cpu, cuda, cuda:<index>, xpu, xpu:<index> or mps."""
    if not isinstance(name, str) or not _DEVICE.match(name):
        raise ValueError(f"unknown device {name!r}; allowed: cpu, cuda, cuda:<index>, xpu, xpu:<index>, mps")
    return torch.device(name)


def parameter_count(model: nn.Module) -> int:
    """Number of unique parameters: a tensor shared by several modules (tied embeddings) counts once."""
    return sum(p.numel() for p in model.parameters())  # parameters() yields each shared tensor once


def model_source(name_or_path: str) -> str:
    """The existing local directory or the Hub repo id ("org/name") that ``name_or_path`` means.

    A name that looks like a path (absolute, relative with ./ or ../, ~, or more than one "/") but does
    not exist raises FileNotFoundError instead of being tried on the Hub.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    if name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path:
        raise FileNotFoundError(f"model directory {name_or_path!r} does not exist")
    return name_or_path


def _check_supported(config: PretrainedConfig, prune: tuple[str, ...] = ()) -> None:
    """Build a weightless (meta) skeleton of ``config``'s causal LM and check its shape, and that its ``prune``
    modules can be pruned exactly (``adapter.check_prunable``)."""
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config)
    except ValueError:
        raise ValueError(f"unsupported architecture {architecture}: no causal-LM model for this config; "
                         f"supported: {supported()}") from None
    check_architecture(skeleton)
    check_prunable(skeleton, prune)


def load_config(name_or_path: str, revision: str | None = None, *,
                prune: tuple[str, ...] = ()) -> tuple[PretrainedConfig, str | None]:
    """The model's config, checked on a weightless skeleton (its ``prune`` modules too), and the Hub commit it came
    from (None if local)."""
    source = model_source(name_or_path)
    commit = extract_commit_hash(cached_file(source, "config.json", revision=revision), None)
    config = AutoConfig.from_pretrained(source, revision=commit or revision)
    _check_supported(config, prune)
    return config, commit


def load_model(name_or_path: str, *, dtype: str = "float32", device: str = "cpu",
               revision: str | None = None) -> LoadedModel:
    """Load a supported causal LM and its tokenizer, in eval mode, with provenance.

    ``name_or_path`` is a local directory or a Hub repo id (``revision`` may pin a branch, tag or
    commit). The architecture is checked on a weightless skeleton before any weights are read.
    """
    torch_dtype, torch_device, source = resolve_dtype(dtype), resolve_device(device), model_source(name_or_path)
    config, commit = load_config(name_or_path, revision)
    pinned = commit or revision  # config, weights and tokenizer all from the same commit
    model = AutoModelForCausalLM.from_pretrained(source, config=config, revision=pinned,
                                                 **dtype_argument(torch_dtype))
    model = model.to(torch_device).eval()
    tokenizer = AutoTokenizer.from_pretrained(source, revision=pinned)
    provenance = {"name_or_path": name_or_path, "revision": revision, "commit_hash": commit,
                  "dtype": dtype, "device": device, "config_class": type(config).__name__,
                  "model_class": type(model).__name__}
    return LoadedModel(model, tokenizer, provenance)
