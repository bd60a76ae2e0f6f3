"""Every model family on a tiny random model built from its own transformers config (2 layers, random biases and
norm weights): exactness at ratio 0, ``none`` against an independently masked dense model, compensation against
``none`` on the calibration tokens, parameter counts against a count from the config, and the refusals."""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import pytest
import torch
import transformers
from torch import Tensor, nn

from rcpu_bench.model.adapter import check_architecture, layer_view
from rcpu_bench.model.families import FAMILIES
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.pruning.pipeline import prune_model

COMPENSATORS = ("none", "flap-bias", "ridge", "procrustes", "scaled-procrustes")
D, HEADS, KV_HEADS, HEAD_DIM, CHANNELS, VOCAB = 24, 6, 3, 6, 20, 61  # head_dim ≠ d / heads, ≠ 128
COMMON = dict(vocab_size=VOCAB, hidden_size=D, intermediate_size=CHANNELS, num_hidden_layers=2,
              num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM, max_position_embeddings=64,
              initializer_range=0.3, bos_token_id=1, eos_token_id=2, pad_token_id=0)


@dataclass(frozen=True)
class Case:
    """A family's tiny config and, for the independent parameter count, where it has biases and norm weights."""

    config: str
    options: dict = field(default_factory=dict)
    qkv_bias: bool = False
    out_bias: bool = False  # o_proj and the MLP's projections (Llama's attention_bias / mlp_bias)
    layer_norms: int = 2  # d-sized norm weights per layer
    head_norms: str = ""  # "head": q/k norms of head_dim; "all": q over all heads, k over all kv heads
    final_norm: bool = True
    prune: tuple[str, ...] = ("attention", "mlp")


CASES = {
    "llama": Case("LlamaConfig", dict(tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=10000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=16))),
    "llama-biases": Case("LlamaConfig", dict(attention_bias=True, mlp_bias=True), qkv_bias=True, out_bias=True),
    "mistral": Case("MistralConfig", dict(sliding_window=4)),
    "qwen2": Case("Qwen2Config", qkv_bias=True),
    "qwen3": Case("Qwen3Config", head_norms="head"),
    "gemma2": Case("Gemma2Config", dict(sliding_window=4, attn_logit_softcapping=5.0, final_logit_softcapping=3.0,
                                        query_pre_attn_scalar=8), layer_norms=4),
    "gemma3": Case("Gemma3TextConfig", dict(sliding_window=4, query_pre_attn_scalar=8), layer_norms=4,
                   head_norms="head"),
    "olmo": Case("OlmoConfig", dict(clip_qkv=1.0), layer_norms=0, final_norm=False),
    "olmo2": Case("Olmo2Config", head_norms="all", prune=("mlp",)),
    "granite": Case("GraniteConfig", dict(embedding_multiplier=2.0, attention_multiplier=0.3, residual_multiplier=0.5,
                                          logits_scaling=3.0)),
    "phi3": Case("Phi3Config"),
}


def build(name: str, seed: int = 0) -> nn.Module:
    """The tiny model of case ``name``, with every bias and norm weight drawn at random (not 0 / 1)."""
    case = CASES[name]
    config = getattr(transformers, case.config)(**{**COMMON, **case.options})
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = transformers.AutoModelForCausalLM.from_config(config)
        with torch.no_grad():
            for key, parameter in model.named_parameters():
                if "norm" in key or key.endswith("bias"):
                    parameter.copy_(1 + 0.5 * torch.randn_like(parameter) if "norm" in key
                                    else 0.5 * torch.randn_like(parameter))
    model.set_attn_implementation("eager")
    return model.eval()


