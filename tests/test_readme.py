"""The README's plugin example works as written: registered, listed, and used by the pipeline."""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import torch
from tiny_models import logits, tiny_config, tiny_model, tokens

from rcpu_bench.plugins import plugin_manager
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.registry import build_registry

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_plugin() -> types.ModuleType:
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    (source,) = [b for b in blocks if "@hookimpl" in b]
    module = types.ModuleType("my_plugin")
    exec(compile(source, "README.md", "exec"), module.__dict__)
    return module


def test_readme_plugin_registers_and_prunes():
    registry = build_registry(plugin_manager([("my_plugin", readme_plugin())]))
    shrink = registry.compensator("shrink")
    assert shrink.provider == "my_plugin" and shrink.params == {"alpha": 0.5} and shrink.needs == "moments"
    assert registry.scorer("activation-only").description == "Score by the input's L2 norm alone."
    dense = tiny_model(tiny_config())
    ids = tokens(dense.config.vocab_size, batch=4, length=16, seed=1)
    half, plain = copy.deepcopy(dense), copy.deepcopy(dense)
    config = dict(scorer="activation-only", ratio=0.0, prune=("mlp",))
    prune_model(half, ids, PruneConfig(compensator="shrink", compensator_params={"alpha": 0.5}, **config),
                registry=registry, progress=False)
    prune_model(plain, ids, PruneConfig(compensator="none", **config), registry=registry, progress=False)
    for a, b in zip(half.model.layers, plain.model.layers):
        torch.testing.assert_close(a.mlp.down_proj.weight, 0.5 * b.mlp.down_proj.weight)
    assert not torch.allclose(logits(half, ids), logits(plain, ids))
