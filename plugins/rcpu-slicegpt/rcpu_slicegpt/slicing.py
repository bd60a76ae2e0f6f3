"""SliceGPT (Ashkboos et al., ICLR 2024) for Llama-shaped models: fuse, rotate to principal components, slice.

The algorithm (methods-spec §2.3), in the order it runs:

1. untie the LM head from the embeddings (the two are rotated differently);
2. fold every RMSNorm weight γ into the linears that read the norm, W ← W·diag(γ), and replace the norm
   by the parameter-free RMSN (a pre-norm stream is then invariant under orthogonal rotations); each
   layer is fused when the pass below reaches it;
3. PCA of the embeddings' output: H = Σ XᵀX over the calibration tokens (uncentred, float64), damped by
   0.01·mean(diag H)·I, eigh, eigenvalues in descending order: Q₀; E ← E·Q₀[:, :d′];
4. for each layer, from its calibration inputs in the sliced basis:
   q/k/v ← W·Q_in; the attention half's output in the dense basis, h = x̃·Q_inᵀ + Attn(x̃), gives Q_mid by
   PCA; o_proj ← Q_midᵀ·W_o and S_attn = Q_inᵀ·Q_mid; gate/up ← W·Q_mid; the MLP half's output
   y = h̃·Q_midᵀ + MLP(h̃) gives Q_out; down_proj ← Q_outᵀ·W_down and S_mlp = Q_midᵀ·Q_out (every Q sliced
   to its kept columns);
5. LM head ← W_head·diag(γ_final)·Q_out of the last layer.

d′ = ⌊(1 − s)·d⌋ rounded down to a multiple of 8. The final orientation is PCA's (no random rotation);
eigenvectors get a fixed sign, so the result is deterministic. With d′ = d the model computes the same
function as the dense one (up to rounding). Optionally (``center_embeddings``) the embedding rows are
mean-centred, E ← E − mean_j(E), as the reference code does for every model: exact for LayerNorm
models only, it changes a Llama model's function.
"""

from __future__ import annotations

import bisect
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

import torch
from torch import Tensor, nn

from rcpu_bench.model import (
    MODULES,
    LayerInput,
    ModelView,
    capture_layer_inputs,
    check_architecture,
    model_view,
    parameter_count,
)
from rcpu_slicegpt.accounting import sliced_parameter_count
from rcpu_slicegpt.layers import (
    RMSN,
    LayerDims,
    SlicedDecoderLayer,
    SlicePlan,
    set_weight,
)

DAMPING = 0.01
# Model types whose decoder layer computes exactly x + Attn(RMSN(x)), then h + MLP(RMSN(h)), as SlicedDecoderLayer
# does (Granite, for one, multiplies each branch by residual_multiplier).
SLICEABLE = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED = (f"pre-norm Llama-shaped decoders ({', '.join(SLICEABLE)}): layers of exactly self_attn, mlp, "
             "input_layernorm and post_attention_layernorm, RMSNorm norms (weight·x/rms(x)), nn.Embedding "
             "embeddings and an nn.Linear lm_head")


# Model checks ---------------------------------------------------------------------------------------

def _is_rms_norm(module: nn.Module, hidden_size: int) -> bool:
    """A Llama-style RMSNorm: weight·x/sqrt(mean(x²) + ε) with a (d,) weight (not Gemma's (1 + weight))."""
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")
            and isinstance(weight, Tensor) and tuple(weight.shape) == (hidden_size,))


def _support_problem(model: nn.Module) -> str | None:
    """What stops SliceGPT from handling ``model``, or None."""
    d, view = model.config.hidden_size, model_view(model)
    if model.config.model_type not in SLICEABLE:
        return f"model_type {model.config.model_type!r}: its layers do not compute what a sliced layer computes"
    if any(isinstance(layer, SlicedDecoderLayer) for layer in view.layers):
        return "it is already sliced"
    if not isinstance(view.embeddings, nn.Embedding):
        return "the embeddings are not an nn.Embedding"
    if not isinstance(view.lm_head, nn.Linear):
        return "the LM head is not an nn.Linear"
    if not _is_rms_norm(view.final_norm, d):
        return "the final norm is not an RMSNorm"
    for i, layer in enumerate(view.views()):
        children = {name for name, _ in layer.layer.named_children()}
        if children != set(layer.PARTS):
            return f"layer {i} has modules {sorted(children)}; expected {sorted(layer.PARTS)}"
        if not all(_is_rms_norm(layer.norm(module), d) for module in MODULES):
            return f"layer {i}'s norms are not RMSNorms of width {d}"
    return None