def ids(batch: int = 8, length: int = 12, seed: int = 0) -> Tensor:
    return torch.randint(3, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def logits(model: nn.Module, tokens: Tensor) -> Tensor:
    with torch.no_grad():
        return model(tokens).logits


def prune(model: nn.Module, name: str, **options) -> list[dict]:
    config = PruneConfig(**{"ratio": 0.34, "prune": CASES[name].prune, "compensate": CASES[name].prune, **options})
    return prune_model(model, ids(), config, progress=False, registry=default_registry()).layers


def pruned_columns(report: dict, module: str) -> Tensor:
    """The consumer columns a module report pruned: kv groups of 2 query heads of HEAD_DIM, or channels."""
    units = torch.tensor(report["pruned_units"], dtype=torch.long)
    size = (HEADS // KV_HEADS) * HEAD_DIM if module == "attention" else 1
    return (units[:, None] * size + torch.arange(size)).reshape(-1)


def consumer(layer: nn.Module, module: str) -> nn.Linear:
    """The pruned projection, named independently of the code under test."""
    return layer.self_attn.o_proj if module == "attention" else layer.mlp.down_proj


@pytest.mark.parametrize("name", CASES)
def test_every_family_is_recognised(name):
    model = build(name)
    check_architecture(model)
    assert layer_view(model.model.layers[0]).geometry.n_heads == HEADS
    assert {f.name for f in FAMILIES} >= {"Llama", "Mistral", "Qwen2", "Qwen3", "Gemma2", "Gemma3", "OLMo", "OLMo2",
                                          "Granite", "Phi3"}


RATIO_ZERO = [(name, "procrustes") for name in CASES if name != "llama-biases"]
RATIO_ZERO += [("llama-biases", compensator) for compensator in COMPENSATORS]


@pytest.mark.parametrize("precision, atol", [("float64", 1e-5), ("mixed", 1e-4)])
@pytest.mark.parametrize("name, compensator", RATIO_ZERO)
def test_ratio_zero_leaves_the_logits_unchanged(name, compensator, precision, atol):
    """Every family with the default compensator; every compensator keeps existing o_proj / down_proj biases
    ("llama-biases"): a compensator's bias adds to them. In float64 statistics Q = I to rounding; the default mixed
    statistics (float32 products summed in float64, procrustes' cross statistic C from the module's own float32
    outputs) leave Q = I up to float32 rounding, measured up to 6.8e-5 on Gemma-2's logits."""
    model = build(name)
    dense = copy.deepcopy(model)
    reports = prune(model, name, ratio=0.0, compensator=compensator, gram_precision=precision)
    assert all(layer[m]["units_pruned"] == 0 for layer in reports for m in CASES[name].prune)
    torch.testing.assert_close(logits(model, ids(seed=1)), logits(dense, ids(seed=1)), atol=atol, rtol=0)


@pytest.mark.parametrize("name", CASES)
def test_none_equals_the_masked_dense_model(name):
    """Physical removal without compensation = the dense model with the pruned heads' o_proj columns and the pruned
    channels' down_proj columns zeroed (its q/k/v and gate/up rows left as they are)."""
    model = build(name)
    masked = copy.deepcopy(model)
    reports = prune(model, name, compensator="none")
    assert any(layer[m]["units_pruned"] for layer in reports for m in CASES[name].prune)
    with torch.no_grad():
        for layer, report in zip(masked.model.layers, reports, strict=True):
            for module in CASES[name].prune:
                consumer(layer, module).weight[:, pruned_columns(report[module], module)] = 0
    torch.testing.assert_close(logits(model, ids(seed=1)), logits(masked, ids(seed=1)), atol=1e-5, rtol=0)


def consumer_inputs(model: nn.Module, modules: tuple[str, ...]) -> dict[tuple[int, str], Tensor]:
    """Every consumer's inputs (tokens × columns, float64) over the calibration tokens, from the dense model."""
    seen: dict[tuple[int, str], Tensor] = {}
    handles = [consumer(layer, module).register_forward_pre_hook(
        lambda _m, args, key=(i, module): seen.__setitem__(key, args[0].reshape(-1, args[0].shape[-1]).double()))
        for i, layer in enumerate(model.model.layers) for module in modules]
    logits(model, ids())
    for handle in handles:
        handle.remove()
    return seen


def reconstruction_error(dense: nn.Linear, pruned: nn.Linear, x: Tensor, pruned_columns: Tensor) -> float:
    """‖Y − Ŷ‖_F² with Y = x Wᵀ + b (dense) and Ŷ = x_K W̃ᵀ + b̃ (the pruned consumer on the kept columns)."""
    dense, pruned = dense.requires_grad_(False), pruned.requires_grad_(False)
    kept = torch.ones(x.shape[1], dtype=torch.bool)
    kept[pruned_columns] = False
    def double(bias: Tensor | None) -> Tensor | None:
        return None if bias is None else bias.double()

    y = nn.functional.linear(x, dense.weight.double(), double(dense.bias))
    y_hat = nn.functional.linear(x[:, kept], pruned.weight.double(), double(pruned.bias))
    return float((y - y_hat).square().sum())


@pytest.mark.parametrize("name", CASES)
def test_every_compensator_lowers_each_modules_calibration_error(name):
    """One-shot statistics (every layer sees the dense model's inputs), so each module's error is measured on the
    dense model's consumer inputs: every compensator below ``none``, module by module."""
    dense = build(name)
    modules = CASES[name].prune
    inputs = consumer_inputs(dense, modules)
    errors = {}
    for compensator in COMPENSATORS:
        model = copy.deepcopy(dense)
        reports = prune(model, name, compensator=compensator, statistics="one-shot")
        for i, report in enumerate(reports):
            for module in modules:
                errors[compensator, i, module] = reconstruction_error(
                    consumer(dense.model.layers[i], module), consumer(model.model.layers[i], module),
                    inputs[i, module], pruned_columns(report[module], module))
    for (compensator, i, module), error in errors.items():
        if compensator != "none":
            assert error < errors["none", i, module], (compensator, i, module)


def independent_count(name: str, model: nn.Module, reports: list[dict]) -> int:
    """Parameters from the config and the kept counts alone: embeddings (once if tied), head, per layer q/k/v/o and
    gate/up/down with their biases, norm weights, q/k norms, final norm."""
    case, config = CASES[name], model.config
    count = VOCAB * D * (1 if config.tie_word_embeddings else 2) + (D if case.final_norm else 0)
    for report in reports:
        kv = KV_HEADS - report["attention"]["units_pruned"] if "attention" in report else KV_HEADS
        heads, channels = kv * HEADS // KV_HEADS, CHANNELS - report["mlp"]["units_pruned"]
        q, k = heads * HEAD_DIM, kv * HEAD_DIM
        count += D * (q + 2 * k) + q * D + (q + 2 * k if case.qkv_bias else 0) + (D if case.out_bias else 0)
        count += 3 * D * channels + (2 * channels + D if case.out_bias else 0)
        count += case.layer_norms * D + {"": 0, "head": 2 * HEAD_DIM, "all": q + k}[case.head_norms]
    return count


@pytest.mark.parametrize("name", CASES)
def test_parameter_counts_equal_a_count_from_the_config(name):
    model = build(name)
    reports = prune(model, name, compensator="ridge")
    assert parameter_count(model) == independent_count(name, model, reports)
    unpruned, nothing = build(name), {"attention": {"units_pruned": 0}, "mlp": {"units_pruned": 0}}
    assert parameter_count(unpruned) == independent_count(name, unpruned, [nothing, nothing])


def test_olmo2_refuses_head_pruning_before_any_work_and_prunes_the_mlp():
    model = build("olmo2")
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"cannot prune attention of Olmo2ForCausalLM.*normalise all heads together"):
        prune_model(model, ids(), PruneConfig(ratio=0.34), progress=False, registry=default_registry())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert prune(model, "olmo2", compensator="ridge")[0]["mlp"]["units_pruned"] == 6


@pytest.mark.parametrize("config", ["MixtralConfig", "Qwen2MoeConfig", "Qwen3MoeConfig"])
def test_mixtures_of_experts_are_refused_naming_what_is_missing(config):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, config)(**COMMON))
    with pytest.raises(ValueError, match=r"mixture of experts .*per-expert channel pruning .* not implemented"):
        check_architecture(model)


