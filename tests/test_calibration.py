"""fsd.calibrate: estimate / ExactFSD ratios on held-out data, and λ scaled by them."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import fsd

DTYPE = torch.float64


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 3)).to(DTYPE)
    train, held_out = torch.randn(200, 4, dtype=DTYPE), torch.randn(100, 4, dtype=DTYPE)
    return model, train, held_out


def test_exact_fsd_calibrates_to_one_and_ratios_are_estimate_over_truth():
    model, train, held_out = _setup()
    cal = fsd.calibrate(fsd.ExactFSD().fit(model, held_out), model, held_out, scale=0.1)
    assert cal.median_ratio == pytest.approx(1.0, rel=1e-12) and cal.spread < 1e-12
    ewc = fsd.EWC(metric="euclidean").fit(model, train)
    moved = fsd.uses.calibration.perturbed_copies(model, 3, 0.1, seed=4)
    cal = fsd.calibrate(ewc, model, held_out, moved=moved)
    truth = fsd.ExactFSD().fit(model, held_out)
    for network, ratio in zip(moved, cal.ratios, strict=True):
        expected = float(ewc.distance(network)) / float(truth.distance(network))
        assert ratio == pytest.approx(expected, rel=1e-12)
    assert cal.scale_lambda(2.0) == pytest.approx(2.0 / cal.median_ratio)
    assert "estimate/exact median" in str(cal)


def test_a_linear_network_calibrates_laftr_to_one_on_the_fit_data():
    # LAFTR over all the data is exact for a network without nonlinearity
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(4, 3)).to(DTYPE)
    x = torch.randn(50, 4, dtype=DTYPE)
    cal = fsd.calibrate(fsd.LAFTR(inputs="coreset", coreset_size=None).fit(model, x), model, x)
    assert cal.median_ratio == pytest.approx(1.0, rel=1e-10)


def test_perturbations_are_relative_to_each_tensor():
    model, _, _ = _setup()
    (moved,) = fsd.uses.calibration.perturbed_copies(model, 1, 0.25, seed=3)
    for p, q in zip(model.parameters(), moved.parameters(), strict=True):
        assert float((q - p).norm()) == pytest.approx(0.25 * float(p.norm()), rel=1e-10)


def test_outputs_of_the_summary_carry_over_to_the_truth():
    model, train, held_out = _setup()
    head = fsd.EWC(metric="euclidean").fit(model, train, outputs=[1])
    cal = fsd.calibrate(head, model, held_out, num_perturbations=3)
    restricted = fsd.ExactFSD().fit(model, held_out, outputs=[1])
    moved = fsd.uses.calibration.perturbed_copies(copy.deepcopy(model), 3, 0.05, seed=0)
    assert cal.exact == pytest.approx(tuple(float(restricted.distance(m)) for m in moved))


def test_too_few_perturbations_are_refused():
    model, train, held_out = _setup()
    with pytest.raises(ValueError, match="num_perturbations must be at least 2"):
        fsd.calibrate(fsd.EWC().fit(model, train), model, held_out, num_perturbations=1)
