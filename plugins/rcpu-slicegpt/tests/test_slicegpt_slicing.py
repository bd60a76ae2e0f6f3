"""Slicing: shapes, generation with and without the KV cache, the untied head, PCA, determinism and errors."""

import numpy as np
import pytest
import torch
from slicegpt_helpers import copy_of, random_ids, tiny_llama
from transformers import GPT2Config, GPT2LMHeadModel, GraniteConfig, GraniteForCausalLM

from rcpu_bench.model import capture_layer_inputs, parameter_count
from rcpu_slicegpt import SlicePlan, slice_model, sliced_parameter_count
from rcpu_slicegpt.slicing import principal_basis, sliced_dim


@pytest.fixture(scope="module")
def sliced(stories, calib_ids):
    """stories260K (GQA) sliced by 25 %: d′ = 48 of 64; and its report."""
    model = copy_of(stories["stories260K"].model)
    return model, slice_model(model, calib_ids, sparsity=0.25)


def test_slicing_reduces_the_hidden_size_to_d_prime(sliced):
    model, report = sliced
    assert report["sliced_hidden_size"] == 48 and report["sliced_fraction"] == 0.25
    assert model.model.embed_tokens.weight.shape == (512, 48)
    for index, layer in enumerate(model.model.layers):
        out = 64 if index == len(model.model.layers) - 1 else 48  # the LM head reads the full width by default
        attn, mlp = layer.self_attn, layer.mlp
        assert [attn.q_proj.in_features, attn.k_proj.in_features, attn.v_proj.in_features] == [48, 48, 48]
        assert attn.o_proj.out_features == 48 and mlp.gate_proj.in_features == mlp.up_proj.in_features == 48
        assert mlp.down_proj.out_features == out
        assert layer.attn_shortcut.weight.shape == (48, 48) and layer.mlp_shortcut.weight.shape == (out, 48)
    assert model.lm_head.weight.shape == (512, 64)
    assert report["parameters"]["sliced"] == parameter_count(model)


def test_generation_is_the_same_with_and_without_cache(sliced, stories):
    model, _ = sliced
    prompt = stories["stories260K"].tokenizer("Once upon a time", return_tensors="pt").input_ids
    settings = {"max_new_tokens": 24, "do_sample": False, "pad_token_id": model.config.eos_token_id}
    cached = model.generate(prompt, use_cache=True, **settings)
    uncached = model.generate(prompt, use_cache=False, **settings)
    assert cached.shape[1] > prompt.shape[1]
    assert torch.equal(cached, uncached)


def test_untied_head_survives_tie_weights_and_lm_eval(sliced, stories, calib_ids):
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, _ = sliced
    before = model(calib_ids[:2]).logits
    model.tie_weights()
    lm = HFLM(pretrained=model, tokenizer=stories["stories260K"].tokenizer, batch_size=2)  # calls tie_weights too
    assert model.lm_head.weight.shape != model.model.embed_tokens.weight.shape
    assert torch.equal(model(calib_ids[:2]).logits, before)
    request = Instance("loglikelihood", {}, ("Once upon a time, there was a", " little girl"), 0)
    (loglikelihood, _), = lm.loglikelihood([request])
    assert np.isfinite(loglikelihood) and loglikelihood < 0


def test_slice_head_slices_the_lm_head_input(stories, calib_ids):
    model = copy_of(stories["stories260K-mha"].model)
    dense = copy_of(model)
    report = slice_model(model, calib_ids, sparsity=0.25, slice_head=True)
    assert model.lm_head.in_features == 48 and model.model.layers[-1].mlp.down_proj.out_features == 48
    assert parameter_count(model) == sliced_parameter_count(dense, SlicePlan.uniform(64, 48, 5, slice_head=True))
    assert report["parameters"]["sliced"] == parameter_count(model)


