"""The model adapter: views against hand counts and explicit surgery, the plugin-facing API, and where names live."""

import ast
import copy
import inspect
from pathlib import Path

import pytest
import torch
from tiny_models import logits, tiny_config, tiny_model, tokens
from torch import nn

import rcpu_bench.model as api
from rcpu_bench.model import LayerGeometry, UnitMap, layer_view, model_view
from rcpu_bench.model.adapter import FAMILIES, check_architecture
from rcpu_bench.model.llama import prune_attention, prune_mlp
from rcpu_bench.model.loading import parameter_count
from rcpu_bench.selection.select import Selection

ROOT = Path(__file__).resolve().parent.parent
GQA = dict(n_heads=6, n_kv_heads=3, head_dim=6, hidden=24, intermediate=20)


def columns(kept: list[int], total: int) -> Selection:
    pruned = [c for c in range(total) if c not in kept]
    return Selection(torch.tensor(kept), torch.tensor(pruned, dtype=torch.long))


def head_columns(heads: list[int], head_dim: int) -> list[int]:
    return [h * head_dim + i for h in heads for i in range(head_dim)]


# --- geometry, units and their cost -------------------------------------------------------------

def test_layer_view_geometry_and_units_from_the_config():
    view = layer_view(tiny_model(tiny_config(**GQA)).model.layers[0])
    assert view.geometry == LayerGeometry(6, 3, 6, 20) and view.geometry.queries_per_group == 2
    assert view.units("attention", "group") == UnitMap(12)          # a kv group: 2 query heads × 6 columns
    assert view.units("attention", "query") == UnitMap(6, group_size=2)
    assert view.units("mlp", "query") == UnitMap(1)
    with pytest.raises(ValueError, match="gqa_rule='heads'; allowed: group, query"):
        view.units("attention", "heads")
    with pytest.raises(ValueError, match="unknown module 'ffn'; allowed: attention, mlp"):
        view.projection("ffn")


@pytest.mark.parametrize("module, kept", [("attention", [0, 2]), ("mlp", list(range(19)))])
def test_unit_cost_is_the_parameter_count_one_unit_removes(module, kept):
    """(2·queries per group + 2)·head_dim·d for a kv group, 3·d for a channel: checked by counting parameters."""
    model = tiny_model(tiny_config(**GQA))
    view = layer_view(model.model.layers[0])
    d, hd, per_group = 24, 6, 2
    expected = {"attention": (2 * per_group + 2) * hd * d, "mlp": 3 * d}[module]
    assert view.unit_cost(module) == expected
    before, total = parameter_count(model), view.projection(module).in_features
    kept_columns = head_columns(kept, hd * per_group) if module == "attention" else kept
    weight = view.projection(module).weight[:, kept_columns].detach().clone()
    view.apply(module, columns(kept_columns, total), weight)
    assert before - parameter_count(model) == expected


# --- apply against explicit head / channel surgery ----------------------------------------------

@pytest.mark.parametrize("rule, heads, kv_heads", [("group", [2, 3], [1]), ("query", [1, 2, 5], [0, 1, 2])])
def test_apply_on_columns_equals_explicit_head_surgery(rule, heads, kv_heads):
    model = tiny_model(tiny_config(**GQA))
    g = torch.Generator().manual_seed(0)
    o_weight, down_weight = torch.randn(24, len(heads) * 6, generator=g), torch.randn(24, 5, generator=g)
    channels = [0, 4, 7, 11, 19]
    by_view, explicit = copy.deepcopy(model), copy.deepcopy(model)
    view = layer_view(by_view.model.layers[1])
    view.apply("attention", columns(head_columns(heads, 6), 36), o_weight)
    view.apply("mlp", columns(channels, 20), down_weight)
    layer = explicit.model.layers[1]
    prune_attention(layer.self_attn, torch.tensor(heads), torch.tensor(kv_heads), o_weight)
    prune_mlp(layer.mlp, torch.tensor(channels), down_weight)
    assert view.geometry == LayerGeometry(len(heads), len(kv_heads), 6, 5)
    ids = tokens(model.config.vocab_size)
    assert torch.equal(logits(by_view, ids), logits(explicit, ids))


