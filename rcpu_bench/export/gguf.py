"""Export a (pruned) Llama to GGUF, the file format of llama.cpp, with the ``gguf`` library.

Architecture: a model whose layers all have the same query heads, key/value heads and MLP channels is
written as llama.cpp's ``llama``; one whose widths differ from layer to layer (AL-AM, per-layer head
counts) as ``deci`` (llama.cpp's graph for NVIDIA's Llama-Nemotron NAS models), because ``llama`` reads
one head count and one feed-forward length for every layer (its tensors are loaded and reshaped with
``hparams.n_head()`` / ``n_ff()`` of layer 0) while ``deci`` reads ``n_head(il)``, ``n_head_kv(il)`` and
``n_ff(il)`` for each layer il from the array-valued ``head_count`` / ``head_count_kv`` /
``feed_forward_length`` keys. Otherwise ``deci``'s layer is Llama's (RMSNorm, SwiGLU, NORM RoPE,
optional q/k/v/o and gate/up/down biases).

Tensors: Hugging Face names map to llama.cpp's (``model.layers.{i}.self_attn.q_proj`` → ``blk.{i}.attn_q``,
...; ``lm_head`` is left out when tied, llama.cpp then reuses ``token_embd``). q_proj / k_proj rows (and
biases) are permuted from Hugging Face's rotary layout to llama.cpp's (``rope_interleave``). Matrices are
stored as the requested type, 1-D tensors (norms, biases) as float32, as llama.cpp's converter does.

Qwen2 / Qwen2.5 is Llama with q/k/v biases, which both graphs read when present (with the rows of the kept heads),
so it is written the same way; its sliding-window attention, when switched on, is refused.

Anything llama.cpp's graph cannot express is refused, before the file is written, by a ValueError saying
what is missing: a family other than Llama and Qwen2, a RoPE scaling, sliding window or activation it does not
apply, a tensor without a llama.cpp name, a layer without heads or channels, a q8_0 row length not a multiple of
32.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from rcpu_bench.atomic_file import check_free_space, write_file_atomically
from rcpu_bench.export.gguf_vocab import Vocab, gguf_vocab
from rcpu_bench.model.adapter import model_view
from rcpu_bench.model.persistence import unique_tensors

DTYPES = ("float32", "float16", "bfloat16", "q8_0")
Q8_0_BLOCK = 32  # values per q8_0 block: a q8_0 matrix's rows (in_features) must be a multiple of it
# Config model types exported: Llama (a pruned one saved in an earlier format says rcpu_llama) and Qwen2.
EXPORTED_TYPES = ("llama", "rcpu_llama", "qwen2")
_LAYER_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
_OUTER_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}
_LAYER_TENSOR = re.compile(r"model\.layers\.(\d+)\.(.+)\.(weight|bias)")


def require_gguf() -> Any:
    """The ``gguf`` module, or ImportError saying how to install it."""
    try:
        import gguf
    except ImportError as error:
        raise ImportError("GGUF export needs the gguf package: pip install 'rcpu-bench[gguf]'") from error
    return gguf


def gguf_name(name: str) -> str:
    """llama.cpp's name of the Hugging Face tensor ``name``; ValueError when llama.cpp's Llama graph has none."""
    if name in _OUTER_NAMES:
        return _OUTER_NAMES[name]
    match = _LAYER_TENSOR.fullmatch(name)
    if match is None or match.group(2) not in _LAYER_NAMES:
        raise ValueError(f"tensor {name!r} has no place in llama.cpp's Llama graph (known: embeddings, final norm, "
                         f"LM head and per layer {', '.join(_LAYER_NAMES)})")
    index, module, kind = match.groups()
    return f"blk.{index}.{_LAYER_NAMES[module]}.{kind}"


def rope_interleave(rows: Tensor, n_heads: int) -> Tensor:
    """q_proj / k_proj rows (or bias) from Hugging Face's rotary layout to llama.cpp's NORM RoPE layout.

    Hugging Face rotates the pairs (x_j, x_{j+d/2}) of each head of size d (``rotate_half``), llama.cpp the
    pairs (x_{2j}, x_{2j+1}); so row s·d/2 + j of every head moves to row 2j + s:
    (heads, 2, d/2, ...) → (heads, d/2, 2, ...).
    """
    return rows.reshape(n_heads, 2, rows.shape[0] // n_heads // 2, *rows.shape[1:]).transpose(1, 2).reshape(rows.shape)


@dataclass(frozen=True)
class Widths:
    """Per decoder layer: query heads, key/value heads, MLP channels; and the head size."""

    heads: list[int]
    kv_heads: list[int]
    channels: list[int]
    head_dim: int

    @property
    def uniform(self) -> bool:
        """All layers alike (llama.cpp's ``llama`` architecture can hold them)."""
        return len({*zip(self.heads, self.kv_heads, self.channels)}) == 1

    def key(self, values: list[int]) -> int | list[int]:
        """A GGUF value for ``values``: one integer when the layers are alike, else the per-layer array."""
        return values[0] if self.uniform else values


def rope_theta(config: Any) -> float:
    """RoPE base θ of a transformers 4 or 5 config; ValueError for a RoPE scaling llama.cpp is not given here."""
    parameters = getattr(config, "rope_parameters", None) or {
        "rope_type": (getattr(config, "rope_scaling", None) or {}).get("rope_type", "default"),
        "rope_theta": getattr(config, "rope_theta", 10000.0)}
    if parameters.get("rope_type", "default") != "default":
        raise ValueError(f"RoPE scaling {parameters['rope_type']!r} is not exported (llama.cpp would need its "
                         "rope_freqs / scaling keys); only rope_type 'default' is")
    return float(parameters["rope_theta"])


def check_config(config: Any) -> None:
    """ValueError unless llama.cpp's Llama graph computes what this config describes."""
    if config.model_type not in EXPORTED_TYPES:
        raise ValueError(f"model type {config.model_type!r} is not exported to GGUF; supported: Llama and Qwen2 "
                         f"({', '.join(EXPORTED_TYPES)})")
    if getattr(config, "use_sliding_window", False):
        raise ValueError("use_sliding_window is set: llama.cpp's Llama graph attends over the whole context; only "
                         "models without sliding-window attention are exported")
    if config.hidden_act != "silu":
        raise ValueError(f"hidden_act {config.hidden_act!r}: llama.cpp's Llama graph applies SiLU (SwiGLU) only")
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        raise ValueError(f"pretraining_tp {config.pretraining_tp}: only 1 is exported")
    rope_theta(config)


def layer_widths(model: Any) -> Widths:
    """The head and channel counts of every decoder layer; ValueError for a layer left without any."""
    geometries = [view.geometry for view in model_view(model).views()]
    for i, g in enumerate(geometries):
        if min(g.n_heads, g.n_kv_heads, g.intermediate) < 1:
            raise ValueError(f"layer {i} has {g.n_heads} query heads, {g.n_kv_heads} key/value heads and "
                             f"{g.intermediate} MLP channels: llama.cpp's deci graph drops an attention-only "
                             "layer's output and reads the head size from layer 0, so empty modules are not exported")
    return Widths([g.n_heads for g in geometries], [g.n_kv_heads for g in geometries],
                  [g.intermediate for g in geometries], geometries[0].head_dim)


def gguf_tensors(model: Any, widths: Widths) -> dict[str, Tensor]:
    """The model's tensors under llama.cpp's names, q/k permuted, in float32 (tied ones once)."""
    tensors = {}
    for name, tensor in unique_tensors(model).items():
        target = gguf_name(name)
        match = _LAYER_TENSOR.fullmatch(name)
        if match and match.group(2) in ("self_attn.q_proj", "self_attn.k_proj"):
            layer = int(match.group(1))
            counts = widths.heads if match.group(2) == "self_attn.q_proj" else widths.kv_heads
            tensor = rope_interleave(tensor, counts[layer])
        tensors[target] = tensor.detach().to(device="cpu", dtype=torch.float32)
    return tensors


def check_dtype(dtype: str) -> None:
    """ValueError unless ``dtype`` is one of ``DTYPES``."""
    if dtype not in DTYPES:
        raise ValueError(f"GGUF dtype {dtype!r}; allowed: {', '.join(DTYPES)}")


def check_q8_0_rows(rows: dict[str, int]) -> None:
    """ValueError unless every matrix's row length (its in_features; ``rows``: GGUF name → length) is a whole number
    of q8_0 blocks."""
    for name, length in rows.items():
        if length % Q8_0_BLOCK:
            raise ValueError(f"q8_0 needs rows of a multiple of {Q8_0_BLOCK} values; {name} has {length} "
                             f"(prune with --round-to {Q8_0_BLOCK}, or export float16)")


def gguf_rows(model: Any) -> dict[str, int]:
    """llama.cpp's name → row length (in_features) of every matrix of ``model`` (weightless, meta, too), after the
    checks that the model's config and shapes decide: config, widths, tensor names."""
    check_config(model.config)
    layer_widths(model)
    return {gguf_name(name): tensor.shape[1] for name, tensor in unique_tensors(model).items() if tensor.dim() == 2}


def check_exportable(model: Any, dtype: str) -> None:
    """Everything ``export_gguf`` refuses that the model's config and shapes decide (dtype, ``gguf_rows``' checks,
    q8_0 row lengths), on a weightless (meta) model too: an export is refused before a model loads."""
    check_dtype(dtype)
    rows = gguf_rows(model)
    if dtype == "q8_0":
        check_q8_0_rows(rows)


def _encoded(gguf: Any, tensor: Tensor, dtype: str) -> tuple[np.ndarray, Any]:
    """The array to write for ``tensor`` and its GGML type: 1-D tensors float32, matrices as ``dtype``."""
    array = tensor.numpy()
    if tensor.dim() == 1 or dtype == "float32":
        return array, gguf.GGMLQuantizationType.F32
    if dtype == "float16":
        return array.astype(np.float16), gguf.GGMLQuantizationType.F16
    qtype = gguf.GGMLQuantizationType.BF16 if dtype == "bfloat16" else gguf.GGMLQuantizationType.Q8_0
    return gguf.quants.quantize(array, qtype), qtype


def _file_type(gguf: Any, dtype: str) -> int:
    types = gguf.LlamaFileType
    return {"float32": types.ALL_F32, "float16": types.MOSTLY_F16, "bfloat16": types.MOSTLY_BF16,
            "q8_0": types.MOSTLY_Q8_0}[dtype]


def _write_vocab(writer: Any, vocab: Vocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre is not None:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    if vocab.merges is not None:
        writer.add_token_merges(vocab.merges)
    writer.add_token_types(vocab.types)
    for add, value in ((writer.add_bos_token_id, vocab.bos_id), (writer.add_eos_token_id, vocab.eos_id),
                       (writer.add_unk_token_id, vocab.unk_id)):
        if value is not None:
            add(value)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    writer.add_add_space_prefix(vocab.add_space_prefix)


def _vocab_bytes(vocab: Vocab) -> int:
    """What the vocabulary and the other keys add to the file, at most: each token's text with its length, score and
    type fields, each merge with its length, and 1 MiB for the rest."""
    texts = sum(len(str(token).encode()) + 24 for token in vocab.tokens)
    return texts + sum(len(str(merge).encode()) + 8 for merge in vocab.merges or ()) + 2**20


def export_gguf(model: Any, tokenizer: Any, path: str | os.PathLike, *, dtype: str = "float16",
                name: str = "rcpu-bench pruned model", overwrite: bool = False) -> dict[str, Any]:
    """Write ``model`` (a Llama, pruned or not) and its ``tokenizer`` to the GGUF file ``path``.

    Everything is checked first (``check_exportable``, the tokenizer); the file is written beside ``path`` and
    renamed into place (``write_file_atomically``), so a failure (a full disk) leaves no partial file, and a file
    another writer published meanwhile is replaced only with ``overwrite``. Returns a summary: path, architecture,
    dtype, tensor count, per-layer widths.
    """
    gguf = require_gguf()
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists and is kept as it is; allowed: a new path (overwrite=True "
                              "replaces it)")
    if tokenizer is None:
        raise ValueError("the model has no tokenizer: llama.cpp needs the vocabulary in the GGUF file")
    check_exportable(model, dtype)
    config = model.config
    widths = layer_widths(model)
    tensors = gguf_tensors(model, widths)
    vocab = gguf_vocab(tokenizer, tensors["token_embd.weight"].shape[0])
    arch = "llama" if widths.uniform else "deci"

    writer = gguf.GGUFWriter(None, arch)
    writer.add_name(name)
    writer.add_file_type(_file_type(gguf, dtype))
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(len(widths.heads))
    writer.add_head_count(widths.key(widths.heads))
    writer.add_head_count_kv(widths.key(widths.kv_heads))
    writer.add_feed_forward_length(widths.key(widths.channels))
    writer.add_key_length(widths.head_dim)
    writer.add_value_length(widths.head_dim)
    writer.add_rope_dimension_count(widths.head_dim)
    writer.add_rope_freq_base(rope_theta(config))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(len(vocab.tokens))
    _write_vocab(writer, vocab)
    size = 0
    for tensor_name, tensor in tensors.items():
        array, qtype = _encoded(gguf, tensor, dtype)
        writer.add_tensor(tensor_name, array, raw_dtype=qtype)
        size += array.nbytes
    check_free_space(target.parent, size + _vocab_bytes(vocab), f"the GGUF file {target} would",
                     allowed="a path on a file system with that much free space")

    def write(staging: Path) -> None:
        try:
            writer.write_header_to_file(staging)
            writer.write_kv_data_to_file()
            writer.write_tensors_to_file()
        except OSError as error:
            if error.errno is None:  # numpy's short write: "N requested and M written"
                raise OSError(f"wrote less than asked ({error}): the file system is full or failed") from error
            raise
        finally:
            writer.close()

    target.parent.mkdir(parents=True, exist_ok=True)
    write_file_atomically(target, write, replace=overwrite)
    return {"path": str(target), "architecture": arch, "dtype": dtype, "tensors": len(tensors),
            "heads": widths.heads, "kv_heads": widths.kv_heads, "channels": widths.channels}

