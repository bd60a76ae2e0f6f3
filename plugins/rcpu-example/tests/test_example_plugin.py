"""The example plugin: its methods against materialised float64 computations, its registration, a matrix run."""

from __future__ import annotations

import torch

from rcpu_bench import hookimpl
from rcpu_bench.compensation.compensators import flap_bias, procrustes
from rcpu_bench.matrix.runner import run_matrix
from rcpu_bench.matrix.spec import parse_matrix
from rcpu_bench.matrix.store import read_results
from rcpu_bench.plugins import default_registry, plugin_manager
from rcpu_bench.registry import build_registry
from rcpu_bench.statistics.activations import ActivationStats
from rcpu_example import plugin
from rcpu_example.plugin import output_energy, procrustes_bias


def problem(d_out: int = 7, d_in: int = 10, n: int = 400, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64) * torch.rand(d_in, generator=g, dtype=torch.float64)
    x = x + torch.randn(d_in, generator=g, dtype=torch.float64)  # a non-zero mean
    w = torch.randn(d_out, d_in, generator=g, dtype=torch.float64)
    kept, pruned = torch.tensor([0, 2, 3, 5, 6, 8, 9]), torch.tensor([1, 4, 7])
    return w, x, kept, pruned


def error(w, x, kept, comp) -> float:
    y = w @ x.T
    out = comp.weight @ x[:, kept].T + (comp.bias[:, None] if comp.bias is not None else 0)
    return float(((y - out) ** 2).sum())


def test_procrustes_bias_equals_the_centred_solution():
    for d_out in (4, 7, 12):
        w, x, kept, pruned = problem(d_out=d_out)
        y, z = w @ x.T, w[:, kept] @ x[:, kept].T
        yc, zc = y - y.mean(1, keepdim=True), z - z.mean(1, keepdim=True)
        u, _, vh = torch.linalg.svd(yc @ zc.T)
        q = u @ vh
        want_b = (y - q @ z).mean(1)
        got = procrustes_bias(w, ActivationStats.from_activations(x), kept, pruned)
        torch.testing.assert_close(got.weight, q @ w[:, kept])
        torch.testing.assert_close(got.bias, want_b)


def test_procrustes_bias_beats_rotation_alone_and_bias_alone():
    w, x, kept, pruned = problem()
    stats = ActivationStats.from_activations(x)
    ours = error(w, x, kept, procrustes_bias(w, stats, kept, pruned))
    assert ours <= error(w, x, kept, procrustes(w, stats, kept, pruned)) + 1e-9
    assert ours <= error(w, x, kept, flap_bias(w, stats, kept, pruned)) + 1e-9


def test_output_energy_is_the_expected_squared_contribution():
    w, x, _, _ = problem()
    want = torch.stack([((w[:, j:j + 1] * x[:, j]) ** 2).sum() / len(x) for j in range(w.shape[1])])
    torch.testing.assert_close(output_energy(w, ActivationStats.from_activations(x)), want)


def test_registered_on_a_fresh_registry_and_its_trial_runs_pass():
    registry = build_registry(plugin_manager([("example", plugin)], entry_points=False))
    assert registry.broken == {}
    assert registry.scorer("output-energy").provider == registry.compensator("procrustes-bias").provider == "example"
    assert registry.scorer("output-energy").needs == "moments"
    assert registry.compensator("procrustes-bias").needs == "gram"


def test_procrustes_bias_declared_without_g_would_be_refused_by_its_trial_run():
    class Undeclared:
        @hookimpl
        def register_compensators(self, register):
            register("procrustes-bias", procrustes_bias)  # needs="moments" by default, yet it reads G

    registry = build_registry(plugin_manager([("undeclared", Undeclared())], entry_points=False))
    assert "'procrustes-bias' from undeclared declares needs='moments' but reads the Gram matrix" in (
        registry.broken["undeclared"])


def test_installed_plugin_is_registered_through_its_entry_point():
    registry = default_registry()
    assert "rcpu-example" in registry.scorer("output-energy").provider
    assert registry.compensator("procrustes-bias").needs == "gram"


def test_a_matrix_uses_the_plugin_by_name(tmp_path):
    matrix = parse_matrix({
        "name": "example", "models": [{"model": "${shared}/models/stories260K-mha", "label": "mha"}],
        "methods": [{"name": "example", "scorer": "output-energy", "compensator": "procrustes-bias"}],
        "ratios": [0.2], "calib": {"source": "tinystories", "n_calib": [8], "seqlen": 64},
        "ppl_profiles": ["tinystories[900:920]"]})
    summary = run_matrix(matrix, tmp_path, progress=False)
    assert summary.ok == 1 and summary.failed == 0
    (result,) = read_results(tmp_path).results
    assert result.prune["compensator"] == "procrustes-bias"
    assert result.record.perplexity[0].ppl > 1