def test_apply_rejects_columns_that_are_not_whole_heads():
    view = layer_view(tiny_model(tiny_config(**GQA)).model.layers[0])
    with pytest.raises(ValueError, match="not whole heads of head_dim=6"):
        view.apply("attention", columns([0, 1, 2, 3, 4, 5, 6], 36), torch.zeros(24, 7))
    with pytest.raises(ValueError, match="not whole heads of head_dim=6"):
        view.apply("attention", columns(list(range(3, 9)), 36), torch.zeros(24, 6))


def test_apply_masked_keeps_shapes_and_the_function_of_the_pruned_model():
    model = tiny_model(tiny_config(**GQA))
    pruned, masked = copy.deepcopy(model), copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    o_weight = torch.randn(24, 24, generator=g)
    kept = columns(head_columns([0, 1, 4, 5], 6), 36)
    layer_view(pruned.model.layers[0]).apply("attention", kept, o_weight)
    layer_view(masked.model.layers[0]).apply("attention", kept, o_weight, physical=False)
    assert masked.model.layers[0].self_attn.o_proj.weight.shape == (24, 36)
    ids = tokens(model.config.vocab_size)
    torch.testing.assert_close(logits(pruned, ids), logits(masked, ids), atol=1e-5, rtol=0)


# --- model view ---------------------------------------------------------------------------------

def test_model_view_parts_are_the_models_modules():
    model = tiny_model(tiny_config(**GQA))
    view = model_view(model)
    assert view.layers is model.model.layers and view.embeddings is model.model.embed_tokens
    assert view.lm_head is model.lm_head and view.final_norm is model.model.norm
    assert view.front == [model.model.embed_tokens, model.model.rotary_emb]
    assert [v.layer for v in view.views()] == list(model.model.layers)
    norm = nn.Identity()
    view.final_norm = norm
    assert model.model.norm is norm


def test_unsupported_layers_and_models_name_what_is_supported():
    with pytest.raises(ValueError, match="unsupported decoder layer Linear.*supported: Llama \\(llama"):
        layer_view(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unsupported architecture Linear: model_type None is not a supported"):
        check_architecture(nn.Linear(2, 2))
    assert FAMILIES and all(family.problem(tiny_model(tiny_config())) is None for family in FAMILIES[:1])


# --- the plugin-facing API ----------------------------------------------------------------------

STABLE = {
    "capture_layer_inputs": "(model, input_ids, batch_size, device)",
    "run_layer": "(layer, inputs)",
    "save_pruned": "(model, directory, *, tokenizer, method, provenance, record, overwrite)",
    "load_pruned": "(directory, *, dtype, device, trust_remote_code)",  # keywords appended: old calls still work
    "load_saved": "(directory, *, dtype, device, registry, trust_remote_code)",
    "write_atomically": "(directory, write, *, overwrite)",
    "materialize": "(skeleton, directory, weights, expected_count, *, dtype, device, sha256, **provenance)",
    "file_sha256": "(path)",
    "recorded_sha256": "(manifest, where)",
    "load_model": "(name_or_path, *, dtype, device, revision, trust_remote_code)",
    "parameter_count": "(model)",
    "model_view": "(model)",
    "layer_view": "(layer)",
}


def _shape(function) -> str:
    """A signature without annotations and defaults: the names, kinds and order callers rely on."""
    parameters = inspect.signature(function).parameters.values()
    return str(inspect.Signature([p.replace(annotation=p.empty, default=p.empty) for p in parameters]))


@pytest.mark.parametrize("name", sorted(STABLE))
def test_plugin_facing_functions_keep_their_signatures(name):
    assert name in api.__all__
    assert _shape(getattr(api, name)) == STABLE[name]


def test_plugin_facing_types_and_constants():
    assert [f for f in api.LayerInput.__dataclass_fields__] == ["hidden", "kwargs"]
    assert api.MANIFEST == "rcpu_manifest.json" and api.MODULES == ("attention", "mlp")
    for method in ("projection", "producers", "block", "norm", "units", "unit_cost", "apply", "bias_key"):
        assert callable(getattr(api.LayerView, method))
    assert _shape(api.LayerView.apply) == "(self, module, columns, weight, bias, *, physical)"
    for part in ("layers", "embeddings", "front", "final_norm", "lm_head"):
        assert isinstance(getattr(api.ModelView, part), property)


def test_capture_and_run_layer_reproduce_the_first_layers_output():
    model = tiny_model(tiny_config(**GQA))
    ids = tokens(model.config.vocab_size, batch=4)
    inputs = api.capture_layer_inputs(model, ids, 3, torch.device("cpu"))
    assert [x.hidden.shape[0] for x in inputs] == [3, 1]
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(torch.cat([x.hidden for x in inputs]), hidden[0], atol=0, rtol=0)
    torch.testing.assert_close(torch.cat(api.run_layer(model.model.layers[0], inputs)), hidden[1])


# --- module names live in the family ------------------------------------------------------------

FAMILY_NAMES = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "self_attn",
                "embed_tokens", "input_layernorm", "post_attention_layernorm", "rotary_emb", "num_key_value_groups"}
