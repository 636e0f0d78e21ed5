"""Chains: tracing models (fsd.trace), the linearized forward pass, Algorithm 2's moments."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import fsd
from conftest import DTYPE, cnn, labelled_batches, mlp, perturbed, stack
from fsd.model.linearize import propagate_linearized
from fsd.model.rules import TracedLayer
from fsd.model.signature import layer_signature
from fsd.moments import algorithm2
from fsd.testing import dense_algorithm2, linearized_outputs

pytestmark = pytest.mark.usefixtures("single_thread")


def _every_layer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.AvgPool2d(2)),
        nn.Flatten(), nn.Dropout(0.5), nn.Identity(), nn.Linear(12, 3),
    ).to(DTYPE)


# ----------------------------------------------------------------------------------------
# trace
# ----------------------------------------------------------------------------------------
def test_trace_flattens_nested_sequentials_with_dotted_paths_and_rules():
    model = _every_layer()
    layers = fsd.trace(model)
    assert [layer.path for layer in layers] == ["0", "1", "2", "3.0", "3.1", "3.2", "4", "5",
                                                "6", "7"]
    assert [type(layer.rule) for layer in layers] == [
        fsd.AffineRule, fsd.GateRule, fsd.MaxPoolRule, fsd.AffineRule, fsd.GateRule,
        fsd.FixedRule, fsd.FixedRule, fsd.FixedRule, fsd.FixedRule, fsd.AffineRule]
    modules = dict(model.named_modules())
    assert all(layer.module is modules[layer.path] for layer in layers)


def test_trace_of_a_single_layer_has_the_empty_path():
    layer = nn.Linear(3, 2)
    (traced,) = fsd.trace(layer)
    assert traced.path == "" and traced.module is layer and isinstance(traced.rule, fsd.AffineRule)


def test_trace_error_names_the_unsupported_module_and_its_path():
    model = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.ReLU(), nn.LayerNorm(4)))
    with pytest.raises(fsd.UnsupportedModuleError, match=r"LayerNorm at '1\.1'"):
        fsd.trace(model)
    with pytest.raises(fsd.UnsupportedModuleError, match="Softmax at '<root>'"):
        fsd.trace(nn.Softmax(dim=-1))
    # containers other than nn.Sequential are not looked into: they are refused by name
    with pytest.raises(fsd.UnsupportedModuleError, match="ModuleList at '0'"):
        fsd.trace(nn.Sequential(nn.ModuleList([nn.Linear(2, 2)])))


def test_trace_refuses_a_module_object_with_parameters_at_two_positions_naming_both():
    linear = nn.Linear(3, 3)
    model = nn.Sequential(linear, nn.ReLU(), nn.Sequential(linear, nn.ReLU()))
    with pytest.raises(fsd.UnsupportedModuleError, match=r"at '2\.0' is the same object as at '0'"):
        fsd.trace(model)
    # a parameter-free module at two positions is one layer per position
    relu = nn.ReLU()
    model = nn.Sequential(nn.Linear(3, 3), relu, nn.Sequential(nn.Linear(3, 3), relu))
    assert [layer.path for layer in fsd.trace(model)] == ["0", "1", "2.0", "2.1"]


def test_trace_refuses_an_empty_model():
    with pytest.raises(fsd.UnsupportedModuleError, match="no layers"):
        fsd.trace(nn.Sequential())


def test_layer_signature_records_types_hyper_parameters_and_shapes():
    signature = layer_signature(fsd.trace(cnn(seed=0)))
    assert [entry["type"] for entry in signature] == [
        "Conv2d", "ReLU", "MaxPool2d", "Conv2d", "ReLU", "AvgPool2d", "Flatten", "Linear"]
    assert signature[0] == {"path": "0", "type": "Conv2d",
                            "hyper": {"stride": [1, 1], "padding": [1, 1], "dilation": [1, 1],
                                      "groups": 1},
                            "params": {"weight": [3, 1, 3, 3], "bias": [3]}}
    assert signature[7]["params"] == {"weight": [3, 16], "bias": [3]}


# ----------------------------------------------------------------------------------------
# the linearized forward pass
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("make, shape", [(lambda: cnn(seed=1), (1, 8, 8)),
                                         (lambda: mlp([5, 7, 6, 3], seed=1), (5,)),
                                         (_every_layer, (1, 8, 8))],
                         ids=["cnn", "mlp", "every-layer"])
def test_propagate_linearized_matches_the_brute_force_linearization(make, shape):
    model = make().eval()
    other = perturbed(model, 0.3, seed=2).eval()
    xs = stack(labelled_batches(6, shape, seed=3))[0]
    layers = fsd.trace(model)
    params0 = {k: v.detach() for k, v in model.named_parameters()}
    params1 = dict(other.named_parameters())
    with torch.no_grad():
        z0, dz = propagate_linearized(layers, params0, params1, xs)
        z0_only, none = propagate_linearized(layers, params0, None, xs)
        pairs = [linearized_outputs(model, other, x) for x in xs]
        torch.testing.assert_close(z0, model(xs), rtol=1e-12, atol=1e-12)
    assert none is None and torch.equal(z0_only, z0)
    torch.testing.assert_close(z0, torch.stack([p[0] for p in pairs]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(z0 + dz, torch.stack([p[1] for p in pairs]), rtol=1e-10,
                               atol=1e-12)


def test_propagate_linearized_applies_the_callers_gates():
    # gates fixed to 1 turn every ReLU into the identity: the network without its ReLUs
    model = mlp([4, 6, 5, 2], seed=4)
    other = perturbed(model, 0.3, seed=5)
    xs = stack(labelled_batches(7, (4,), seed=6))[0]
    seen = []

    def open_gates(layer: TracedLayer, s0: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        seen.append(layer.path)
        return s0, torch.ones_like(s0)

    params0 = {k: v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        z0, dz = propagate_linearized(fsd.trace(model), params0,
                                                  dict(other.named_parameters()), xs,
                                                  open_gates)

        def linear(net):
            return net[4](net[2](net[0](xs)))

        torch.testing.assert_close(z0, linear(model), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dz, linear(other) - linear(model), rtol=1e-10, atol=1e-12)
    assert seen == ["1", "3"]


def test_propagate_linearized_without_parameterized_differences_gives_zero():
    # a parameter-free model: the other network is the reference, Δz is exactly zero
    model = nn.Sequential(nn.Flatten(), nn.ReLU())
    x = torch.randn(3, 2, 2, dtype=DTYPE)
    z0, dz = propagate_linearized(fsd.trace(model), {}, {}, x)
    assert torch.equal(z0, model(x)) and torch.equal(dz, torch.zeros_like(z0))


# ----------------------------------------------------------------------------------------
# Algorithm 2: reference_moments and delta_moments, batched over components
# ----------------------------------------------------------------------------------------
def test_moments_of_two_components_each_match_dense_algorithm2():
    model = nn.Sequential(nn.Flatten(), nn.Linear(6, 7), nn.ReLU(), nn.Linear(7, 5), nn.ReLU(),
                          nn.Linear(5, 4)).to(DTYPE)
    torch.manual_seed(7)
    for p in model.parameters():
        nn.init.normal_(p, std=0.5)
    other = perturbed(model, 0.2, seed=8)
    g = torch.Generator().manual_seed(9)
    mean = torch.randn(2, 6, generator=g, dtype=DTYPE)
    roots = torch.randn(2, 6, 6, generator=g, dtype=DTYPE)
    cov = roots @ roots.transpose(-1, -2)
    gates = {"2": torch.rand(2, 7, generator=g, dtype=DTYPE),
             "4": torch.rand(2, 5, generator=g, dtype=DTYPE)}
    layers = fsd.trace(model)
    params0 = {k: v.detach() for k, v in model.named_parameters()}
    params1 = dict(other.named_parameters())
    rows = torch.eye(4, dtype=DTYPE)[[3, 1]]
    with torch.no_grad():
        reference = algorithm2.reference_moments(layers, params0, mean, cov, gates)
        mean_d, trace_d = algorithm2.delta_moments(layers, params0, params1, reference, gates,
                                                    rows)
        assert mean_d.shape == (2, 2) and trace_d.shape == (2,)
        for c in range(2):
            expected = dense_algorithm2(model, other, mean[c], cov[c],
                                        [gates["2"][c], gates["4"][c]], outputs=[3, 1])
            got = 0.5 * mean_d[c].pow(2).sum() + 0.5 * trace_d[c]
            torch.testing.assert_close(got, expected, rtol=1e-10, atol=0)
        # the components differ, so a mix-up between them would be seen
        assert abs(float(trace_d[0] - trace_d[1])) > 1e-3 * float(trace_d.abs().max())
    # at θ = θ0 both parts are exactly zero
    mean_0, trace_0 = algorithm2.delta_moments(layers, params0, params0, reference, gates, rows)
    assert float(mean_0.abs().max()) == 0.0 and float(trace_0.abs().max()) == 0.0


def test_check_moment_support_chooses_the_flat_or_the_convolutional_path():
    # convolutions, or a Linear on unflattened images: fsd.moments.algorithm2_conv
    # (Algorithm 2 only)
    image_mlp = nn.Sequential(nn.Linear(4, 3))
    partial = nn.Sequential(nn.Flatten(2), nn.Linear(4, 3))
    for model, shape in ((cnn(seed=0), (1, 8, 8)), (image_mlp, (1, 2, 4)), (partial, (1, 2, 4))):
        assert algorithm2.check_moment_support(fsd.trace(model), shape) is False
        with pytest.raises(NotImplementedError, match=r"moments='exact'.*MLPs only"):
            algorithm2.check_moment_support(fsd.trace(model), shape, exact=True)
        with pytest.raises(NotImplementedError, match="reference='layerwise'"):
            algorithm2.check_moment_support(fsd.trace(model), shape, layerwise=True)
    flat = nn.Sequential(nn.Flatten(), nn.Linear(8, 3), nn.ReLU(), nn.Dropout(), nn.Linear(3, 2))
    assert algorithm2.check_moment_support(fsd.trace(flat), (1, 2, 4), exact=True) is True


def test_delta_moments_needs_a_parameterized_layer():
    layers = fsd.trace(nn.Sequential(nn.ReLU()))
    with pytest.raises(fsd.UnsupportedModuleError, match="no parameterized layer"):
        algorithm2.delta_moments(layers, {}, {}, [], {}, torch.eye(2, dtype=DTYPE))
