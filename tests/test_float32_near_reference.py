"""Deterministic estimators in float32 near θ0 against the same parameters in float64.

Close to the reference, Δθ is far smaller than θ: an estimator that subtracts two products
(W1 x − W0 x) instead of forming ΔW first loses the digits they share, and in float32 the
distance and its gradient become mostly rounding noise. The parameters here are float32
numbers (so the float64 run sees exactly the same θ0 and θ), perturbed by a relative 1e-4.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsd

EPS = 1e-4  # relative perturbation of every parameter
TOLERANCE = 1e-4  # relative error allowed in float32 (value, and each gradient's norm)


def _float32_pair(seed=0, d=20, width=48, outputs=5, batch_norm=False, activation=nn.ReLU):
    torch.manual_seed(seed)
    norm = (lambda: nn.BatchNorm1d(width)) if batch_norm else nn.Identity
    model = nn.Sequential(nn.Linear(d, width), norm(), activation(), nn.Linear(width, width),
                          norm(), activation(), nn.Linear(width, outputs)).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in model.named_buffers():  # running statistics that are not (0, 1)
            if name.endswith("running_mean"):
                b.copy_(torch.rand(b.shape, generator=g) - 0.5)
            if name.endswith("running_var"):
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(EPS * p.abs() * torch.randn(p.shape, generator=g))
        for _, b in moved.named_buffers():  # BatchNorm's running statistics move too
            if b.is_floating_point():
                b.add_(EPS * b.abs() * torch.randn(b.shape, generator=g))
    return model, moved


def _data(n=600, d=20, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(
        d, d, generator=g, dtype=torch.float64) + 1.0
    return [(x, torch.randint(0, classes, (n,), generator=g))]


ESTIMATORS = {
    "bgln-d full": lambda: fsd.BGLN(deterministic=True, covariance="full"),
    "bgln-d diag": lambda: fsd.BGLN(deterministic=True, covariance="diag"),
    "bgln-d lowrank": lambda: fsd.BGLN(deterministic=True, covariance="lowrank", rank=4),
    "bgln-d classwise": lambda: fsd.BGLN(deterministic=True, classwise=True,
                                         covariance="full"),
    "bgln-d layerwise": lambda: fsd.BGLN(deterministic=True, reference="layerwise",
                                         covariance="full"),
    "bgln-d exact full": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                          covariance="full"),
    "bgln-d exact diag": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                          covariance="diag"),
    "bgln-d exact lowrank": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                             covariance="lowrank", rank=4),
    "bgln-d exact classwise": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                               classwise=True, covariance="full"),
    "laftr coreset": lambda: fsd.LAFTR(inputs="coreset", coreset_size=100),
    "ntk": lambda: fsd.NTK(coreset_size=50),
    "ewc": lambda: fsd.EWC(metric="euclidean"),
}
# ExactFSD is left out: it is defined by f(x, θ) − f(x, θ0) of the nonlinear network, so the
# subtraction is the quantity itself (no ΔW to form first); in float32 at this ε its
# gradient is ~5e-4 off.


def _value_and_grads(estimator, model):
    value = estimator.distance(model)
    return value, torch.autograd.grad(value, list(model.parameters()))


# a Sigmoid is a smooth gate with φ(0) = 1/2, which BGLN folds into the next layer's bias
VARIANTS = {"mlp": {}, "batch-norm-mlp": {"batch_norm": True},
            "sigmoid-mlp": {"activation": nn.Sigmoid}}


# NTK and EWC do not walk the layers: the variants add nothing to check for them
@pytest.mark.parametrize("name, variant", [
    (name, variant) for variant in VARIANTS for name in ESTIMATORS
    if variant == "mlp" or name not in ("ntk", "ewc")])
def test_float32_matches_float64_near_the_reference(name, variant):
    model32, moved32 = _float32_pair(**VARIANTS[variant])
    model64, moved64 = copy.deepcopy(model32).double(), copy.deepcopy(moved32).double()
    estimator = ESTIMATORS[name]().fit(model64, _data())
    value64, grads64 = _value_and_grads(estimator, moved64)
    value32, grads32 = _value_and_grads(estimator, moved32)
    assert value32.dtype == torch.float32 and value64.item() > 0
    assert abs(float(value32) - float(value64)) <= TOLERANCE * float(value64)
    for g32, g64 in zip(grads32, grads64, strict=True):
        error = float((g32.double() - g64).norm())
        assert error <= TOLERANCE * float(g64.norm())


def test_summary_sets_in_float32_match_float64_near_the_reference():
    # the batched passes of fsd.combine (paper and exact moments), several references
    _, moved32 = _float32_pair()
    estimators = []
    for moments in ("paper", "exact"):
        for seed in (3, 4):
            _, reference = _float32_pair()
            with torch.no_grad():
                g = torch.Generator().manual_seed(seed)
                for p in reference.parameters():
                    p.add_(EPS * p.abs() * torch.randn(p.shape, generator=g))
            estimators.append(fsd.BGLN(deterministic=True, moments=moments, classwise=True,
                                       covariance="full").fit(reference.double(), _data()))
    summary_set = fsd.combine(estimators)
    moved64 = copy.deepcopy(moved32).double()
    value64, grads64 = _value_and_grads(summary_set, moved64)
    value32, grads32 = _value_and_grads(summary_set, moved32)
    assert abs(float(value32) - float(value64)) <= TOLERANCE * float(value64)
    for g32, g64 in zip(grads32, grads64, strict=True):
        assert float((g32.double() - g64).norm()) <= TOLERANCE * float(g64.norm())
