"""The plugin example of the README and of the plugin tutorial works as written: registered, listed, and used by the
pipeline; the README's first screen and its tour use the real commands."""

from __future__ import annotations

import copy
import re
import types
from pathlib import Path

import pytest
import torch
from tiny_models import logits, tiny_config, tiny_model, tokens

from rcpu_bench.commands import build_parser
from rcpu_bench.plugins import plugin_manager
from rcpu_bench.pruning.pipeline import PruneConfig, prune_model
from rcpu_bench.registry import build_registry

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
EXAMPLES = {"README": README, "tutorial": ROOT / "docs" / "plugins" / "tutorial.md"}


def plugin_of(path: Path) -> types.ModuleType:
    """The one ```python block with ``@hookimpl`` of ``path``, run as the module ``my_plugin``."""
    blocks = re.findall(r"```python\n(.*?)```", path.read_text(encoding="utf-8"), flags=re.S)
    (source,) = [b for b in blocks if "@hookimpl" in b]
    module = types.ModuleType("my_plugin")
    exec(compile(source, path.name, "exec"), module.__dict__)
    return module


@pytest.mark.parametrize("name", EXAMPLES)
def test_plugin_example_registers_and_prunes(name):
    registry = build_registry(plugin_manager([("my_plugin", plugin_of(EXAMPLES[name]))]))
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


def test_readme_plugin_command_uses_the_example_methods():
    """The command the README gives after the plugin example names the example's methods and parameter."""
    (line,) = re.findall(r"`(rcpu-bench prune --scorer activation-only [^`]+)`", README.read_text(encoding="utf-8"))
    args = build_parser().parse_args(line.split()[1:])
    assert (args.scorer, args.compensator, args.compensator_params) == ("activation-only", "shrink", [("alpha", 0.3)])


def test_readme_tour_covers_prune_matrix_table_and_plugin():
    text = README.read_text(encoding="utf-8")
    tour = text.split("## A five-minute tour", 1)[1].split("\n## ", 1)[0]
    for step in ("**Prune one model.**", "**Run a matrix.**", "**Read a table.**", "**Add a plugin.**"):
        assert step in tour
    for command in ("rcpu-bench prune ", "rcpu-bench run --matrix", "rcpu-bench tables ", "@hookimpl"):
        assert command in tour
