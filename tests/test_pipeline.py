"""The layer-wise pipeline against an independent float64 re-computation from materialised activations."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from registries import builtin_registry
from tiny_models import logits, needs_stories, tiny_config, tiny_model, tokens

from rcpu_bench.model.adapter import layer_geometries
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model

# The built-in methods (installed plugins have tests of their own).
SCORERS = [m.name for m in builtin_registry().methods("scorer")]
COMPENSATORS = [m.name for m in builtin_registry().methods("compensator")]
KINDS = ("mha", "gqa")


def method_grid() -> list:
    """Every (kind, scorer, compensator): a plain pytest runs a covering subset (each scorer, compensator and kind at
    least once), the rest is marked slow."""
    n = max(len(SCORERS), len(COMPENSATORS))
    covering = {(KINDS[i % 2], SCORERS[i % len(SCORERS)], COMPENSATORS[i % len(COMPENSATORS)]) for i in range(n)}
    return [pytest.param(*combo, marks=() if combo in covering else pytest.mark.slow)
            for combo in itertools.product(KINDS, SCORERS, COMPENSATORS)]


def calib(vocab: int, n: int = 8, length: int = 32) -> torch.Tensor:
    return tokens(vocab, batch=n, length=length, seed=1)


@pytest.fixture
def stories(stories_260k):
    return {kind: loaded.model for kind, loaded in stories_260k.items()}


def module_inputs(model, ids: torch.Tensor, layer: int) -> dict[str, torch.Tensor]:
    """X (N × d_in) of o_proj and down_proj of one layer, materialised from a plain forward pass."""
    captured = {"o_proj": [], "down_proj": []}
    block = model.model.layers[layer]
    handles = [getattr(parent, name).register_forward_pre_hook(lambda _m, a, n=name: captured[n].append(a[0]))
               for parent, name in ((block.self_attn, "o_proj"), (block.mlp, "down_proj"))]
    with torch.no_grad():
        model(ids, use_cache=False)
    for h in handles:
        h.remove()
    return {k: torch.cat(v).reshape(-1, v[0].shape[-1]).double() for k, v in captured.items()}


def reference_procrustes(weight: torch.Tensor, x: torch.Tensor, unit: int, ratio: float):
    """γ_j = ‖W_j‖₂‖X_j‖₂Var(X_j), unit sums, prune ⌊ρ·n⌋ lowest, Q = UVᵀ of Y Zᵀ; returns (Q W_K, pruned units)."""
    w = weight.double()
    gamma = w.norm(dim=0) * x.norm(dim=0) * x.var(dim=0, unbiased=False)
    units = gamma.reshape(-1, unit).sum(1)
    n_prune = int(ratio * len(units) + 1e-9)
    pruned = torch.argsort(units)[:n_prune].sort().values
    keep_units = torch.tensor([u for u in range(len(units)) if u not in pruned.tolist()])
    cols = (keep_units[:, None] * unit + torch.arange(unit)).reshape(-1)
    y, z = w @ x.T, w[:, cols] @ x[:, cols].T
    u, _, vh = torch.linalg.svd(y @ z.T)
    return (u @ vh) @ w[:, cols], pruned


def assert_within_mixed_tolerance(got: torch.Tensor, want: torch.Tensor) -> None:
    """max|W̃ − W̃₆₄| ≤ 1e-4·max|W̃₆₄|: the mixed statistics' stated tolerance (tests/test_statistics_paths.py)."""
    assert float((got.detach().double() - want).abs().max()) <= 1e-4 * float(want.abs().max())


@needs_stories
@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_first_layer_matches_a_materialised_reference(stories, kind):
    """Layer 0: both modules scored and compensated from the same dense pass (the official order)."""
    dense = stories[kind]
    ids = calib(dense.config.vocab_size)
    x = module_inputs(dense, ids, 0)
    geo = layer_geometries(dense)[0]
    group = geo.head_dim * geo.n_heads // geo.n_kv_heads
    want_o, pruned_o = reference_procrustes(dense.model.layers[0].self_attn.o_proj.weight, x["o_proj"], group, 0.25)
    want_d, pruned_d = reference_procrustes(dense.model.layers[0].mlp.down_proj.weight, x["down_proj"], 1, 0.25)
    model = copy.deepcopy(dense)
    report = prune_model(model, ids, PruneConfig(ratio=0.25), progress=False, registry=default_registry())
    assert report.layers[0]["attention"]["pruned_units"] == pruned_o.tolist()
    assert report.layers[0]["mlp"]["pruned_units"] == pruned_d.tolist()
    for got, want in ((model.model.layers[0].self_attn.o_proj.weight, want_o),
                      (model.model.layers[0].mlp.down_proj.weight, want_d)):
        assert_within_mixed_tolerance(got, want)


