"""Loading supported causal LMs (the families of ``rcpu_bench.model.adapter``) with their provenance.

Nothing here assumes a layer count, a head size or a model name; the architecture is checked by the
adapter on a weightless skeleton before any weights are read.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from packaging.version import Version
from safetensors import safe_open
from torch import nn
from transformers import (
    CONFIG_MAPPING,
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.utils.hub import cached_file, extract_commit_hash

from rcpu_bench.finite import check_parameters
from rcpu_bench.model import real_models
from rcpu_bench.model.adapter import check_architecture, check_prunable, supported

DEFAULT_DTYPE, DEFAULT_DEVICE = "float32", "cpu"  # of every command, matrix and Experiment
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


def available_devices() -> list[str]:
    """The devices this torch build can use here: cpu, then each cuda:N / xpu:N, then mps."""
    names = ["cpu"]
    for kind in ("cuda", "xpu"):
        backend = getattr(torch, kind, None)
        if backend is not None and backend.is_available():
            names += [f"{kind}:{index}" for index in range(backend.device_count())]
    if torch.backends.mps.is_available():
        names.append("mps")
    return names


def check_device(name: str) -> torch.device:
    """``resolve_device``, and the device exists here (``cuda`` on a CPU-only torch is an error, not an assertion)."""
    device = resolve_device(name)
    usable = available_devices()
    wanted = device.type if device.type in ("cpu", "mps") else f"{device.type}:{device.index or 0}"
    if wanted not in usable:
        raise ValueError(f"device {name!r} is not available with this torch {torch.__version__}; "
                         f"available: {', '.join(usable)}")
    return device


def parameter_count(model: nn.Module) -> int:
    """Number of unique parameters: a tensor shared by several modules (tied embeddings) counts once."""
    return sum(p.numel() for p in model.parameters())  # parameters() yields each shared tensor once


def model_source(name_or_path: str) -> str:
    """The existing local directory, the converted directory of a real model named in
    ``rcpu_bench.model.real_models`` (``smollm2-135m``: converted on first use), or the Hub repo id ("org/name")
    that ``name_or_path`` means.

    A name that looks like a path (absolute, relative with ./ or ../, ~, or more than one "/") but does
    not exist raises FileNotFoundError instead of being tried on the Hub, and so does a name close to a real model's
    (``SmolLM2-135M``, ``gemma3``), naming it.
    """
    path = Path(name_or_path).expanduser()
    if path.exists():
        return str(path)
    if name_or_path in real_models.MODELS:
        return str(real_models.resolve(name_or_path))
    if name_or_path.startswith(("/", "./", "../", "~")) or name_or_path.count("/") > 1 or "\\" in name_or_path:
        raise FileNotFoundError(f"model directory {name_or_path!r} does not exist")
    close = difflib.get_close_matches(name_or_path.lower(), real_models.MODELS, n=1, cutoff=0.6)
    if close and "/" not in name_or_path:
        raise ValueError(f"unknown model {name_or_path!r} (did you mean the real model {close[0]!r}?); allowed: a "
                         f"real model by name ({', '.join(real_models.MODELS)}), a model directory or a Hub id")
    return name_or_path


def check_revision(name_or_path: str, revision: str | None) -> None:
    """Refuse a ``revision`` for a model it cannot pin: a local directory, a saved one, or a real model by name
    (converted from the GGUF of its pinned package): only a Hub id has revisions."""
    if revision is None:
        return
    if name_or_path in real_models.MODELS:
        model = real_models.MODELS[name_or_path]
        what = f"the real model {name_or_path!r}, converted from the GGUF of {model.distribution} {model.version}"
    elif Path(name_or_path).expanduser().exists():
        what = f"the local directory {name_or_path}"
    else:
        return
    raise ValueError(f"revision={revision!r} pins a commit of a Hugging Face Hub model, and {what} has none; allowed: "
                     "no revision (the files there are what loads)")


def check_remote_code(name: str, config_file: str | Path, trust_remote_code: bool) -> None:
    """ValueError naming ``--trust-remote-code`` when loading the model at ``config_file`` would run Python code shipped
    with it (its config.json's ``auto_map`` names a model type this transformers does not know), unless trusted.

    One line, before transformers' own refusal (several lines) or, where trust is left undecided, its prompt.
    """
    try:
        settings = json.loads(Path(config_file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"model {name}: {Path(config_file).name} is not a valid JSON file ({error}); allowed: a "
                         "transformers config.json") from None
    if not trust_remote_code and "auto_map" in settings and settings.get("model_type") not in CONFIG_MAPPING:
        raise ValueError(f"model {name} ships Python code that loading it would run (config.json auto_map, "
                         f"model_type {settings.get('model_type')!r}); pass --trust-remote-code "
                         "(trust_remote_code=True) to allow it")


def model_skeleton(config: PretrainedConfig, trust_remote_code: bool = False) -> PreTrainedModel:
    """A weightless (meta) skeleton of ``config``'s causal LM, its architecture checked: its layers' shapes (the unit
    counts a ratio is checked against) at no memory cost."""
    architecture = (getattr(config, "architectures", None) or [type(config).__name__])[0]
    try:
        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    except ValueError:
        raise ValueError(f"unsupported architecture {architecture}: no causal-LM model for this config; "
                         f"supported: {supported()}") from None
    check_architecture(skeleton)
    return skeleton


_WEIGHTS = ("*.safetensors", "pytorch_model*.bin")


def check_weight_files(directory: Path) -> None:
    """Raise a one-line error naming the file unless a local model directory has weights whose safetensors headers
    read (a missing, truncated or garbage file fails here, before anything is loaded)."""
    files = sorted(f for pattern in _WEIGHTS for f in directory.glob(pattern))
    if not files:
        raise FileNotFoundError(f"model directory {directory} has no weights; expected model.safetensors "
                                "(or sharded *.safetensors, or pytorch_model.bin)")
    for path in (f for f in files if f.suffix == ".safetensors"):
        try:
            with safe_open(path, "pt"):
                pass
        except Exception as error:  # noqa: BLE001 (safetensors raises its own SafetensorError for any bad header)
            raise ValueError(f"weights file {path} is not a readable safetensors file ({error}); "
                             "re-download or re-save the model") from None


def load_tokenizer(source: str, revision: str | None = None, *, trust_remote_code: bool = False
                   ) -> PreTrainedTokenizerBase:
    """The tokenizer saved with a model; a missing or unreadable one is a one-line error naming the directory. Code
    shipped with it runs only with ``trust_remote_code`` (else an error, never a prompt)."""
    try:
        return AutoTokenizer.from_pretrained(source, revision=revision, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as error:
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0].rstrip(": ")
        raise ValueError(f"no usable tokenizer in {source}: {reason}; expected tokenizer.json or tokenizer.model "
                         "beside tokenizer_config.json") from None


def load_config(name_or_path: str, revision: str | None = None, *,
                prune: tuple[str, ...] = (), trust_remote_code: bool = False) -> tuple[PretrainedConfig, str | None]:
    """The model's config, checked on a weightless skeleton (its ``prune`` modules too, ``adapter.check_prunable``;
    a local directory: its weight files too), and the Hub commit it came from (None if local).

    Code shipped with the model runs only with ``trust_remote_code``; without it such a model raises ValueError
    (``check_remote_code``), never a prompt. rcpu-bench's per-layer saved format needs none.
    """
    check_revision(name_or_path, revision)
    source = model_source(name_or_path)
    try:
        config_file = cached_file(source, "config.json", revision=revision)
    except OSError as error:
        if Path(source).exists():
            raise
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise OSError(f"model {name_or_path!r} is neither a local directory nor a real model known by name "
                      f"({', '.join(real_models.MODELS)}), and the Hugging Face Hub does not give it: {reason}") \
            from None
    if config_file is None:  # a local directory without one (transformers 5 returns None, not an error)
        raise FileNotFoundError(f"model {name_or_path} has no config.json; allowed: a model directory with its config")
    check_remote_code(name_or_path, config_file, trust_remote_code)
    commit = extract_commit_hash(config_file, None)
    config = AutoConfig.from_pretrained(source, revision=commit or revision, trust_remote_code=trust_remote_code)
    check_prunable(model_skeleton(config, trust_remote_code), prune)
    if Path(source).is_dir():
        check_weight_files(Path(source))
    return config, commit


def load_model(name_or_path: str, *, dtype: str = DEFAULT_DTYPE, device: str = DEFAULT_DEVICE,
               revision: str | None = None, trust_remote_code: bool = False) -> LoadedModel:
    """Load a supported causal LM and its tokenizer, in eval mode, with provenance.

    ``name_or_path`` is a local directory or a Hub repo id (``revision`` may pin a branch, tag or
    commit). The architecture is checked on a weightless skeleton before any weights are read; a NaN or ±inf
    weight raises NonFiniteError naming its parameter (layer and module). Code shipped with the model runs only
    with ``trust_remote_code`` (see ``load_config``).
    """
    torch_dtype, torch_device, source = resolve_dtype(dtype), check_device(device), model_source(name_or_path)
    config, commit = load_config(name_or_path, revision, trust_remote_code=trust_remote_code)
    pinned = commit or revision  # config, weights and tokenizer all from the same commit
    model = AutoModelForCausalLM.from_pretrained(source, config=config, revision=pinned,
                                                 trust_remote_code=trust_remote_code, **dtype_argument(torch_dtype))
    check_parameters(model, f"model {name_or_path}")
    # transformers wraps PreTrainedModel.to in functools.wraps, which mypy does not bind as a method
    model = model.to(torch_device).eval()  # type: ignore[arg-type]
    tokenizer = load_tokenizer(source, pinned, trust_remote_code=trust_remote_code)
    provenance: dict[str, Any] = {"name_or_path": name_or_path, "revision": revision, "commit_hash": commit,
                                  "dtype": dtype, "device": device, "config_class": type(config).__name__,
                                  "model_class": type(model).__name__}
    converted = real_models.provenance(source)
    if converted is not None:
        provenance["real_model"] = converted
    return LoadedModel(model, tokenizer, provenance)