ALLOWED = {
    "rcpu_bench/model/llama.py": "the Llama-like base (Llama's own family)",
    "rcpu_bench/model/families": "each family's differences from Llama, as data",
    "rcpu_bench/model/hf_format": "the self-contained modeling files written beside saved models",
    "rcpu_bench/matrix/spec.py": "the matrix vocabulary of the ablation (compensate: o_proj / down_proj)",
    "plugins/rcpu-slicegpt/rcpu_slicegpt/layers.py": "the sliced layer keeps Llama's child names (its weights' keys)",
    "rcpu_bench/export/gguf.py": "the map from a Llama checkpoint's tensor names to llama.cpp's GGUF names",
    "rcpu_bench/model/migrate.py": "format 2 saved Llama only, its bias flags named by Llama's o_proj and down_proj",
}


def _code_names(path: Path) -> set[str]:
    """Family module names used as attributes or as string constants (names, dotted paths) in ``path``."""
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in FAMILY_NAMES:
            found.add(node.attr)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and " " not in node.value:
            found |= FAMILY_NAMES & set(node.value.split("."))  # a name or a dotted path, not prose
    return found


def test_module_names_are_known_only_to_the_family():
    sources = [*ROOT.joinpath("rcpu_bench").rglob("*.py"),
               *ROOT.joinpath("plugins/rcpu-slicegpt/rcpu_slicegpt").rglob("*.py")]
    offenders = {}
    for path in sources:
        relative = path.relative_to(ROOT).as_posix()
        if not any(relative.startswith(allowed) for allowed in ALLOWED):
            names = _code_names(path)
            if names:
                offenders[relative] = sorted(names)
    assert offenders == {}


# --- the top package is the rest of the plugin face ---------------------------------------------------

def test_every_name_of_the_top_package_loads():
    import rcpu_bench

    assert all(getattr(rcpu_bench, name) is not None for name in rcpu_bench.__all__)


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    modules = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    return modules | {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}


def test_plugins_import_only_the_top_package_and_the_model_side():
    sources = [path for path in ROOT.joinpath("plugins").glob("*/rcpu_*/*.py")]
    deeper = {path.relative_to(ROOT).as_posix(): sorted(m for m in _imported_modules(path)
                                                          if m.startswith("rcpu_bench.") and m != "rcpu_bench.model")
              for path in sources}
    assert sources and {path: modules for path, modules in deeper.items() if modules} == {}


def test_a_modules_units_under_each_gqa_rule():
    view = layer_view(tiny_model(tiny_config(n_heads=6, n_kv_heads=3, intermediate=20)).model.layers[0])
    assert view.n_units("attention") == view.n_units("attention", "group") == 3  # key/value groups
    assert view.n_units("attention", "query") == 6  # query heads, chosen within their groups
    assert view.n_units("mlp") == view.n_units("mlp", "query") == 20  # channels, whatever the rule
    prune_attention(view.layer.self_attn, torch.tensor([0, 1, 4, 5]), torch.tensor([0, 2]), torch.randn(24, 24))
    assert (view.n_units("attention"), view.n_units("attention", "query")) == (2, 4)  # read from current shapes