@needs_stories
@pytest.mark.parametrize("statistics", ["sequential", "one-shot"])
def test_second_layer_sees_pruned_or_dense_inputs(stories, statistics):
    """Sequential: layer 1 is fitted on the outputs of the pruned layer 0; one-shot: on the dense ones."""
    dense = stories["mha"]
    ids = calib(dense.config.vocab_size)
    model = copy.deepcopy(dense)
    prune_model(model, ids, PruneConfig(ratio=0.25, statistics=statistics), progress=False, registry=default_registry())
    upstream = copy.deepcopy(dense)
    if statistics == "sequential":
        upstream.model.layers[0] = model.model.layers[0]
    x = module_inputs(upstream, ids, 1)
    want, _ = reference_procrustes(dense.model.layers[1].self_attn.o_proj.weight, x["o_proj"], 8, 0.25)
    assert_within_mixed_tolerance(model.model.layers[1].self_attn.o_proj.weight, want)


@pytest.mark.parametrize("compensator", COMPENSATORS)
def test_ratio_zero_leaves_logits_unchanged(compensator):
    dense = tiny_model(tiny_config())
    ids = calib(dense.config.vocab_size)
    model = copy.deepcopy(dense)
    prune_model(model, ids, PruneConfig(ratio=0.0, compensator=compensator, compensator_params=
                                        {"lam": 1e-9} if compensator == "ridge" else {}), progress=False,
                                        registry=default_registry())
    probe = tokens(dense.config.vocab_size, seed=5)
    torch.testing.assert_close(logits(model, probe), logits(dense, probe), atol=2e-5, rtol=1e-5)
    assert parameter_count(model) >= parameter_count(dense)  # flap-bias adds biases


def expected_parameters(config, report) -> int:
    """Dense count minus, per layer, pruned kv groups' q/k/v/o and pruned channels' gate/up/down."""
    d, hd = config.hidden_size, config.head_dim
    per_group = config.num_attention_heads // config.num_key_value_heads
    removed = sum(layer["attention"]["units_pruned"] * (2 * per_group + 2) * hd * d
                  + layer["mlp"]["units_pruned"] * 3 * d for layer in report.layers)
    return removed


@needs_stories
@pytest.mark.parametrize("kind, scorer, compensator", method_grid())
def test_every_scorer_and_compensator_prunes_a_working_model(stories, kind, scorer, compensator):
    dense = stories[kind]
    ids = calib(dense.config.vocab_size, n=4)
    model = copy.deepcopy(dense)
    report = prune_model(model, ids, PruneConfig(scorer=scorer, compensator=compensator, ratio=0.3), progress=False,
                         registry=default_registry())
    bias = 5 * 2 * dense.config.hidden_size if compensator in ("flap-bias", "slimllm") else 0  # the added biases
    assert parameter_count(dense) - parameter_count(model) + bias == expected_parameters(dense.config, report)
    assert all(layer["attention"]["units_pruned"] == int(0.3 * (4 if kind == "gqa" else 8)) for layer in report.layers)
    assert all(layer["mlp"]["units_pruned"] == int(0.3 * 172) for layer in report.layers)
    for layer in report.layers:
        for module in ("attention", "mlp"):
            info = {**layer[module], **layer[module]["info"]}
            with_gram = "gram" in info["statistics"]
            assert ("objective_after" in info) == with_gram  # only the Gram path can evaluate the objective
            if with_gram:
                assert info["objective_after"] <= info["objective_before"] * (1 + 1e-9)
    out = logits(model, tokens(dense.config.vocab_size, seed=7))
    assert torch.isfinite(out).all()
    assert model.generate(ids[:1, :4], max_new_tokens=5, do_sample=False).shape == (1, 9)


