"""BatchNorm in evaluation as an affine layer: every estimator against a folded twin.

In evaluation BatchNorm is y = s·x + t per channel with s = γ/√(v + ε), t = β − s·m (m, v
the running statistics). Folded into the layer before it (W' = diag(s) W, b' = s·b + t) it
gives a network without BatchNorm that computes the same function, built here by hand in
float64. Every estimator that depends on the function and not on its parameterization
(all but NTK and EWC) must give the BatchNorm model the distances of its folded twin —
including when only the running statistics moved, which is a real change of function.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

import fsd
from fsd.model import rules

DTYPE = torch.float64


def _mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 8),
                          nn.BatchNorm1d(8, affine=False), nn.ReLU(), nn.Linear(8, 3))
    return _randomise_statistics(model.to(DTYPE).eval(), seed)


def _cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(),
                          nn.MaxPool2d(2), nn.Flatten(), nn.Linear(27, 3))
    return _randomise_statistics(model.to(DTYPE).eval(), seed)


def _randomise_statistics(model: nn.Module, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(100 + seed)
    with torch.no_grad():
        for m in model.modules():  # BatchNorm, and InstanceNorm with running statistics
            if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
                m.running_mean.copy_(torch.rand(m.num_features, generator=g, dtype=DTYPE) - 0.5)
                m.running_var.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=DTYPE))
                if m.affine:
                    m.weight.copy_(0.5 + torch.rand(m.num_features, generator=g, dtype=DTYPE))
                    m.bias.copy_(torch.rand(m.num_features, generator=g, dtype=DTYPE) - 0.5)
    return model


def _folded(model: nn.Sequential) -> nn.Sequential:
    """The same function without BatchNorm: each BatchNorm folded into the layer before it."""
    layers: list[nn.Module] = []
    for m in model:
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            previous = layers[-1]
            assert isinstance(previous, (nn.Linear, nn.Conv2d))
            scale = 1 / torch.sqrt(m.running_var + m.eps)
            shift = -m.running_mean * scale
            if m.affine:
                scale, shift = m.weight * scale, m.weight * shift + m.bias
            with torch.no_grad():
                shape = (-1,) + (1,) * (previous.weight.dim() - 1)
                previous.weight.mul_(scale.reshape(shape))
                previous.bias.copy_(scale * previous.bias + shift)
        else:
            layers.append(copy.deepcopy(m))
    return nn.Sequential(*layers).eval()


def _moved(model: nn.Module, parameters: bool = True, statistics: bool = True) -> nn.Module:
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        if parameters:
            for p in moved.parameters():
                p.add_(0.2 * torch.randn(p.shape, generator=g, dtype=DTYPE))
        if statistics:
            for m in moved.modules():
                if isinstance(m, nn.modules.batchnorm._NormBase) and m.track_running_stats:
                    m.running_mean.add_(0.3 * torch.randn(m.num_features, generator=g,
                                                          dtype=DTYPE))
                    m.running_var.mul_(1 + 0.5 * torch.rand(m.num_features, generator=g,
                                                            dtype=DTYPE))
    return moved


def _inputs(model: nn.Module, n: int = 64) -> torch.Tensor:
    shape = (n, 1, 6, 6) if isinstance(model[0], nn.Conv2d) else (n, 5)
    return torch.randn(shape, generator=torch.Generator().manual_seed(3), dtype=DTYPE)


ESTIMATORS = {
    "laftr": lambda: fsd.LAFTR(inputs="coreset", coreset_size=None),
    "laftr-gaussian": lambda: fsd.LAFTR(inputs="gaussian", covariance="full", num_samples=64,
                                        seed=5),
    "bgln-s": lambda: fsd.BGLN(covariance="full", num_samples=64, seed=5),
    "bgln-d": lambda: fsd.BGLN(deterministic=True, covariance="full"),
    "bgln-d-exact": lambda: fsd.BGLN(deterministic=True, moments="exact", covariance="full"),
    "exact": lambda: fsd.ExactFSD(),
}
# NTK is left out: it linearizes in the parameters, so folding BatchNorm (a change of
# parameterization) changes it; its BatchNorm buffers are checked in tests/test_linearize.py


# exact moments are for MLPs only (on convolutions they would carry (C·H·W)² moments)
@pytest.mark.parametrize("kind, name", [
    (kind, name) for kind in ["mlp", "cnn"] for name in sorted(ESTIMATORS)
    if not (kind == "cnn" and name == "bgln-d-exact")])
@pytest.mark.parametrize("moved_what", ["parameters and statistics", "statistics only"])
def test_a_batch_norm_model_gets_the_distances_of_its_folded_twin(kind, name, moved_what):
    model = _mlp() if kind == "mlp" else _cnn()
    moved = _moved(model, parameters=moved_what != "statistics only")
    x = _inputs(model)
    got = ESTIMATORS[name]().fit(model, x).distance(moved)
    expected = ESTIMATORS[name]().fit(_folded(model), x).distance(_folded(moved))
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-13)
    assert float(expected) > 1e-4  # the statistics alone moved the function


def test_the_batch_norm_rule_is_the_module_in_evaluation():
    for module, shape in [(nn.BatchNorm1d(4), (6, 4)), (nn.BatchNorm1d(4, affine=False), (6, 4)),
                          (nn.BatchNorm1d(4), (6, 4, 3)), (nn.BatchNorm2d(4), (6, 4, 3, 3))]:
        module = _randomise_statistics(nn.Sequential(module.to(DTYPE)), 1)[0].eval()
        x = torch.randn(shape, dtype=DTYPE)
        rule = rules.rule_for(module, "")
        assert isinstance(rule, fsd.AffineRule)
        state = {**dict(module.named_parameters()), **dict(module.named_buffers())}
        scale, shift = rule.affine_parameters(module, state, "")
        torch.testing.assert_close(rule.apply(module, x, scale, shift), module(x),
                                   rtol=1e-13, atol=1e-14)
        # the dense form is the same map on flat vectors
        if len(shape) == 2:
            matrix, bias = rule.affine_matrix(module, state, "")
            assert bias is not None
            torch.testing.assert_close(x @ matrix.T + bias, module(x), rtol=1e-13, atol=1e-14)


def test_the_gradient_reaches_the_batch_norm_parameters():
    model = _mlp()
    moved = _moved(model)
    x = _inputs(model)
    est = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, x)
    est.distance(moved).backward()
    assert moved[1].weight.grad is not None and moved[1].weight.grad.abs().sum() > 0


def test_batch_norm_without_running_statistics_is_refused_with_a_reason():
    model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8, track_running_stats=False),
                          nn.ReLU(), nn.Linear(8, 3)).to(DTYPE).eval()
    with pytest.raises(fsd.UnsupportedModuleError, match="track_running_stats"):
        fsd.BGLN().fit(model, _inputs(_mlp()))


def test_summaries_of_batch_norm_models_combine():
    # fsd.combine stacks θ0 and the running statistics of every summary for one batched pass
    model = _mlp()
    x = _inputs(model)
    other = _moved(model, parameters=False)
    summaries = [fsd.BGLN(deterministic=True, moments=moments, covariance="full").fit(m, x)
                 for m in (model, other) for moments in ("paper", "exact")]
    moved = _moved(other)
    separately = sum(s.distance(moved) for s in summaries)
    torch.testing.assert_close(fsd.combine(summaries).distance(moved), separately,
                               rtol=1e-10, atol=0)


def test_recording_a_batch_norm_model_in_training_mode_warns_once():
    # batch statistics normalise each recorded pass: the gate frequencies recorded are then
    # those of another function than the eval-mode one the estimators measure
    model = _mlp()
    x = torch.randn(64, 5, dtype=DTYPE)
    recorded = {}
    for mode in ("eval", "train"):
        getattr(model, mode)()
        collector = fsd.StatisticsCollector(model, moments="full")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(3):
                with torch.no_grad(), collector.record():
                    model(x)
        messages = [str(w.message) for w in caught if "BatchNorm" in str(w.message)]
        assert len(messages) == (1 if mode == "train" else 0), messages
        recorded[mode] = collector.finalize()
        collector.remove()
    assert "'1'" in messages[0] and "model.eval()" in messages[0]
    # what the warning is about: the two recordings' gate frequencies differ
    train_gates, eval_gates = (recorded[m].gate_means for m in ("train", "eval"))
    assert not all(torch.allclose(train_gates[p], eval_gates[p]) for p in eval_gates)


def test_fit_on_data_records_in_evaluation_mode_without_the_warning():
    model = _mlp().train()
    x = torch.randn(64, 5, dtype=DTYPE)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fsd.BGLN(deterministic=True).fit(model, x, progress=False)
    assert model.training  # fit restores the mode it found


@pytest.mark.parametrize("affine", [True, False])
def test_ntk_takes_an_instance_norm_with_running_statistics_as_its_batch_norm_twin(affine):
    # in evaluation an InstanceNorm with running statistics is the BatchNorm map; NTK refused
    # it ("batch_norm is not differentiable wrt running_mean")
    def make(norm: type[nn.Module]) -> nn.Sequential:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Conv2d(2, 3, 3), norm(3, affine=affine, track_running_stats=True),
                              nn.ReLU(), nn.Flatten(), nn.Linear(27, 2)).to(DTYPE)
        return _randomise_statistics(model, 1).eval()
    instance, batch = make(nn.InstanceNorm2d), make(nn.BatchNorm2d)
    batch.load_state_dict(instance.state_dict(), strict=False)
    x = torch.randn(30, 2, 5, 5, dtype=DTYPE)
    torch.testing.assert_close(instance(x), batch(x), rtol=1e-12, atol=1e-12)
    moved_instance = _moved(instance)
    moved_batch = copy.deepcopy(batch)
    moved_batch.load_state_dict(moved_instance.state_dict(), strict=False)
    value = fsd.NTK().fit(instance, x).distance(moved_instance)
    torch.testing.assert_close(value, fsd.NTK().fit(batch, x).distance(moved_batch),
                               rtol=1e-10, atol=0)
