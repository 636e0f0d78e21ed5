"""The references in fsd.testing against facts that do not depend on them."""

from __future__ import annotations

import copy

import torch
from torch import nn

from conftest import DTYPE, cnn, labelled_batches, linear_net, mlp, perturbed, stack
from fsd.testing import dense_algorithm2, linearized_outputs


def test_dense_algorithm2_is_exact_where_the_paper_drops_nothing():
    # all gates open (μ = 1) and only the last layer moved: Δa = 0 before it, so neither the
    # dropped Cov(a0, Δa) nor the gates' variance matter, and ½ E‖Δz‖² over the data is
    # ½‖E Δz‖² + ½ tr Cov(Δz) with the data's population moments
    model = nn.Sequential(nn.Linear(4, 5), nn.ReLU(), nn.Linear(5, 3)).to(DTYPE)
    other = copy.deepcopy(model)
    other[2] = perturbed(model[2], 0.3, seed=1)
    xs = stack(labelled_batches(50, (4,), seed=2))[0]
    mean = xs.mean(0)
    cov = (xs - mean).T @ (xs - mean) / xs.shape[0]
    gates = [torch.ones(5, dtype=DTYPE)]
    with torch.no_grad():
        dz = other[2](model[0](xs)) - model[2](model[0](xs))
        got = dense_algorithm2(model, other, mean, cov, gates)
        rows = dense_algorithm2(model, other, mean, cov, gates, outputs=[2, 0])
    truth = 0.5 * dz.pow(2).sum(-1).mean()
    assert float(truth) > 1e-3
    torch.testing.assert_close(got, truth, rtol=1e-12, atol=0)
    torch.testing.assert_close(rows, 0.5 * dz[:, [2, 0]].pow(2).sum(-1).mean(), rtol=1e-12,
                               atol=0)
    # moving the first layer too brings in Cov(a0, Δa), which Algorithm 2 drops
    moved = perturbed(model, 0.3, seed=3)
    with torch.no_grad():
        dz = moved[2](moved[0](xs)) - model[2](model[0](xs))
        dropped = dense_algorithm2(model, moved, mean, cov, gates)
    assert abs(float(dropped) - float(0.5 * dz.pow(2).sum(-1).mean())) > 1e-3 * float(dropped)


def test_dense_algorithm2_gates_scale_the_hidden_moments():
    # closing every gate (μ = 0) leaves only the last layer's change on a zero input
    model, other = mlp([3, 4, 2], seed=3), perturbed(mlp([3, 4, 2], seed=3), 0.3, seed=4)
    mean, cov = torch.ones(3, dtype=DTYPE), torch.eye(3, dtype=DTYPE)
    db = other[2].bias - model[2].bias
    with torch.no_grad():
        got = dense_algorithm2(model, other, mean, cov, [torch.zeros(4, dtype=DTYPE)])
    torch.testing.assert_close(got, 0.5 * db.detach().pow(2).sum(), rtol=1e-12, atol=0)


def test_linearized_outputs_are_the_networks_where_nothing_is_linearized():
    # without ReLU or max-pool the linearized network is the network itself
    torch.manual_seed(5)
    conv = nn.Sequential(nn.Conv2d(1, 2, 3, stride=2, padding=1), nn.AvgPool2d(2),
                         nn.Flatten(), nn.Dropout(0.5), nn.Linear(8, 3)).to(DTYPE).eval()
    for model in (linear_net([4, 6, 3], seed=6), conv):
        other = perturbed(model, 0.3, seed=7).eval()
        shape = (4,) if model is not conv else (1, 8, 8)
        xs = stack(labelled_batches(5, shape, seed=8))[0]
        with torch.no_grad():
            for x in xs:
                z0, z1 = linearized_outputs(model, other, x)
                torch.testing.assert_close(z0, model(x[None])[0], rtol=1e-12, atol=1e-12)
                torch.testing.assert_close(z1, other(x[None])[0], rtol=1e-12, atol=1e-12)


def test_linearized_outputs_keep_the_reference_gates():
    model = cnn(seed=9)
    xs = stack(labelled_batches(4, (1, 8, 8), seed=10))[0]
    same = copy.deepcopy(model)
    other = perturbed(model, 0.5, seed=11)
    flips = 0
    with torch.no_grad():
        for x in xs:
            z0, z1 = linearized_outputs(model, same, x)
            torch.testing.assert_close(z0, model(x[None])[0], rtol=1e-12, atol=1e-12)
            assert torch.equal(z0, z1)
            _, z1 = linearized_outputs(model, other, x)
            flips += int(not torch.allclose(z1, other(x[None])[0], rtol=1e-9, atol=1e-9))
    # a large perturbation flips some gates: the linearization is not the network θ
    assert flips > 0