@needs_stories
def test_query_rule_keeps_every_kv_head(stories):
    model = copy.deepcopy(stories["gqa"])
    prune_model(model, calib(512, n=4), PruneConfig(ratio=0.5, gqa_rule="query"), progress=False,
                registry=default_registry())
    assert {(g.n_heads, g.n_kv_heads) for g in layer_geometries(model)} == {(4, 4)}
    assert torch.isfinite(logits(model, tokens(512, seed=3))).all()


@needs_stories
def test_query_rule_on_mha_prunes_each_head_with_its_kv_head(stories):
    """Multi-head attention has groups of one: the "query" rule selects heads as the "group" rule does, and a pruned
    query head takes its kv head along (before the adapter this raised "cannot be shared equally")."""
    models = {rule: copy.deepcopy(stories["mha"]) for rule in ("query", "group")}
    for rule, model in models.items():
        prune_model(model, calib(512, n=4), PruneConfig(ratio=0.5, gqa_rule=rule), progress=False,
                    registry=default_registry())
    assert {(g.n_heads, g.n_kv_heads) for g in layer_geometries(models["query"])} == {(4, 4)}
    group = models["group"].state_dict()
    assert all(torch.equal(tensor, group[name]) for name, tensor in models["query"].state_dict().items())


@needs_stories
def test_modules_to_prune_and_compensate(stories):
    """The paper's ablation switches: prune attention only; compensate only the MLP."""
    dense = stories["mha"]
    model = copy.deepcopy(dense)
    report = prune_model(model, calib(512, n=4), PruneConfig(ratio=0.25, prune=("attention",)), progress=False,
                         registry=default_registry())
    assert "mlp" not in report.layers[0]
    assert {g.intermediate for g in layer_geometries(model)} == {172}
    model = copy.deepcopy(dense)
    report = prune_model(model, calib(512, n=4), PruneConfig(ratio=0.25, compensate=("mlp",)), progress=False,
                         registry=default_registry())
    assert report.layers[0]["attention"]["compensator"] == "none"
    assert report.layers[0]["mlp"]["compensator"] == "procrustes"


@needs_stories
def test_recollecting_mlp_statistics_uses_the_pruned_attention(stories):
    dense = stories["mha"]
    ids = calib(512)
    model = copy.deepcopy(dense)
    prune_model(model, ids, PruneConfig(ratio=0.25, recollect_mlp=True, prune=("attention", "mlp")), progress=False,
                registry=default_registry())
    upstream = copy.deepcopy(dense)
    upstream.model.layers[0].self_attn = model.model.layers[0].self_attn
    x = module_inputs(upstream, ids, 0)["down_proj"]
    want, _ = reference_procrustes(dense.model.layers[0].mlp.down_proj.weight, x, 1, 0.25)
    assert_within_mixed_tolerance(model.model.layers[0].mlp.down_proj.weight, want)


def test_offloading_gives_the_same_model():
    dense = tiny_model(tiny_config())
    ids = calib(dense.config.vocab_size)
    plain, offloaded = copy.deepcopy(dense), copy.deepcopy(dense)
    kept_home = prune_model(plain, ids, PruneConfig(ratio=0.4), progress=False, registry=default_registry())
    moved = prune_model(offloaded, ids, PruneConfig(ratio=0.4, offload=True), progress=False,
                        registry=default_registry())
    probe = tokens(dense.config.vocab_size, seed=9)
    torch.testing.assert_close(logits(offloaded, probe), logits(plain, probe))
    # The layer moves are a timed phase of their own, in the totals and in every layer's seconds.
    assert "offload" in moved.seconds and "offload" not in kept_home.seconds
    assert all("offload" in layer["seconds"] for layer in moved.layers)
    assert "allocation" in moved.seconds and "allocation" in kept_home.seconds


