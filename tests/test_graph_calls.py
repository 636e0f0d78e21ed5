"""In-place operations and modules called at several places, on every graph path.

The models are written as their sources write them: a torchvision-style ResNet (``BasicBlock``
with one ``nn.ReLU(inplace=True)`` called twice, a 1×1 conv + BatchNorm downsample,
``out += identity``, adaptive average pooling) and smaller graphs that isolate each case
(``F.relu(x, inplace=True)``, ``x.relu_()``, ``torch.relu_``, ``out.add_(identity)``, a
shared ``MaxPool2d``). Ground truth:

- the same model written without in-place operations and with one module per call (its
  "twin", the same parameters): every estimator must give it the same value and gradient,
  to float64 round-off — the sharpest test, since the twin has always been supported;
- LAFTR: the network with the reference's gates and max-pool routings held fixed, run by
  autograd (exact), and a first-order JVP of the model in its parameters (to O(scale));
  gradients by float64 finite differences and ``torch.autograd.gradcheck``;
- BGLN-S: its Monte Carlo mean against BGLN-D with exact moments (within 5 standard errors);
  statistics against frequencies counted by hand at each call.
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fsd
from conftest import DTYPE, distance_fn, perturbed
from fsd.model.linearize import graph_gates
from fsd.model.plan import traced_graph

pytestmark = pytest.mark.usefixtures("single_thread")


# ----------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------
def _conv3x3(inplanes: int, planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's BasicBlock; ``twin``: two out-of-place ReLUs and ``out = out + identity``."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1,
                 downsample: nn.Module | None = None, twin: bool = False) -> None:
        super().__init__()
        self.twin = twin
        self.conv1 = _conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        if twin:
            self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        else:
            self.relu = nn.ReLU(inplace=True)
        self.conv2 = _conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.conv1(x)
        out = self.bn1(out)
        out = self.relu1(out) if self.twin else self.relu(out)
        out = self.conv2(out)
        out = self.bn2(out)
        if self.downsample is not None:
            identity = self.downsample(x)
        if self.twin:
            out = out + identity
            return self.relu2(out)
        out += identity
        out = self.relu(out)
        return out


class ResNet(nn.Module):
    """torchvision's ResNet layout at small widths, on 3×8×8 inputs."""

    def __init__(self, twin: bool = False, widths: tuple[int, int] = (4, 6),
                 classes: int = 3) -> None:
        super().__init__()
        self.inplanes = widths[0]
        self.conv1 = nn.Conv2d(3, widths[0], 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=not twin)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        self.layer1 = self._make_layer(widths[0], 2, 1, twin)
        self.layer2 = self._make_layer(widths[1], 1, 2, twin)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(widths[1], classes)

    def _make_layer(self, planes: int, blocks: int, stride: int, twin: bool) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes, 1, stride, bias=False),
                                       nn.BatchNorm2d(planes))
        layers = [BasicBlock(self.inplanes, planes, stride, downsample, twin)]
        self.inplanes = planes
        layers += [BasicBlock(planes, planes, twin=twin) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)
        x = self.layer1(x)
        x = self.layer2(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.fc(x)


def _resnet(twin: bool = False, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = ResNet(twin).to(DTYPE).eval()
    with torch.no_grad():  # BatchNorm that is not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.5, 1.5)
                m.bias.normal_(0, 0.3)
                m.running_mean.normal_(0, 0.3)
                m.running_var.uniform_(0.5, 1.5)
    return model


def _twin_of(model: nn.Module, twin: nn.Module) -> nn.Module:
    """``twin`` with ``model``'s parameters and buffers (their names are the same)."""
    twin = twin.to(DTYPE).eval()  # first: loading float64 into float32 would round
    twin.load_state_dict(model.state_dict())
    return twin


class ResidualMLP(nn.Module):
    """x (4) → h = φ(fc1 x) → y = φ(fc2 h + x) → out y, with the in-place form ``style``.

    ``"twin"`` is the out-of-place form with one module per activation; the others rectify in
    place, with one activation module called twice or a functional form.
    """

    def __init__(self, style: str = "twin", seed: int = 0, leaky: bool = False) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.style = style
        self.fc1, self.fc2, self.out = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 3)
        make = (lambda inplace: nn.LeakyReLU(0.1, inplace=inplace)) if leaky else \
            (lambda inplace: nn.ReLU(inplace=inplace))
        if style == "twin":
            self.act1, self.act2 = make(False), make(False)
        elif style == "module":
            self.act = make(True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.style
        h = self.fc1(x)
        if s == "twin":
            h = self.act1(h)
        elif s == "module":
            h = self.act(h)
        elif s == "functional":
            h = F.relu(h, inplace=True)
        elif s == "method":
            h.relu_()  # the result is not used: later reads of h see the write
        elif s == "torch":
            torch.relu_(h)
        out = self.fc2(h)
        if s in ("twin", "torch"):
            out = out + x
        elif s == "method":
            out.add_(x)
        else:
            out += x
        if s == "twin":
            out = self.act2(out)
        elif s == "module":
            out = self.act(out)
        elif s == "functional":
            out = F.relu(out, inplace=True)
        elif s == "method":
            out.relu_()
        else:
            out = torch.relu_(out)
        return self.out(out)


STYLES = ["module", "functional", "method", "torch"]


class ChainCNN(nn.Module):
    """conv → ReLU → pool → conv → ReLU → pool → fc, with ``self.relu`` and ``self.pool``
    called twice (``twin``: one module per call, out of place)."""

    def __init__(self, twin: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.twin = twin
        self.conv1, self.conv2 = nn.Conv2d(1, 3, 3, padding=1), nn.Conv2d(3, 4, 3, padding=1)
        self.fc = nn.Linear(4 * 2 * 2, 3)
        if twin:
            self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
            self.pool1, self.pool2 = nn.MaxPool2d(2), nn.MaxPool2d(2)
        else:
            self.relu, self.pool = nn.ReLU(inplace=True), nn.MaxPool2d(2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.twin:
            x = self.pool1(self.relu1(self.conv1(x)))
            x = self.pool2(self.relu2(self.conv2(x)))
        else:
            x = self.pool(self.relu(self.conv1(x)))
            x = self.pool(self.relu(self.conv2(x)))
        return self.fc(x.flatten(1))


class ChainMLP(nn.Module):
    """fc1 → ReLU → fc2 → ReLU → fc3, the ReLU one in-place module called twice."""

    def __init__(self, twin: bool = False, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.twin = twin
        self.fc1, self.fc2, self.fc3 = nn.Linear(4, 5), nn.Linear(5, 5), nn.Linear(5, 3)
        if twin:
            self.relu1, self.relu2 = nn.ReLU(), nn.ReLU()
        else:
            self.relu = nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.twin:
            return self.fc3(self.relu2(self.fc2(self.relu1(self.fc1(x)))))
        return self.fc3(self.relu(self.fc2(self.relu(self.fc1(x)))))


def _images(n: int = 24, seed: int = 3) -> torch.Tensor:
    return torch.randn(n, 3, 8, 8, generator=torch.Generator().manual_seed(seed), dtype=DTYPE)


def _vectors(n: int = 200, d: int = 4, seed: int = 3) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=generator, dtype=DTYPE) * 0.8 + 0.2


def _moved_pair(model: nn.Module, twin: nn.Module, scale: float = 0.2
                ) -> tuple[nn.Module, nn.Module]:
    """The model with perturbed parameters, and its twin at the same parameters."""
    moved = perturbed(model, scale, seed=5)
    return moved, _twin_of(moved, copy.deepcopy(twin))


def _value_and_gradients(estimator: fsd.Estimator, model: nn.Module
                         ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    value = estimator.distance(model)
    grads = torch.autograd.grad(value, list(model.parameters()))
    return value.detach(), list(grads)


def _assert_same(a: tuple[torch.Tensor, list[torch.Tensor]],
                 b: tuple[torch.Tensor, list[torch.Tensor]]) -> None:
    """Value and gradients equal to float64 round-off (1e-12 relative)."""
    torch.testing.assert_close(a[0], b[0], rtol=1e-12, atol=0)
    scale = max(float(g.abs().max()) for g in b[1])
    for ga, gb in zip(a[1], b[1], strict=True):
        torch.testing.assert_close(ga, gb, rtol=1e-12, atol=1e-12 * scale)


# ----------------------------------------------------------------------------------------
# brute forces
# ----------------------------------------------------------------------------------------
def _gate_fixed_outputs(twin0: nn.Module, twin1: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Δz of the network θ1 with θ0's ReLU gates and max-pool argmaxes held fixed.

    LAFTR's definition on any graph of ReLUs, max-pools and affine operations (BatchNorm in
    evaluation, convolutions, additions, average pooling): exact, not to first order.
    ``twin0``, ``twin1``: the out-of-place twin at θ0 and at θ1 (one module per call).
    """
    masks: dict[str, torch.Tensor] = {}
    handles = []

    def record(name):
        def hook(module, args, out):
            if isinstance(module, nn.ReLU):
                masks[name] = (args[0] > 0).to(args[0].dtype)
            else:
                masks[name] = F.max_pool2d(args[0], module.kernel_size, module.stride,
                                           module.padding, return_indices=True)[1]
        return hook

    def replay(name):
        def hook(module, args, out):
            if isinstance(module, nn.ReLU):
                return args[0] * masks[name]
            index = masks[name]
            return args[0].flatten(2).gather(2, index.flatten(2)).view_as(index)
        return hook

    fixed = (nn.ReLU, nn.MaxPool2d)
    for name, m in twin0.named_modules():
        if isinstance(m, fixed):
            handles.append(m.register_forward_hook(record(name)))
    with torch.no_grad():
        z0 = twin0(x)
    for name, m in twin1.named_modules():
        if isinstance(m, fixed):
            handles.append(m.register_forward_hook(replay(name)))
    try:
        z1 = twin1(x)
    finally:
        for handle in handles:
            handle.remove()
    return z1 - z0


def _twin_resnet(model: nn.Module) -> nn.Module:
    return _twin_of(model, ResNet(twin=True))


def _per_call_frequencies(twin: nn.Module, x: torch.Tensor) -> list[torch.Tensor]:
    """Firing frequency of every ReLU unit at each call, in call order, by hooks on the twin."""
    found: list[torch.Tensor] = []
    handles = [m.register_forward_pre_hook(
        lambda m, args: found.append((args[0] > 0).to(DTYPE).mean(0)))
        for m in twin.modules() if isinstance(m, nn.ReLU)]
    with torch.no_grad():
        twin(x)
    for handle in handles:
        handle.remove()
    return found


# ----------------------------------------------------------------------------------------
# the ResNet
# ----------------------------------------------------------------------------------------
def test_laftr_on_the_resnet_matches_the_gate_fixed_network_value_and_gradient():
    model, x = _resnet(), _images()
    est = fsd.LAFTR(coreset_size=None).fit(model, x)
    moved = perturbed(model, 0.2, seed=5)
    value = est.distance(moved)
    grads = torch.autograd.grad(value, list(moved.parameters()))  # raised before
    twin0, twin1 = _twin_resnet(model), _twin_resnet(moved)
    dz = _gate_fixed_outputs(twin0, twin1, x)
    expected = 0.5 * dz.pow(2).sum(-1).mean()
    torch.testing.assert_close(value, expected, rtol=1e-12, atol=0)
    want = torch.autograd.grad(expected, list(twin1.parameters()))
    for got, ref in zip(grads, want, strict=True):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-13)
    # float64 central differences along three random directions
    _, f = distance_fn(est, moved)
    params = [p.detach() for p in moved.parameters()]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        direction = [torch.randn(p.shape, generator=generator, dtype=DTYPE) for p in params]
        eps = 1e-6
        plus = f(*[p + eps * v for p, v in zip(params, direction, strict=True)])
        minus = f(*[p - eps * v for p, v in zip(params, direction, strict=True)])
        numeric = (plus - minus) / (2 * eps)
        analytic = sum((g * v).sum() for g, v in zip(grads, direction, strict=True))
        torch.testing.assert_close(analytic, numeric.detach(), rtol=1e-6, atol=1e-10)


def test_laftr_on_the_resnet_is_the_first_order_jvp_near_the_reference():
    model, x = _resnet(), _images()
    est = fsd.LAFTR(coreset_size=None).fit(model, x)
    twin = _twin_resnet(model)
    params = dict(twin.named_parameters())
    generator = torch.Generator().manual_seed(1)
    direction = {n: torch.randn(p.shape, generator=generator, dtype=DTYPE)
                 for n, p in params.items()}
    jv = torch.func.jvp(lambda p: torch.func.functional_call(twin, p, (x,)),
                        ({n: p.detach() for n, p in params.items()},), (direction,))[1]
    first_order = 0.5 * jv.pow(2).sum(-1).mean()
    scale = 1e-5
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for n, p in moved.named_parameters():
            p.add_(scale * direction[n])
    value = est.distance(moved) / scale ** 2
    value.backward()  # raised before
    torch.testing.assert_close(value.detach(), first_order, rtol=1e-3, atol=0)


@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.LAFTR(coreset_size=None), id="laftr-coreset"),
    pytest.param(lambda: fsd.LAFTR(inputs="gaussian", covariance="lowrank", rank=8,
                                   num_samples=32), id="laftr-gaussian"),
    pytest.param(lambda: fsd.BGLN(num_samples=32), id="bgln-s"),
    pytest.param(lambda: fsd.BGLN(inputs="coreset", coreset_size=None), id="bgln-s-coreset"),
    pytest.param(lambda: fsd.BGLN(num_samples=16, classwise=True), id="bgln-s-classwise"),
])
def test_the_resnet_gets_the_value_and_gradient_of_its_out_of_place_twin(make):
    model, x = _resnet(), _images()
    twin = _twin_resnet(model)
    labels = torch.arange(len(x)) % 3
    data = [(x[:12], labels[:12]), (x[12:], labels[12:])]
    est, est_twin = make().fit(model, data), make().fit(twin, data)
    # the statistics of each call site are those of the twin's module at that position
    gates = [k for k in est._state if k.startswith("gate.")]
    gates_twin = [k for k in est_twin._state if k.startswith("gate.")]
    assert len(gates) == len(gates_twin)
    for key, key_twin in zip(gates, gates_twin, strict=True):
        assert torch.equal(est._state[key], est_twin._state[key_twin])
    moved, moved_twin = _moved_pair(model, twin)
    _assert_same(_value_and_gradients(est, moved), _value_and_gradients(est_twin, moved_twin))


def test_bgln_s_on_the_resnet_keeps_statistics_per_call_site_through_save_and_load(tmp_path):
    model, x = _resnet(), _images(40)
    est = fsd.BGLN(num_samples=16).fit(model, x)
    sites = ["relu", "layer1_0_relu", "layer1_0_relu_1", "layer1_1_relu", "layer1_1_relu_1",
             "layer2_0_relu", "layer2_0_relu_1"]
    assert [layer.path for layer in graph_gates(model)] == sites
    assert [k for k in est._state if k.startswith("gate.")] == [f"gate.{s}" for s in sites]
    for site, frequencies in zip(sites, _per_call_frequencies(_twin_resnet(model), x),
                                 strict=True):
        torch.testing.assert_close(est._state[f"gate.{site}"][0], frequencies, rtol=0,
                                   atol=1e-15)
    # the signature records every call site, and the file holds their statistics
    recorded = [e["path"] for e in est._meta["signature"] if isinstance(e, dict)]
    assert recorded == sites
    est.save(tmp_path / "resnet.pt")
    loaded = fsd.load(tmp_path / "resnet.pt")
    moved = perturbed(model, 0.2, seed=5)
    torch.testing.assert_close(loaded.distance(moved), est.distance(moved), rtol=0, atol=0)
    # fsd.load checks the keys against the recorded call sites
    payload = torch.load(tmp_path / "resnet.pt", weights_only=True)
    payload["tensors"]["gate.layer1_0_relu_2"] = payload["tensors"].pop("gate.layer1_0_relu_1")
    payload.pop("checksums", None)
    torch.save(payload, tmp_path / "renamed.pt")
    with pytest.raises(fsd.SummaryFormatError,
                       match=r"'gate\.layer1_0_relu_2'.*no layer or call site") as info:
        fsd.load(tmp_path / "renamed.pt")
    assert "\n" not in str(info.value)


def test_a_collector_in_the_training_loop_records_each_call_of_a_reused_relu():
    model, x = _resnet(), _images(40)
    estimator = fsd.BGLN(num_samples=16)
    collector = estimator.statistics_collector(model)
    assert collector is not None
    with collector:
        for batch in x.split(15):
            with collector.record():
                model(batch)  # in place, self.relu called twice per block
    recorded = estimator.fit(model, statistics=collector)
    fitted = fsd.BGLN(num_samples=16).fit(model, x.split(15))
    for key in [k for k in fitted._state if k.startswith("gate.")]:
        torch.testing.assert_close(recorded._state[key], fitted._state[key], rtol=1e-14,
                                   atol=1e-15)
    # a reused module called outside the model's forward cannot be given a call site
    collector = fsd.StatisticsCollector(model, moments=None)
    with collector, collector.record(), torch.no_grad():
        model(x[:4])
        with pytest.raises(RuntimeError, match="called more than its 2 times"):
            model.layer1[0].relu(x[:4, :4])


def test_continual_regularizer_penalty_on_the_resnet_backpropagates_like_its_twin():
    model, x = _resnet(), _images()
    twin = _twin_resnet(model)
    penalties = []
    for net in (model, twin):
        regularizer = fsd.ContinualRegularizer(lambda: fsd.LAFTR(coreset_size=None))
        regularizer.end_task(net, x)
        penalties.append(regularizer)
    moved, moved_twin = _moved_pair(model, twin)
    values = []
    for regularizer, net in zip(penalties, (moved, moved_twin), strict=True):
        penalty = regularizer.penalty(net)
        values.append((penalty.detach(), list(torch.autograd.grad(penalty,
                                                                  list(net.parameters())))))
    _assert_same(values[0], values[1])


def test_bgln_d_refuses_the_resnet_at_fit_in_one_line_naming_what_takes_it():
    model, x = _resnet(), _images()
    with pytest.raises(fsd.UnsupportedModuleError,
                       match=r"not a chain.*moments='corrected' on chains and residual graphs.*"
                             r"BGLN-S or LAFTR on any graph") as info:
        fsd.BGLN(deterministic=True).fit(model, x)
    assert "\n" not in str(info.value)
    # exact moments: the reused ReLU is no longer the reason (it was, before)
    with pytest.raises(NotImplementedError,
                       match=r"needs flat inputs.*use BGLN-D with moments='corrected'.*"
                             r"BGLN-S or LAFTR on any graph") as info:
        fsd.BGLN(deterministic=True, moments="exact").fit(model, x)
    assert "\n" not in str(info.value)
    # the walk both refusals name takes it, its ReLU called twice included
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    value = fsd.BGLN(deterministic=True, moments="corrected").fit(model, x).distance(moved)
    assert torch.isfinite(value) and float(value.detach()) > 0


# ----------------------------------------------------------------------------------------
# small graphs, one case each
# ----------------------------------------------------------------------------------------
ESTIMATORS = {
    "laftr": lambda: fsd.LAFTR(coreset_size=None),
    "bgln-s": lambda: fsd.BGLN(num_samples=64, covariance="full"),
    "bgln-d-exact": lambda: fsd.BGLN(deterministic=True, moments="exact", covariance="full"),
}


@pytest.mark.parametrize("name", list(ESTIMATORS))
def test_in_place_residual_mlps_get_the_value_and_gradient_of_their_twin(name):
    twin = ResidualMLP("twin").to(DTYPE)
    x = _vectors()
    for style in STYLES:  # each in-place form of the same function
        model = ResidualMLP(style).to(DTYPE)
        model.load_state_dict(twin.state_dict())
        # fresh summaries: BGLN-S's draws follow the calls made
        est, est_twin = ESTIMATORS[name]().fit(model, x), ESTIMATORS[name]().fit(twin, x)
        moved, moved_twin = _moved_pair(model, twin, 0.3)
        _assert_same(_value_and_gradients(est, moved),
                     _value_and_gradients(est_twin, moved_twin))
        assert float(est.distance(moved)) > 0
        # the eager model itself is unchanged by fitting: the outputs of its twin
        torch.testing.assert_close(model(x), twin(x), rtol=0, atol=0)


def test_laftr_gradient_through_in_place_activations_passes_gradcheck():
    for style in STYLES:
        model = ResidualMLP(style).to(DTYPE)
        est = fsd.LAFTR(coreset_size=None).fit(model, _vectors(30))
        moved = perturbed(model, 0.3, seed=5)
        _, f = distance_fn(est, moved)
        params = tuple(p.detach().clone().requires_grad_() for p in moved.parameters())
        assert torch.autograd.gradcheck(f, params, eps=1e-6, atol=1e-8, rtol=1e-6), style


def test_an_in_place_leaky_relu_called_twice_gets_the_value_of_its_twin():
    # LAFTR applied the in-place leaky ReLU to the reference value before linearizing it,
    # i.e. at φ(s0) instead of s0: the right gate, but φ(φ(s0)) as the reference activation
    model = ResidualMLP("module", leaky=True).to(DTYPE)
    twin = ResidualMLP("twin", leaky=True).to(DTYPE)
    twin.load_state_dict(model.state_dict())
    x = _vectors()
    for make in (ESTIMATORS["laftr"], ESTIMATORS["bgln-s"]):
        est, est_twin = make().fit(model, x), make().fit(twin, x)
        moved, moved_twin = _moved_pair(model, twin, 0.3)
        _assert_same(_value_and_gradients(est, moved),
                     _value_and_gradients(est_twin, moved_twin))


@pytest.mark.parametrize("name", ["laftr", "bgln-s", "bgln-d-paper", "bgln-d-exact"])
def test_a_chain_mlp_calling_one_in_place_relu_twice_gets_the_value_of_its_twin(name):
    make = {**ESTIMATORS,
            "bgln-d-paper": lambda: fsd.BGLN(deterministic=True, covariance="full")}[name]
    model, twin = ChainMLP().to(DTYPE), ChainMLP(twin=True).to(DTYPE)
    twin.load_state_dict(model.state_dict())
    assert [layer.path for layer in fsd.trace(model)] == ["fc1", "relu", "fc2", "relu_1", "fc3"]
    x = _vectors()
    est, est_twin = make().fit(model, x), make().fit(twin, x)
    moved, moved_twin = _moved_pair(model, twin, 0.3)
    _assert_same(_value_and_gradients(est, moved), _value_and_gradients(est_twin, moved_twin))


@pytest.mark.parametrize("make", [
    pytest.param(lambda: fsd.LAFTR(coreset_size=None), id="laftr"),
    pytest.param(lambda: fsd.BGLN(num_samples=32), id="bgln-s"),
    pytest.param(lambda: fsd.BGLN(deterministic=True), id="bgln-d-paper"),
    pytest.param(lambda: fsd.BGLN(deterministic=True, classwise=True), id="bgln-d-paper-cw"),
])
def test_a_cnn_calling_one_relu_and_one_max_pool_twice_gets_the_value_of_its_twin(make):
    model, twin = ChainCNN().to(DTYPE), ChainCNN(twin=True).to(DTYPE)
    twin.load_state_dict(model.state_dict())
    x = torch.randn(30, 1, 8, 8, generator=torch.Generator().manual_seed(2), dtype=DTYPE)
    data = [(x, torch.arange(30) % 3)]
    est, est_twin = make().fit(model, data), make().fit(twin, data)
    for prefix in ("gate.", "routing."):  # one entry per call, equal to the twin's
        ours = [v for k, v in est._state.items() if k.startswith(prefix)]
        theirs = [v for k, v in est_twin._state.items() if k.startswith(prefix)]
        assert len(ours) == len(theirs) and all(map(torch.equal, ours, theirs))
    moved, moved_twin = _moved_pair(model, twin, 0.2)
    _assert_same(_value_and_gradients(est, moved), _value_and_gradients(est_twin, moved_twin))


class SharedResidual(nn.Module):
    """One Linear and one ReLU, each called twice, around a skip: y = φ(W φ(W x + b) + x)."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.fc, self.out, self.relu = nn.Linear(4, 4), nn.Linear(4, 3), nn.ReLU(inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.relu(self.fc(x))
        out = self.fc(h)
        out += x
        return self.out(self.relu(out))


@pytest.mark.parametrize("build", [lambda: ResidualMLP("module"), SharedResidual],
                         ids=["reused-relu", "shared-linear-and-relu"])
def test_bgln_s_mean_matches_bgln_d_exact_moments_with_reused_modules(build):
    model = build().to(DTYPE)
    x = _vectors(400)
    exact = fsd.BGLN(deterministic=True, moments="exact", covariance="full").fit(model, x)
    sampled = fsd.BGLN(num_samples=2000, covariance="full", seed=4).fit(model, x)
    moved = perturbed(model, 0.3, seed=5)
    with torch.no_grad():
        draws = torch.stack([sampled.distance(moved) for _ in range(40)])
        target = exact.distance(moved)
    mean, error = draws.mean(), draws.std() / math.sqrt(len(draws))
    assert float((mean - target).abs()) < 5 * float(error), (float(mean), float(target))
    # the paper's Algorithm 2 reads shared weights by path on a chain: it refuses in one
    # line, naming what takes them
    if isinstance(model, SharedResidual):
        with pytest.raises(fsd.UnsupportedModuleError) as info:
            fsd.BGLN(deterministic=True).fit(model, x)
        assert "\n" not in str(info.value)


def test_call_sites_keep_module_paths_for_modules_called_once():
    model = _resnet()
    sites = fsd.model.tracing.call_site_paths(traced_graph(model), dict(model.named_modules()))
    keys = {node.name: key for node, key in sites.items()}
    assert keys["layer1_0_conv1"] == "layer1.0.conv1"  # called once: its path, as before
    assert keys["maxpool"] == "maxpool"
    assert keys["layer1_0_relu"] == "layer1_0_relu"  # called twice: the node name
    assert keys["layer1_0_relu_1"] == "layer1_0_relu_1"
    # a shared MaxPool2d: one routing per call
    layers = fsd.trace(ChainCNN().to(DTYPE))
    assert [layer.path for layer in layers] == ["conv1", "relu", "pool", "conv2", "relu_1",
                                               "pool_1", "flatten", "fc"]


class ViewThenWrite(nn.Module):
    """An in-place ReLU whose write a view taken before it sees: not rewritable."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        v = h.view(-1, 2, 2)
        h.relu_()
        return self.fc2(torch.cat([h, v.flatten(1)], 1))


def test_an_in_place_write_seen_through_an_earlier_view_is_refused_in_one_line():
    model = ViewThenWrite().to(DTYPE)
    x = _vectors(20)
    for make in (lambda: fsd.LAFTR(), lambda: fsd.BGLN()):
        # LAFTR's fit may wrap it in its check that the graph walks (a ValueError)
        with pytest.raises((fsd.UnsupportedModuleError, ValueError),
                           match=r"in-place operation relu_ at graph node 'relu_' writes to "
                                 r"'fc1'.*through 'view'.*out of place") as info:
            make().fit(model, x)
        assert "\n" not in str(info.value)
    # the estimators that run the forward take it
    assert float(fsd.ExactFSD().fit(model, x).distance(perturbed(model, 0.3))) > 0


# ----------------------------------------------------------------------------------------
# copies and views that keep every value (Avalanche's SimpleMLP calls x.contiguous() and
# x.view(x.size(0), input_size))
# ----------------------------------------------------------------------------------------
class CopyingMLP(nn.Module):
    """An MLP on images whose forward copies, casts and views its input as frameworks do."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.fc1, self.relu, self.fc2 = nn.Linear(12, 6), nn.ReLU(inplace=True), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.style == "avalanche":  # avalanche.models.SimpleMLP's first two lines
            x = x.contiguous()
            x = x.view(x.size(0), 12)
        elif self.style == "copies":
            x = torch.clone(x.detach()).reshape(x.shape[0], 12)
            x = self.relu(self.fc1(x)).clone()
            return self.fc2(x.contiguous())
        elif self.style == "casts":  # to the model's own dtype (float64 here): no-op casts
            x = x.double().to(torch.float64).detach().flatten(1)
            return self.fc2(self.relu(self.fc1(x).to(dtype=torch.float64)).double())
        else:  # the twin: nn.Flatten, as every walker has always taken it
            x = x.flatten(1)
        return self.fc2(self.relu(self.fc1(x)))


COPY_ESTIMATORS = {
    **ESTIMATORS,
    "bgln-d-paper": lambda: fsd.BGLN(deterministic=True, covariance="full"),
    "bgln-d-corrected": lambda: fsd.BGLN(deterministic=True, moments="corrected",
                                         covariance="full"),
    "exact-fsd": lambda: fsd.ExactFSD(), "ntk": lambda: fsd.NTK(), "ewc": lambda: fsd.EWC(),
    "kfac": lambda: fsd.KFAC(),
}


@pytest.mark.parametrize("name", list(COPY_ESTIMATORS))
@pytest.mark.parametrize("style", ["avalanche", "copies", "casts"])
def test_copies_and_flattening_views_get_the_value_and_gradient_of_the_twin(name, style):
    twin = CopyingMLP("twin").to(DTYPE)
    model = CopyingMLP(style).to(DTYPE)
    model.load_state_dict(twin.state_dict())
    x = _vectors(120, 12).reshape(120, 3, 2, 2)
    y = torch.randint(0, 3, (120,), generator=torch.Generator().manual_seed(0))
    data = [(x[i:i + 40], y[i:i + 40]) for i in range(0, 120, 40)]
    torch.manual_seed(0)
    est = COPY_ESTIMATORS[name]().fit(model, data)
    torch.manual_seed(0)
    est_twin = COPY_ESTIMATORS[name]().fit(twin, data)
    moved, moved_twin = _moved_pair(model, twin, 0.3)
    _assert_same(_value_and_gradients(est, moved), _value_and_gradients(est_twin, moved_twin))
    assert float(est.distance(moved)) > 0


def test_a_detach_inside_the_network_stays_and_stops_the_gradient():
    # only a detach of the forward's input is dropped: one after a layer stops its gradient
    class Stopped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 5), nn.Linear(5, 2)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(torch.relu(self.fc1(x)).detach())

    model = Stopped().to(DTYPE)
    assert [n.target for n in traced_graph(model).nodes if n.op == "call_method"] == ["detach"]
    est = fsd.LAFTR(coreset_size=None).fit(model, _vectors(30))
    moved = perturbed(model, 0.3)
    value = est.distance(moved)
    grads = torch.autograd.grad(value, [moved.fc1.weight, moved.fc2.weight],
                                allow_unused=True)
    assert grads[0] is None or float(grads[0].abs().max()) == 0
    assert float(grads[1].abs().max()) > 0


GRAPH_FILES = Path(__file__).resolve().parent / "data" / "summaries_fitted_on_graphs"


class Copying(nn.Module):
    """The model of tests/data/summaries_fitted_on_graphs (its README writes them)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.relu, self.fc2 = nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        x = x.view(x.size(0), 6)
        return self.fc2(self.relu(self.fc1(x)))


@pytest.mark.parametrize("name", ["LAFTR", "BGLN-S", "BGLN-D-exact", "BGLN-D-corrected"])
def test_summaries_fitted_when_the_model_was_a_graph_walk_it_and_give_their_distances(name):
    torch.manual_seed(0)
    model = Copying().to(DTYPE)
    moved = Copying().to(DTYPE)
    moved.load_state_dict(model.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(2)
        for p in moved.parameters():
            p.add_(0.3 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    want = json.loads((GRAPH_FILES / "distances.json").read_text())[name]
    old = fsd.load(GRAPH_FILES / f"{name}.fsd")
    # the last bits may differ: written on another CPU (float64 reductions ordered otherwise)
    assert float(old.distance(moved)) == pytest.approx(want, rel=1e-12)
    if name != "BGLN-S":  # the deterministic walks: the chain a fresh fit now takes agrees
        x = torch.randn(40, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(1))
        fresh = {"LAFTR": lambda: fsd.LAFTR(coreset_size=None),
                 "BGLN-D-exact": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                                  covariance="full"),
                 "BGLN-D-corrected": lambda: fsd.BGLN(deterministic=True, moments="corrected",
                                                      covariance="full")}[name]().fit(model, x)
        assert isinstance(fresh._meta["signature"][0], dict)  # read as a chain now
        assert float(fresh.distance(moved)) == pytest.approx(want, rel=1e-10)


class CastsItsInput(nn.Module):
    """A float32 MLP whose forward casts its input (float64 data from numpy, say)."""

    def __init__(self, cast: bool = True) -> None:
        super().__init__()
        self.cast = cast
        self.fc1, self.relu, self.fc2 = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cast:
            x = x.float()
        return self.fc2(self.relu(self.fc1(x)))


@pytest.mark.parametrize("name", ["laftr", "bgln-d-paper", "bgln-d-corrected"])
def test_a_cast_of_float64_data_in_a_float32_model_is_a_chain_step(name):
    make = COPY_ESTIMATORS[name]
    model, twin = CastsItsInput(), CastsItsInput(cast=False)
    twin.load_state_dict(model.state_dict())
    assert type(fsd.trace(model)[0].module).__name__ == "Cast"
    x = _vectors(80)  # float64
    est, est_twin = make().fit(model, x), make().fit(twin, x.float())
    moved, moved_twin = perturbed(model, 0.3, seed=5), CastsItsInput(cast=False)
    moved_twin.load_state_dict(moved.state_dict())
    value, value_twin = est.distance(moved), est_twin.distance(moved_twin)
    assert value.dtype == torch.float32
    torch.testing.assert_close(value, value_twin, rtol=1e-5, atol=0)
