"""Capturing what the first decoder layer receives, and running one layer on it (plugin-facing, stable).

The pipeline and whole-model methods (SliceGPT) push calibration batches layer by layer: capture the
inputs of layer 0 once, then feed each layer the previous one's outputs with the same keyword arguments
(attention mask, position embeddings).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from rcpu_bench.model.adapter import decoder_layers


@dataclass
class LayerInput:
    """One calibration batch as layer 0 receives it: hidden states plus the model's layer kwargs."""

    hidden: Tensor
    kwargs: dict[str, Any]


class _Captured(Exception):
    """Raised by the capture hook to stop the forward pass after layer 0's inputs are recorded."""


@torch.no_grad()
def capture_layer_inputs(model: nn.Module, input_ids: Tensor, batch_size: int,
                         device: torch.device) -> list[LayerInput]:
    """Record what layer 0 receives (hidden states, attention mask, position embeddings) per batch.

    A pre-hook with kwargs captures the call and aborts the rest of the forward, which keeps working
    across transformers versions that change the layer signature (position_embeddings since 4.48).
    """
    captured: list[LayerInput] = []

    def hook(_module, args, kwargs):
        hidden = args[0] if args else kwargs.pop("hidden_states")
        captured.append(LayerInput(hidden, {k: v for k, v in kwargs.items() if k != "past_key_values"}))
        raise _Captured

    handle = decoder_layers(model)[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        for batch in input_ids.split(batch_size):
            try:
                model(batch.to(device), use_cache=False)
            except _Captured:
                pass
    finally:
        handle.remove()
    return captured


def _layer_output(output: Any) -> Tensor:
    return output if isinstance(output, Tensor) else output[0]


@torch.no_grad()
def run_layer(layer: nn.Module, inputs: list[LayerInput]) -> list[Tensor]:
    """The layer's outputs for every calibration batch."""
    return [_layer_output(layer(x.hidden, **x.kwargs)) for x in inputs]