def test_batch_size_does_not_change_the_result():
    dense = tiny_model(tiny_config())
    ids = calib(dense.config.vocab_size)
    a, b = copy.deepcopy(dense), copy.deepcopy(dense)
    prune_model(a, ids, PruneConfig(ratio=0.4, batch_size=1), progress=False, registry=default_registry())
    prune_model(b, ids, PruneConfig(ratio=0.4, batch_size=8), progress=False, registry=default_registry())
    probe = tokens(dense.config.vocab_size, seed=9)
    # The batches' float32 rounding differs; the mixed products (W G[:,K], M) carry it through this tiny,
    # ill-conditioned model to 1.6e-5 (1.0e-5 with float64 products).
    torch.testing.assert_close(logits(a, probe), logits(b, probe), atol=3e-5, rtol=1e-5)


@needs_stories
def test_flap_baseline_global_structure_meets_the_parameter_budget(stories):
    """FLAP = WIFV score + AL-AM + bias compensation from one-shot statistics."""
    dense = stories["mha"]
    model = copy.deepcopy(dense)
    config = PruneConfig(scorer="flap-wifv", compensator="flap-bias", structure="al-am", statistics="one-shot",
                         ratio=0.2)
    report = prune_model(model, calib(512), config, progress=False, registry=default_registry())
    d, hd = 64, 8
    linear = lambda m: sum(g.n_heads * hd * d * 4 + g.intermediate * d * 3 for g in layer_geometries(m))  # noqa: E731
    removed = 1 - linear(model) / linear(dense)
    assert abs(removed - 0.2) <= (4 * hd * d) / linear(dense)  # within one head's cost of the target
    counts = [(len(layer["attention"]["pruned_units"]), len(layer["mlp"]["pruned_units"])) for layer in report.layers]
    assert len(set(counts)) > 1  # adaptive: layers differ
    assert all(g.n_heads >= 1 and g.intermediate >= 1 for g in layer_geometries(model))


def test_bad_configuration_errors_before_work():
    model = tiny_model(tiny_config())
    before = copy.deepcopy(model.state_dict())
    bad = [(PruneConfig(ratio=1.0), "ratio"), (PruneConfig(scorer="nope"), "registered scorers"),
           (PruneConfig(compensator_params={"lam": 1}), "no parameter"), (PruneConfig(gqa_rule="x"), "gqa_rule"),
           (PruneConfig(prune=("attn",)), "unknown module")]
    for config, message in bad:
        with pytest.raises((ValueError, KeyError), match=message):
            prune_model(model, calib(61), config, progress=False, registry=default_registry())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_report_has_timings_per_layer():
    model = tiny_model(tiny_config())
    report = prune_model(model, calib(61), PruneConfig(ratio=0.4), progress=False, registry=default_registry())
    assert len(report.layers) == 3
    for layer in report.layers:
        assert set(layer["seconds"]) == {"statistics", "score", "solve", "forward"}
        assert all(v >= 0 for v in layer["seconds"].values())
    assert report.peak_memory_bytes > 0


@pytest.mark.parametrize("structure", ["uniform", "al-am"])
def test_round_to_gives_kept_widths_in_whole_multiples(structure):
    """round_to=8 on 6 heads of size 6 in 3 key/value groups and 20 channels: o_proj keeps a multiple of 8 columns
    made of whole groups (12 columns each: 2 groups, 24 columns) and down_proj 8 or 16 channels."""
    model = tiny_model(tiny_config(intermediate=20, layers=3))
    scorer = {"structure": structure, "scorer": "flap-wifv", "compensator": "flap-bias"} if structure == "al-am" else {}
    report = prune_model(model, tokens(61, batch=4, length=16), PruneConfig(ratio=0.4, round_to=8, **scorer),
                         progress=False, registry=default_registry())
    for geometry, layer in zip(layer_geometries(model), report.layers, strict=True):
        assert geometry.n_heads * geometry.head_dim % 8 == 0 and geometry.n_kv_heads == 2
        assert geometry.intermediate in (8, 16)
        assert layer["mlp"]["units_pruned"] == 20 - geometry.intermediate


def test_round_to_is_refused_with_the_query_rule():
    with pytest.raises(ValueError, match="round_to=8 needs the layer-wise pipeline with gqa_rule='group'"):
        PruneConfig(round_to=8, gqa_rule="query").validate(default_registry())