@pytest.mark.parametrize("name, void", [("gemma2", True), ("gemma3", True), ("olmo2", True), ("llama", False)])
def test_a_post_norm_voids_the_scale_and_the_report_says_so(name, void):
    """RMSNorm(s·y) = RMSNorm(y): under post-norms (Gemma, OLMo-2) scaled-procrustes is procrustes, recorded so."""
    runs = {}
    for compensator in ("procrustes", "scaled-procrustes"):
        model = build(name)
        reports = prune(model, name, compensator=compensator)
        runs[compensator] = logits(model, ids(seed=1))
    assert all(layer[m].get("scale_void", False) == void for layer in reports for m in CASES[name].prune)
    assert torch.allclose(runs["procrustes"], runs["scaled-procrustes"], atol=1e-4) == void


def test_tables_mark_a_run_whose_scale_a_post_norm_voided():
    from dataclasses import asdict

    from rcpu_bench.matrix.store import StoredResult
    from rcpu_bench.pruning.methods import label_of
    from rcpu_bench.records import Record
    from rcpu_bench.tables.layout import SCALE_VOID, method_row

    prune_config = asdict(PruneConfig(compensator="scaled-procrustes"))
    label = label_of(prune_config)
    gemma = build("gemma2")
    layers = prune_model(gemma, ids(), PruneConfig(compensator="scaled-procrustes", ratio=0.34), progress=False,
                         registry=default_registry()).layers
    record = Record({"prune": prune_config}, {}, [], {}, 0, layers=layers)
    assert label and method_row(StoredResult("c", {}, record, 0.0)) == f"{label} [{SCALE_VOID}]"
    record.layers = prune(build("llama"), "llama", compensator="scaled-procrustes")
    assert method_row(StoredResult("c", {}, record, 0.0)) == label