def test_pca_keeps_the_top_eigen_directions(stories, calib_ids):
    """Rotating the captured embeddings by Q and slicing to d′ keeps the energy of the top d′ eigenvalues."""
    dense = copy_of(stories["stories260K"].model, torch.float64)
    inputs = [x.hidden for x in capture_layer_inputs(dense, calib_ids, 8, torch.device("cpu"))]
    flat = torch.cat(inputs).reshape(-1, 64).numpy()
    eigenvalues = np.linalg.eigvalsh(flat.T @ flat)[::-1]  # independent of the code under test
    basis = principal_basis(inputs)
    for dim in (8, 32, 48):
        kept = flat @ basis.kept(dim).numpy()
        assert (kept ** 2).sum() == pytest.approx(eigenvalues[:dim].sum(), rel=1e-10)
        assert basis.energy_kept(dim) == pytest.approx(eigenvalues[:dim].sum() / eigenvalues.sum(), rel=1e-10)
    np.testing.assert_allclose(basis.vectors.T @ basis.vectors, np.eye(64), atol=1e-12)
    # End to end: the sliced model's embeddings of the calibration tokens hold exactly that energy.
    model = copy_of(dense)
    report = slice_model(model, calib_ids, sparsity=0.25)
    sliced_energy = model.model.embed_tokens(calib_ids).square().sum().item()
    assert sliced_energy == pytest.approx(eigenvalues[:48].sum(), rel=1e-9)
    assert report["energy_kept_embedding"] == pytest.approx(eigenvalues[:48].sum() / eigenvalues.sum(), rel=1e-9)


def test_slicing_is_deterministic(calib_ids):
    dense = tiny_llama(2)
    ids = random_ids(dense, 8, 16, seed=4)
    first, second = copy_of(dense), copy_of(dense)
    slice_model(first, ids, sparsity=0.5)
    slice_model(second, ids, sparsity=0.5)
    for (name, a), (_, b) in zip(first.state_dict().items(), second.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("sparsity, dim", [(0.0, 64), (0.1, 56), (0.2, 48), (0.25, 48), (0.3, 40), (0.5, 32)])
def test_sliced_dim_rounds_down_to_a_multiple_of_8(sparsity, dim):
    assert sliced_dim(64, sparsity) == dim


@pytest.mark.parametrize("sparsity", [1.0, -0.1, float("nan"), 0.9, "0.2"])
def test_bad_sparsity_is_rejected(sparsity):
    with pytest.raises(ValueError, match="sparsity"):
        sliced_dim(64, sparsity)


def test_bad_requests_are_rejected_before_any_change():
    model = tiny_llama(4)
    ids = random_ids(model, 2, 8, seed=5)
    with pytest.raises(ValueError, match="exactly one"):
        slice_model(model, ids)
    with pytest.raises(ValueError, match="exactly one"):
        slice_model(model, ids, sparsity=0.2, target_params=10_000)
    with pytest.raises(ValueError, match="unreachable"):
        slice_model(model, ids, target_params=1_000)
    with pytest.raises(ValueError, match="round_to"):
        slice_model(model, ids, sparsity=0.2, round_to=0)
    assert all(type(layer).__name__ == "LlamaDecoderLayer" for layer in model.model.layers)


def test_unsupported_models_are_rejected(sliced):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=32, n_positions=16,
                                     bos_token_id=0, eos_token_id=0))
    with pytest.raises(ValueError, match="unsupported architecture GPT2LMHeadModel"):
        slice_model(gpt2, torch.zeros(1, 4, dtype=torch.long), sparsity=0.2)
    model, _ = sliced
    with pytest.raises(ValueError, match="already sliced"):
        slice_model(model, torch.zeros(1, 4, dtype=torch.long), sparsity=0.2)
    granite = GraniteForCausalLM(GraniteConfig(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
                                               num_attention_heads=2, num_key_value_heads=2, residual_multiplier=0.5,
                                               bos_token_id=0, eos_token_id=0, pad_token_id=0))
    with pytest.raises(ValueError, match="model_type 'granite': its layers do not compute what a sliced layer"):
        slice_model(granite, torch.zeros(1, 4, dtype=torch.long), sparsity=0.2)