def check_supported(model: nn.Module) -> None:
    """Raise ValueError naming the model class and the problem unless SliceGPT supports ``model``."""
    check_architecture(model)
    problem = _support_problem(model)
    if problem:
        raise ValueError(f"SliceGPT does not support {type(model).__name__}: {problem}; supported: {SUPPORTED}")


# Weight transformations (all computed in float64, stored in the weight's dtype) ----------------------

def _f64(tensor: Tensor) -> Tensor:
    """A detached float64 copy (the precision every rotation is computed in)."""
    return tensor.detach().to(torch.float64)


def untie_lm_head(model: nn.Module) -> None:
    """Give the LM head its own copy of a shared weight; stop ``tie_weights()`` (lm-eval's HFLM calls it) re-tying."""
    view = model_view(model)
    if view.lm_head.weight is view.embeddings.weight:
        set_weight(view.lm_head, view.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    model.all_tied_weights_keys = model.get_expanded_tied_weights_keys(all_submodels=True)


def center_rows(embedding: nn.Embedding) -> None:
    """E ← E − mean_j(E): every embedding row gets zero mean (the reference's step; not invariant for RMSNorm)."""
    weight = _f64(embedding.weight)
    set_weight(embedding, (weight - weight.mean(dim=-1, keepdim=True)).to(embedding.weight.dtype))


def fold_norm(norm: nn.Module, linears: Sequence[nn.Linear]) -> None:
    """W ← W·diag(γ) for every linear reading the norm, so that W·(γ ⊙ x̂) = (W·diag(γ))·x̂."""
    gamma = _f64(norm.weight)
    for linear in linears:
        set_weight(linear, (_f64(linear.weight) * gamma).to(linear.weight.dtype))


def rotate_input(linear: nn.Linear, q: Tensor) -> None:
    """W ← W·Q: the linear reads the rotated (and sliced) stream x̃ = x·Q (Q is d × d′)."""
    set_weight(linear, (_f64(linear.weight) @ q).to(linear.weight.dtype))


def rotate_output(linear: nn.Linear, q: Tensor) -> None:
    """W ← Qᵀ·W and b ← Qᵀ·b: the linear writes the rotated (and sliced) stream."""
    bias = None if linear.bias is None else (q.T @ _f64(linear.bias)).to(linear.bias.dtype)
    set_weight(linear, (q.T @ _f64(linear.weight)).to(linear.weight.dtype), bias)


def rotate_embedding(embedding: nn.Embedding, q: Tensor) -> None:
    """E ← E·Q: every token's embedding expressed in the (sliced) principal basis."""
    set_weight(embedding, (_f64(embedding.weight) @ q).to(embedding.weight.dtype))


def set_shortcut(shortcut: nn.Linear, q_from: Tensor, q_to: Tensor) -> None:
    """S = Q_fromᵀ·Q_to maps the residual from one sliced basis to the next (stored transposed, as nn.Linear)."""
    set_weight(shortcut, (q_to.T @ q_from).to(shortcut.weight.dtype))


# PCA ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Basis:
    """Principal directions of a set of activations: undamped eigenvalues (descending) and eigenvectors (columns)."""

    eigenvalues: Tensor
    vectors: Tensor

    def kept(self, dim: int) -> Tensor:
        """Q[:, :d′], the d′ leading directions."""
        return self.vectors[:, :dim]

    def energy_kept(self, dim: int) -> float:
        """Σ_{i<d′} λ_i / Σ λ_i: the fraction of Σ‖x‖² that slicing to d′ keeps."""
        return (self.eigenvalues[:dim].sum() / self.eigenvalues.sum()).item()


def gram(activations: Sequence[Tensor]) -> Tensor:
    """H = Σ XᵀX over every token of every batch (uncentred), in float64."""
    total = None
    for x in activations:
        flat = _f64(x.reshape(-1, x.shape[-1]))
        total = flat.T @ flat if total is None else total + flat.T @ flat
    return total


def principal_basis(activations: Sequence[Tensor]) -> Basis:
    """Eigendecomposition of H + δI, δ = 0.01·mean(diag H), eigenvalues descending.

    The damping only shifts the eigenvalues (it is undone in ``Basis.eigenvalues``). Each eigenvector's
    largest-magnitude entry is made positive, fixing eigh's arbitrary signs.
    """
    h = gram(activations)
    damping = DAMPING * h.diagonal().mean()
    values, vectors = torch.linalg.eigh(h + damping * torch.eye(len(h), dtype=h.dtype, device=h.device))
    values, vectors = values.flip(0), vectors.flip(1)
    signs = vectors.gather(0, vectors.abs().argmax(0, keepdim=True)).sign()
    return Basis(values - damping, vectors * torch.where(signs == 0, 1.0, signs))


def project(x: Tensor, matrix: Tensor) -> Tensor:
    """x·M in float64, returned in x's dtype (M = Q to enter a sliced basis, Qᵀ to leave it)."""
    return (_f64(x) @ matrix).to(x.dtype)


# The sequential pass --------------------------------------------------------------------------------

def _principal_step(dense: list[Tensor], dim: int) -> tuple[Basis, Tensor, list[Tensor]]:
    """PCA of a residual stream given in the dense basis, its kept directions Q[:, :d′], and the stream x·Q[:, :d′]."""
    basis = principal_basis(dense)
    return basis, basis.kept(dim), [project(y, basis.kept(dim)) for y in dense]


def _slice_layer(model: ModelView, index: int, inputs: list[LayerInput], q_in: Tensor,
                 dims: LayerDims) -> tuple[Tensor, list[LayerInput], dict[str, Any]]:
    """Fuse, rotate and slice layer ``index`` in place; returns Q_out (sliced), the next inputs and diagnostics."""
    layer, config = model.layer(index), model.model.config
    attn_reads, mlp_reads = layer.producers("attention"), layer.producers("mlp")
    fold_norm(layer.norm("attention"), attn_reads)
    fold_norm(layer.norm("mlp"), mlp_reads)
    sliced = SlicedDecoderLayer(layer.block("attention"), layer.block("mlp"), dims, hidden_size=config.hidden_size,
                                eps=config.rms_norm_eps)
    model.layers[index] = sliced
    for linear in attn_reads:
        rotate_input(linear, q_in)
    # h = x̃·Q_inᵀ + Attn(x̃) and y = h̃·Q_midᵀ + MLP(h̃) are the residual adds in the dense basis.
    mid_basis, q_mid, mids = _principal_step(
        [project(x.hidden, q_in.T) + sliced.attention_branch(x.hidden, **x.kwargs) for x in inputs], dims.mlp_in)
    rotate_output(layer.projection("attention"), q_mid)
    set_shortcut(sliced.attn_shortcut, q_in, q_mid)
    for linear in mlp_reads:
        rotate_input(linear, q_mid)
    out_basis, q_out, outputs = _principal_step([project(h, q_mid.T) + sliced.mlp_branch(h) for h in mids], dims.out)
    rotate_output(layer.projection("mlp"), q_out)
    set_shortcut(sliced.mlp_shortcut, q_mid, q_out)
    report = {"layer": index, "attn_in": dims.attn_in, "mlp_in": dims.mlp_in, "out": dims.out,
              "energy_kept_mid": mid_basis.energy_kept(dims.mlp_in), "energy_kept_out": out_basis.energy_kept(dims.out)}
    return q_out, [LayerInput(y, x.kwargs) for y, x in zip(outputs, inputs, strict=True)], report


@torch.no_grad()
def apply_plan(model: nn.Module, calib_ids: Tensor, plan: SlicePlan, *, batch_size: int = 8,
               center_embeddings: bool = False) -> dict[str, Any]:
    """Fuse, rotate and slice ``model`` in place to the widths of ``plan``; returns per-layer diagnostics."""
    check_supported(model)
    view = model_view(model)
    if len(plan.layers) != len(view.layers) or plan.hidden_size != model.config.hidden_size:
        raise ValueError(f"the slice plan ({len(plan.layers)} layers, d={plan.hidden_size}) does not fit the model "
                         f"({len(view.layers)} layers, d={model.config.hidden_size})")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1")
    if calib_ids.ndim != 2 or calib_ids.numel() == 0:
        raise ValueError(f"calib_ids must be a non-empty (windows × tokens) tensor, got shape {tuple(calib_ids.shape)}")
    started = time.perf_counter()
    untie_lm_head(model)
    if center_embeddings:
        center_rows(view.embeddings)
    device = view.embeddings.weight.device
    captured = capture_layer_inputs(model, calib_ids, batch_size, device)
    basis = principal_basis([x.hidden for x in captured])
    q = basis.kept(plan.embedding)
    rotate_embedding(view.embeddings, q)
    inputs = [LayerInput(project(x.hidden, q), x.kwargs) for x in captured]
    layers = []
    for index, dims in enumerate(plan.layers):
        q, inputs, report = _slice_layer(view, index, inputs, q, dims)
        layers.append(report)
    fold_norm(view.final_norm, [view.lm_head])
    view.final_norm = RMSN(model.config.hidden_size, model.config.rms_norm_eps)
    rotate_input(view.lm_head, q)
    return {"embedding": plan.embedding, "energy_kept_embedding": basis.energy_kept(plan.embedding),
            "head": plan.head, "layers": layers, "seconds": time.perf_counter() - started}


# Choosing d′ ----------------------------------------------------------------------------------------

def _check_round_to(round_to: int) -> None:
    """d′ is rounded down to a multiple of ``round_to``, a positive integer."""
    if not isinstance(round_to, int) or round_to < 1:
        raise ValueError(f"round_to={round_to!r} must be a positive integer")


def sliced_dim(hidden_size: int, sparsity: float, round_to: int = 8) -> int:
    """d′ = r·⌊⌊(1 − s)·d⌋ / r⌋, with (1 − s)·d computed exactly from s's decimal form."""
    _check_round_to(round_to)
    if not isinstance(sparsity, (int, float)) or math.isnan(sparsity) or not 0 <= sparsity < 1:
        raise ValueError(f"sparsity {sparsity!r} is outside [0, 1): it is the sliced fraction of the hidden size")
    dim = math.floor((1 - Fraction(str(sparsity))) * hidden_size) // round_to * round_to
    if dim < 1:
        raise ValueError(f"sparsity {sparsity} leaves no dimension of d={hidden_size} in multiples of {round_to}")
    return dim


def _uniform_plan(model: nn.Module, dim: int, slice_head: bool) -> SlicePlan:
    """Every layer of ``model`` sliced to ``dim`` (see ``SlicePlan.uniform``)."""
    return SlicePlan.uniform(model.config.hidden_size, dim, len(model_view(model).layers), slice_head=slice_head)


def dim_for_parameters(model: nn.Module, target: int, round_to: int = 8, *, slice_head: bool = False) -> int:
    """The largest multiple of ``round_to``, d′ ≤ d, whose sliced model has at most ``target`` parameters.

    The count (shortcuts and untied head included) grows with d′, so a bisection finds the last d′ that fits.
    """
    _check_round_to(round_to)
    candidates = range(round_to, model.config.hidden_size + 1, round_to)

    def count(dim: int) -> int:
        return sliced_parameter_count(model, _uniform_plan(model, dim, slice_head))

    fitting = bisect.bisect_right(candidates, target, key=count)
    if fitting == 0:
        smallest = f"d′={round_to} gives {count(round_to):,}"
        detail = smallest if candidates else f"d={model.config.hidden_size} < {round_to}"
        raise ValueError(f"target of {target:,} parameters is unreachable: the smallest slicing ({detail})")
    return candidates[fitting - 1]


# Public API -----------------------------------------------------------------------------------------

def parameter_report(dense: int, sliced: int) -> dict[str, Any]:
    """Real counts and their change; SliceGPT's shortcuts and untied head can make the model grow."""
    report = {"dense": dense, "sliced": sliced, "removed_fraction": 1 - sliced / dense, "grows": sliced > dense}
    if sliced > dense:
        report["note"] = (f"the sliced model has {sliced - dense:,} MORE parameters than the dense one "
                          "(shortcut matrices and the untied LM head outweigh the sliced hidden dimension)")
    return report


def choose_dim(model: nn.Module, *, sparsity: float | None = None, target_params: int | None = None,
               round_to: int = 8, slice_head: bool = False) -> int:
    """d′ from exactly one of ``sparsity`` (``sliced_dim``) or ``target_params`` (``dim_for_parameters``)."""
    if (sparsity is None) == (target_params is None):
        raise ValueError("give exactly one of sparsity (hidden fraction) or target_params (parameter budget)")
    check_supported(model)
    if sparsity is not None:
        return sliced_dim(model.config.hidden_size, sparsity, round_to)
    return dim_for_parameters(model, target_params, round_to, slice_head=slice_head)


def _run(model: nn.Module, calib_ids: Tensor, dim: int, request: dict[str, Any], *, batch_size: int,
         slice_head: bool, center_embeddings: bool) -> dict[str, Any]:
    """Slice to a uniform ``dim`` and report what was asked, what was done and the real parameter change."""
    plan = _uniform_plan(model, dim, slice_head)
    dense = parameter_count(model)
    details = apply_plan(model, calib_ids, plan, batch_size=batch_size, center_embeddings=center_embeddings)
    d = model.config.hidden_size
    return {"method": "slicegpt", "implementation": "rcpu-slicegpt", "request": request,
            "hidden_size": d, "sliced_hidden_size": dim, "sliced_fraction": 1 - dim / d,
            "slice_head": slice_head, "center_embeddings": center_embeddings, "final_orientation": "pca",
            "parameters": parameter_report(dense, parameter_count(model)), **details}


def fuse_and_rotate(model: nn.Module, calib_ids: Tensor, *, batch_size: int = 8,
                    center_embeddings: bool = False) -> dict[str, Any]:
    """Every SliceGPT step but slicing (d′ = d): the model computes the same function in the principal basis."""
    return _run(model, calib_ids, model.config.hidden_size, {"sparsity": 0.0}, batch_size=batch_size,
                slice_head=False, center_embeddings=center_embeddings)


def slice_model(model: nn.Module, calib_ids: Tensor, *, sparsity: float | None = None, target_params: int | None = None,
                round_to: int = 8, batch_size: int = 8, slice_head: bool = False,
                center_embeddings: bool = False) -> dict[str, Any]:
    """Slice ``model`` in place with SliceGPT and return a report.

    Exactly one of ``sparsity`` (the sliced fraction s of the hidden size: d′ = ⌊(1 − s)·d⌋ rounded down to
    a multiple of ``round_to``) or ``target_params`` (the largest such d′ whose real parameter count,
    shortcuts and untied head included, is at most the target). ``slice_head`` also slices the LM head's input.
    The report gives d′, the sliced fraction 1 − d′/d and the real parameter change (``grows`` when the model
    has more parameters than before).
    """
    request = {"sparsity": sparsity} if target_params is None else {"target_params": target_params}
    dim = choose_dim(model, sparsity=sparsity, target_params=target_params, round_to=round_to, slice_head=slice_head)
    return _run(model, calib_ids, dim, {**request, "round_to": round_to}, batch_size=batch_size,
                slice_head=slice_head, center_embeddings=center_embeddings)
