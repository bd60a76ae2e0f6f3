"""Inference speed in llama.cpp (through llama-cpp-python): prefill and decode tokens/s of a GGUF file.

Measured as ``rcpu_bench.evaluation.speed`` measures transformers, so the two engines' figures sit side by
side: batch 1, a prompt of random ids evaluated in one batch (the prefill, filling the KV cache), then
``new_tokens`` single-token steps each on the previous step's greedy token (the decode), an untimed warm-up
first, each rate from the median of ``repeats`` runs. The random state of the caller is untouched.
:func:`model_speed` times a loaded (pruned) model through a temporary GGUF export: ``rcpu-bench speed
--engine llama.cpp`` and a matrix cell's ``eval: [speed-llama-cpp]`` (``Record.inference_llama_cpp``).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from rcpu_bench.evaluation.speed import NEW_TOKENS, PROMPT_TOKENS, REPEATS, check_counts, rates
from rcpu_bench.export.gguf import check_dtype, export_gguf

GGUF_DTYPE = "float16"  # the type of the timed GGUF matrices unless asked otherwise (llama.cpp's usual one)
# llama.cpp's AMX kernels take only quantized matrices; float matrices never reach them.
UNQUANTIZED_TYPES = frozenset({"F32", "F16", "BF16"})
AVX2_REBUILD = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON '
                '-DGGML_BMI2=ON" pip install --no-cache-dir --force-reinstall --no-deps llama-cpp-python')


def require_llama_cpp() -> Any:
    """The ``llama_cpp`` module, or ImportError saying how to install it."""
    try:
        import llama_cpp
    except ImportError as error:
        raise ImportError("llama.cpp timings need llama-cpp-python: pip install 'rcpu-bench[gguf]'") from error
    return llama_cpp


def load_gguf(path: str | os.PathLike, *, n_ctx: int, threads: int | None = None, logits_all: bool = False,
              float32_cache: bool = False) -> Any:
    """A ``llama_cpp.Llama`` of the GGUF file at ``path`` on the CPU, its whole prompt decoded as one batch.

    ``float32_cache``: keys and values cached in float32 instead of llama.cpp's default float16 (for exact
    comparisons; the timings use the default).
    """
    llama_cpp = require_llama_cpp()
    check_no_amx_quantized(llama_cpp.llama_print_system_info().decode(), path)
    cache_type = {"type_k": llama_cpp.GGML_TYPE_F32, "type_v": llama_cpp.GGML_TYPE_F32} if float32_cache else {}
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, n_batch=n_ctx, n_ubatch=n_ctx, n_threads=threads,
                           n_threads_batch=threads, n_gpu_layers=0, logits_all=logits_all, verbose=False,
                           **cache_type)


def quantized_types(path: str | os.PathLike) -> set[str]:
    """The names of the quantized matrix types (Q8_0, Q4_K, ...) among the GGUF file's tensors."""
    from gguf import GGUFReader

    return {tensor.tensor_type.name for tensor in GGUFReader(path).tensors} - UNQUANTIZED_TYPES


def check_no_amx_quantized(system_info: str, path: str | os.PathLike) -> None:
    """Refuse a quantized GGUF file on a llama.cpp build with AMX kernels (``AMX_INT8 = 1`` in its system info,
    a native build on a Xeon since Sapphire Rapids): their matrix product ends the process with a segmentation
    fault, which no Python code can catch or report."""
    if "AMX_INT8 = 1" not in system_info:
        return
    quantized = quantized_types(path)
    if quantized:
        raise RuntimeError(
            f"{path} holds quantized matrices ({', '.join(sorted(quantized))}) and this llama-cpp-python build "
            f"runs them through llama.cpp's AMX kernels, which crash the process; rebuild it for AVX2: {AVX2_REBUILD}")


def greedy_token(llm: Any) -> int:
    """The highest-scoring next token after the tokens evaluated so far (the last evaluated token's logits;
    ``Llama.scores`` holds them only with ``logits_all``)."""
    llama_cpp = require_llama_cpp()
    logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(llm.n_vocab(),))
    return int(np.argmax(logits))


def prefill_and_decode(llm: Any, ids: list[int], new_tokens: int) -> tuple[float, float]:
    """Seconds of one prefill of ``ids`` (from an empty cache) and of ``new_tokens`` greedy decode steps."""
    llm.reset()
    started = time.perf_counter()
    llm.eval(ids)
    prefill = time.perf_counter() - started
    started = time.perf_counter()
    for _ in range(new_tokens):
        llm.eval([greedy_token(llm)])
    return prefill, time.perf_counter() - started


def llama_cpp_speed(path: str | os.PathLike, *, prompt_tokens: int = PROMPT_TOKENS, new_tokens: int = NEW_TOKENS,
                    repeats: int = REPEATS, threads: int | None = None, seed: int = 0) -> dict[str, Any]:
    """Prefill and decode throughput of the GGUF model at ``path`` in llama.cpp on the CPU (batch 1).

    prefill_tokens_per_s = prompt_tokens / t_prefill, decode_tokens_per_s = new_tokens / t_decode, each t the
    median over ``repeats`` runs after a warm-up (a prefill and one step). ``threads``: llama.cpp's threads
    (None: its default). Returns the fields of ``speed.inference_speed`` with device "cpu (llama.cpp)" and threads.
    """
    check_counts(batch_size=1, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats)
    llm = load_gguf(path, n_ctx=prompt_tokens + new_tokens, threads=threads)
    ids = np.random.default_rng(seed).integers(0, llm.n_vocab(), prompt_tokens).tolist()
    prefill_and_decode(llm, ids, 1)  # warm-up
    runs = [prefill_and_decode(llm, ids, new_tokens) for _ in range(repeats)]
    prefill, decode = rates(runs, batch_size=1, prompt_tokens=prompt_tokens, new_tokens=new_tokens)
    return {"batch_size": 1, "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "prefill_tokens_per_s": prefill,
            "decode_tokens_per_s": decode, "device": "cpu (llama.cpp)", "repeats": repeats,
            "threads": llm.context_params.n_threads}


def model_speed(model: Any, tokenizer: Any, *, dtype: str = GGUF_DTYPE, prompt_tokens: int = PROMPT_TOKENS,
                new_tokens: int = NEW_TOKENS, repeats: int = REPEATS, threads: int | None = None) -> dict[str, Any]:
    """:func:`llama_cpp_speed` of ``model`` exported (with its ``tokenizer``) to a temporary GGUF file of
    matrices in ``dtype``, deleted afterwards; the result also names ``gguf_dtype``."""
    check_dtype(dtype)
    check_counts(batch_size=1, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats)
    require_llama_cpp()
    with tempfile.TemporaryDirectory(prefix="rcpu-speed-") as scratch:
        path = Path(scratch) / "model.gguf"
        export_gguf(model, tokenizer, path, dtype=dtype)
        speed = llama_cpp_speed(path, prompt_tokens=prompt_tokens, new_tokens=new_tokens, repeats=repeats,
                                threads=threads)
    return {**speed, "gguf_dtype": dtype}
