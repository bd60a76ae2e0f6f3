"""The hook implementations: what rcpu-bench calls to learn this plugin's methods."""

import torch
from torch import Tensor

from rcpu_bench import ActivationStats, Compensation, Problem, Register, hookimpl


def output_energy(weight: Tensor, stats: ActivationStats) -> Tensor:
    """Output energy s_j = ‖W[:,j]‖₂² · E[x_j²], column j's expected squared contribution to the output."""
    w = weight.detach().to(device=stats.device, dtype=torch.float64)
    return w.square().sum(0) * stats.sq_sum / stats.n


def procrustes_bias(weight: Tensor, stats: ActivationStats, kept: Tensor, pruned: Tensor) -> Compensation:
    """Rotation on centred outputs plus a mean-restoring bias: argmin_{QᵀQ=I, b} ‖Y − Q Z − b1ᵀ‖_F."""
    problem = Problem(weight, stats, kept)
    mu = stats.mean
    centred = stats.require_gram() - stats.n * torch.outer(mu, mu)  # C = Σ (x − μ)(x − μ)ᵀ
    m = (problem.w @ centred[:, problem.kept]) @ problem.wk.T
    u, _, vh = torch.linalg.svd(m)
    q = u @ vh
    new_weight = q @ problem.wk
    bias = problem.w @ mu - new_weight @ mu[problem.kept]
    return problem.result(new_weight, bias)


@hookimpl
def register_scorers(register: Register) -> None:
    register("output-energy", output_energy)  # reads Σx² only: needs="moments", the default


@hookimpl
def register_compensators(register: Register) -> None:
    register("procrustes-bias", procrustes_bias, needs="gram")  # reads G: the pipeline collects it for this module
