"""Non-finite values stop a run, naming where they are: weights, activation statistics, logits, metrics.

A NaN or ±inf in a weight propagates silently (a NaN norm weight turns every later activation into NaN, and
perplexity into ``nan``; argmax over NaN logits still yields tokens, so zero-shot accuracy looks plausible).
Every command checks at the first place it can, so the error names the layer and module, not a symptom.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn


class NonFiniteError(FloatingPointError, ValueError):
    """A weight, statistic, logit or metric is NaN or infinite (a ValueError: the command's input is unusable)."""


def count_non_finite(tensor: Tensor, chunk: int = 1 << 24) -> int:
    """How many entries of ``tensor`` are NaN or ±inf.

    One sum settles a finite tensor: a NaN or ±inf entry makes Σ t NaN or ±inf (IEEE: NaN + x = NaN,
    ±inf + finite = ±inf, inf − inf = NaN), so a finite sum proves every entry finite. It reads the tensor once
    and allocates nothing (a LLaMA-7B layer's 202M float32 weights: 0.03 s against 1.5-2.4 s for the elementwise
    test, 2 CPU threads). Only a non-finite sum (a non-finite entry, or finite entries whose sum overflows) is
    counted entry by entry, in chunks: the mask of a whole embedding matrix could exhaust a full GPU.
    """
    flat = tensor.detach().reshape(-1)
    if bool(torch.isfinite(flat.sum())):
        return 0
    return sum(int((~torch.isfinite(part)).sum()) for part in flat.split(chunk))


def check_parameters(module: nn.Module, where: str) -> None:
    """Raise NonFiniteError naming the first parameter or buffer of ``module`` holding NaN or ±inf."""
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            if tensor.is_floating_point() and tensor.device.type != "meta" and (bad := count_non_finite(tensor)):
                raise NonFiniteError(f"{where}: the {kind} {name} holds {bad} of {tensor.numel()} non-finite values "
                                     "(NaN or ±inf)")


def check_tensor(tensor: Tensor, what: str) -> None:
    """Raise NonFiniteError when ``tensor`` (named ``what`` in the message) holds NaN or ±inf."""
    if bad := count_non_finite(tensor):
        raise NonFiniteError(f"{what} holds {bad} of {tensor.numel()} non-finite values (NaN or ±inf)")


def check_metrics(metrics: Mapping[str, float], what: str) -> None:
    """Raise NonFiniteError naming each metric of ``metrics`` that is NaN or ±inf."""
    bad = {name: value for name, value in metrics.items() if isinstance(value, float) and not math.isfinite(value)}
    if bad:
        raise NonFiniteError(f"{what}: non-finite {', '.join(f'{k} = {v}' for k, v in bad.items())}")


def check_logits(model: nn.Module, logits: Tensor, what: str) -> None:
    """NonFiniteError at a NaN or ±inf in ``model``'s ``logits``, naming a non-finite weight when there is one."""
    if count_non_finite(logits):
        check_parameters(model, what)
        check_tensor(logits, f"{what}: the model's logits (its weights are finite: the forward pass overflowed; "
                             "try a wider --dtype)")


@contextmanager
def finite_logits(model: nn.Module, what: str) -> Iterator[None]:
    """Check the logits of every forward pass of ``model`` inside the block (perplexity, lm-eval, generate).

    At the first NaN or ±inf the parameters are checked, so that a non-finite weight is named with its layer and
    module; with finite weights the forward pass itself overflowed (a float16 model, say).
    """
    def check(module: nn.Module, args: Any, output: Any) -> None:
        check_logits(model, output.logits if hasattr(output, "logits") else output[0], what)

    handle = model.register_forward_hook(check)
    try:
        yield
    finally:
        handle.remove()
