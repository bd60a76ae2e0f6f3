"""Write a random-init LLaMA-7B-, 13B- or Llama-3.2-1B-shaped model directory that `rcpu-bench prune` loads like a
real one.

The directory holds ``config.json`` (LlamaForCausalLM, the shape's real widths, key/value heads, layers and
vocabulary: 32,000 tokens for LLaMA, 128,256 and tied embeddings for Llama-3.2-1B, whose RoPE is kept plain,
without Llama 3's frequency scaling), the weights as ``model-XXXXX-of-YYYYY.safetensors`` shards (one per
decoder layer, plus one for the embeddings, final norm and head) with ``model.safetensors.index.json``, and the
tokenizer files of a local model (default: the shared ``stories260K``; its 512 ids all lie inside the vocabulary).
Weights are N(0, 0.02²) (LLaMA's ``initializer_range``), norms are ones, all seeded; tensors are made and
written one layer at a time, so memory stays near one layer (≈ 0.8 GB in float32 at 7B) whatever the size.
``--device cuda`` draws the numbers on the GPU (another random stream than the CPU's, as seeded): the CPU
generator is single-threaded and takes minutes for a full-size model.

A full-size model is large (7B: 27 GB in float32, 13.5 GB in float16), so this is for a machine with the
disk and memory to prune it; ``--scale`` and ``--layers`` shrink it for a quick check:

    python benchmarks/make_random_llama.py --shape 7b --dtype float16 --out /data/random-llama-7b
    rcpu-bench prune --model /data/random-llama-7b --dtype float32 --device cuda --calib tinystories:128x128 \\
        --ppl rcpu128 --scorer variance --compensator procrustes --ratio 0.2
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

SEED = 0
INIT_STD = 0.02
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "special_tokens_map.json")


class Shape(NamedTuple):
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    layers: int
    vocab: int
    tied: bool
    rope_theta: float
    rms_eps: float


# LLaMA-1 7B, Llama-2 13B and Llama-3.2-1B (GQA: 8 key/value heads, tied embeddings).
SHAPES = {"7b": Shape(4096, 11008, 32, 32, 32, 32000, False, 10000.0, 1e-6),
          "13b": Shape(5120, 13824, 40, 40, 40, 32000, False, 10000.0, 1e-6),
          "llama3.2-1b": Shape(2048, 8192, 32, 8, 16, 128256, True, 500000.0, 1e-5)}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def llama_config(shape: str, scale: float = 1.0, layers: int | None = None) -> LlamaConfig:
    """The LlamaConfig of a shape; ``scale`` multiplies head_dim (kept even, ≥ 2) and the MLP width, heads stay.

    ``layers`` overrides the number of decoder layers (the shape's own by default).
    """
    if shape not in SHAPES:
        raise ValueError(f"shape={shape!r}; allowed: {', '.join(SHAPES)}")
    if not 0 < scale <= 1:
        raise ValueError(f"scale={scale} must be in (0, 1]")
    s = SHAPES[shape]
    head_dim = max(2, 2 * round(s.hidden // s.heads * scale / 2))
    return LlamaConfig(hidden_size=s.heads * head_dim, intermediate_size=max(1, round(s.intermediate * scale)),
                       num_attention_heads=s.heads, num_key_value_heads=s.kv_heads, head_dim=head_dim,
                       num_hidden_layers=layers or s.layers, vocab_size=s.vocab, max_position_embeddings=2048,
                       rms_norm_eps=s.rms_eps, tie_word_embeddings=s.tied, bos_token_id=1, eos_token_id=2,
                       rope_theta=s.rope_theta)


def layer_tensors(config: LlamaConfig, index: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """The float32 tensors of decoder layer ``index`` under their Hugging Face names, on the generator's device."""
    hidden, inner, head_dim = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    shapes = {"self_attn.q_proj": (q_out, hidden), "self_attn.k_proj": (kv_out, hidden),
              "self_attn.v_proj": (kv_out, hidden), "self_attn.o_proj": (hidden, q_out),
              "mlp.gate_proj": (inner, hidden), "mlp.up_proj": (inner, hidden), "mlp.down_proj": (hidden, inner)}
    prefix = f"model.layers.{index}."
    tensors = {f"{prefix}{name}.weight": _normal(shape, generator) for name, shape in shapes.items()}
    norms = ("input_layernorm", "post_attention_layernorm")
    tensors |= {f"{prefix}{norm}.weight": torch.ones(hidden) for norm in norms}
    return tensors


def outer_tensors(config: LlamaConfig, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """Embeddings, final norm and LM head (untied as in LLaMA; none when tied, as in Llama-3.2-1B)."""
    vocab, hidden = config.vocab_size, config.hidden_size
    tensors = {"model.embed_tokens.weight": _normal((vocab, hidden), generator),
               "model.norm.weight": torch.ones(hidden)}
    if not config.tie_word_embeddings:
        tensors["lm_head.weight"] = _normal((vocab, hidden), generator)
    return tensors


def _normal(shape: tuple[int, int], generator: torch.Generator) -> torch.Tensor:
    """N(0, INIT_STD²) entries drawn by ``generator`` on its device."""
    return torch.randn(shape, generator=generator, device=generator.device).mul_(INIT_STD)


def write_model(out: Path, config: LlamaConfig, dtype: str, tokenizer_from: Path, device: str = "cpu") -> None:
    """Write config, sharded safetensors (+ index) and tokenizer files to ``out`` (which must not exist yet), the
    random numbers drawn on ``device``."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}; allowed: {', '.join(DTYPES)}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r}; allowed: cpu, cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError("device='cuda' but no CUDA device is available; allowed here: cpu")
    missing = [name for name in ("tokenizer.json", "tokenizer_config.json") if not (tokenizer_from / name).is_file()]
    if missing:
        raise FileNotFoundError(f"tokenizer source {tokenizer_from} lacks {', '.join(missing)}")
    out.mkdir(parents=True, exist_ok=False)
    generator = torch.Generator(device).manual_seed(SEED)
    n_shards = config.num_hidden_layers + 1
    weight_map, total_bytes = {}, 0
    makers = [lambda: outer_tensors(config, generator)]
    makers += [lambda i=i: layer_tensors(config, i, generator) for i in range(config.num_hidden_layers)]
    for shard, make in enumerate(makers, start=1):
        tensors = {name: t.to(DTYPES[dtype]).cpu().contiguous() for name, t in make().items()}
        filename = f"model-{shard:05d}-of-{n_shards:05d}.safetensors"
        save_file(tensors, out / filename, metadata={"format": "pt"})
        weight_map |= dict.fromkeys(tensors, filename)
        total_bytes += sum(t.numel() * t.element_size() for t in tensors.values())
        print(f"wrote {filename} ({len(tensors)} tensors)", flush=True)
    index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config.dtype = dtype
    config.architectures = ["LlamaForCausalLM"]
    config.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (tokenizer_from / name).is_file():
            shutil.copy(tokenizer_from / name, out / name)


def default_tokenizer_source() -> Path:
    """The shared stories260K model directory (``$RCPU_BENCH_SHARED`` or ../shared), whose tokenizer we copy."""
    from rcpu_bench.paths import (
        shared_dir,  # the harness's own lookup of the shared directory
    )

    return shared_dir() / "models" / "stories260K"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="7b")
    parser.add_argument("--dtype", choices=list(DTYPES), default="float16", help="stored weight dtype")
    parser.add_argument("--scale", type=float, default=1.0, help="shrink head_dim and MLP width (e.g. 0.02 to test)")
    parser.add_argument("--layers", type=int, help="number of decoder layers (default: the shape's, 32 or 40)")
    parser.add_argument("--tokenizer-from", type=Path, help="model directory whose tokenizer files are copied "
                        "(default: stories260K in the shared directory)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                        help="where the random numbers are drawn (cuda: seconds rather than minutes at full size)")
    parser.add_argument("--out", type=Path, required=True, help="new model directory (must not exist)")
    args = parser.parse_args(argv)
    config = llama_config(args.shape, args.scale, args.layers)
    try:
        write_model(args.out, config, args.dtype, args.tokenizer_from or default_tokenizer_source(), args.device)
    except (ValueError, FileNotFoundError, FileExistsError) as error:
        print(f"make_random_llama: error: {error}", file=sys.stderr)
        return 2
    print(f"{args.out}: {args.shape} x{args.scale}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
          f"MLP {config.intermediate_size}, {args.dtype}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