def test_olmo2_head_pruning_is_refused_from_the_config_alone(tmp_path):
    """What ``Experiment.validate`` checks before any model is loaded (the config; the weights are only checked
    to be there)."""
    from rcpu_bench.model.loading import load_config

    build("olmo2").save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="cannot prune attention of Olmo2ForCausalLM"):
        load_config(str(tmp_path), prune=("attention", "mlp"))
    assert load_config(str(tmp_path), prune=("mlp",))[0].model_type == "olmo2"


def test_stacked_rows_index_each_segment_of_a_fused_matrix():
    from rcpu_bench.model.surgery import stacked
    from rcpu_bench.selection.select import Selection

    q = Selection(torch.tensor([0, 2]), torch.tensor([1, 3]))
    kv = Selection(torch.tensor([1]), torch.tensor([0]))
    rows = stacked(q, kv, kv)  # q has 4 rows, k and v 2 each: 8 rows
    assert rows.kept.tolist() == [0, 2, 5, 7] and rows.pruned.tolist() == [1, 3, 4, 6]


def test_a_pruned_phi3_copies_and_follows_the_models_attention_implementation():
    """Phi-3's pruned attention reads its own head count, everything else from the model's shared config."""
    model = build("phi3")
    prune(model, "phi3", compensator="ridge")
    copied, tokens = copy.deepcopy(model), ids(seed=1)
    torch.testing.assert_close(logits(copied, tokens), logits(model, tokens), atol=0, rtol=0)
    attn = model.model.layers[0].self_attn
    assert attn.config.num_attention_heads == 4 and model.config.num_attention_heads == HEADS
    model.set_attn_implementation("sdpa")
    assert attn.config._attn_implementation == "sdpa"
    torch.testing.assert_close(logits(model, tokens), logits(copied, tokens), atol=1e-5, rtol=0)
