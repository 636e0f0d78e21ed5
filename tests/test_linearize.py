"""LAFTR on any traceable graph (fsd.model.linearize), NTK/EWC with buffers, against brute force.

The brute-force LAFTR is an independent construction: run the reference network and record
the input of every nonlinear layer; then run the moved network with each nonlinear layer's
output replaced (forward hook) by its first-order expansion at the reference input,
m(s0) + J m(s0)·(s − s0), evaluated with the moved layer's own parameters. Its output minus
the reference output is LAFTR's Δz.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import jvp

import fsd
from fsd.model.linearize import linearized_outputs, propagate_linearized, true_gates
from fsd.model.plan import trace

DTYPE = torch.float64
NONLINEAR = (nn.ReLU, nn.GELU, nn.LeakyReLU, nn.Tanh, nn.SiLU, nn.LayerNorm, nn.MaxPool2d,
             nn.MultiheadAttention, nn.Softplus)


class ResidualMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 8)
        self.act1, self.act2 = nn.ReLU(), nn.ReLU()
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.act1(self.inp(x))
        h = h + self.fc2(self.act2(self.fc1(h)))
        return self.out(h)


class TinyResNet(nn.Module):
    """Conv–BN–ReLU stem, one residual block, adaptive average pooling, linear head."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(2, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU())
        self.conv1, self.bn1 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.conv2, self.bn2 = nn.Conv2d(4, 4, 3, padding=1, bias=False), nn.BatchNorm2d(4)
        self.act1, self.act2 = nn.ReLU(), nn.ReLU()
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        h = self.stem(x)
        r = self.bn2(self.conv2(self.act1(self.bn1(self.conv1(h)))))
        h = self.act2(h + r)
        return self.head(torch.flatten(self.pool(h), 1))


class TransformerBlock(nn.Module):
    """Pre-norm block: one attention head and a GELU MLP, mean-pooled to 3 outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(8), nn.LayerNorm(8)
        self.attention = nn.MultiheadAttention(8, 1, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attention(h, h, h, need_weights=False)[0]
        x = x + self.mlp(self.norm2(x))
        return self.head(x.mean(dim=1))


def _mlp(act: nn.Module) -> nn.Sequential:
    return nn.Sequential(nn.Linear(6, 10), act, nn.Linear(10, 10), copy.deepcopy(act),
                         nn.Linear(10, 3))


ZOO = {
    "residual-mlp": (ResidualMLP, (6,)),
    "tiny-resnet": (TinyResNet, (2, 6, 6)),
    "transformer": (TransformerBlock, (5, 8)),
    "padded-chain": (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(),
                                           nn.Conv2d(3, 3, 3, padding=2, dilation=2),
                                           nn.Flatten(), nn.Linear(108, 3)), (2, 6, 6)),
    "gelu-mlp": (lambda: _mlp(nn.GELU()), (6,)),
    "leaky-mlp": (lambda: _mlp(nn.LeakyReLU(0.1)), (6,)),
    "tanh-mlp": (lambda: _mlp(nn.Tanh()), (6,)),
    "softplus-mlp": (lambda: _mlp(nn.Softplus()), (6,)),
}


def _build(name: str, seed: int = 0) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(seed)
    make, shape = ZOO[name]
    model = make().to(DTYPE)
    with torch.no_grad():  # running statistics that are not the identity
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.uniform_(-0.5, 0.5)
                m.running_var.uniform_(0.5, 2.0)
    model.eval()
    x = torch.randn(12, *shape, generator=torch.Generator().manual_seed(seed + 1), dtype=DTYPE)
    return model, x


def _moved(model: nn.Module, scale: float = 0.1, buffers: bool = True) -> nn.Module:
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
        if buffers:
            for name, b in moved.named_buffers():
                if name.endswith("running_mean"):
                    b.add_(scale * torch.randn(b.shape, generator=g, dtype=b.dtype))
                if name.endswith("running_var"):
                    b.mul_(1 + scale * torch.rand(b.shape, generator=g, dtype=b.dtype))
    return moved


def brute_force_laftr(reference: nn.Module, moved: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Δz of the moved network with every nonlinear layer expanded at the reference."""
    recorded: dict[str, tuple] = {}
    handles = []
    for path, m in reference.named_modules():
        if isinstance(m, NONLINEAR):
            def record(module, args, kwargs, output, path=path):
                recorded[path] = (args, kwargs)
            handles.append(m.register_forward_hook(record, with_kwargs=True))
    with torch.no_grad():
        z0 = reference(x)
    for h in handles:
        h.remove()
    handles = []
    for path, m in moved.named_modules():
        if isinstance(m, NONLINEAR):
            def expand(module, args, kwargs, output, path=path):
                args0, kwargs0 = recorded[path]
                tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]

                def f(*values):
                    full = list(args0)
                    for i, v in zip(tensors, values, strict=True):
                        full[i] = v
                    out = module._call_impl_without_hooks(*full, **kwargs0) \
                        if hasattr(module, "_call_impl_without_hooks") else \
                        module.forward(*full, **kwargs0)
                    return out[0] if isinstance(out, tuple) else out

                at_reference, tangent = jvp(f, tuple(args0[i] for i in tensors),
                                            tuple(args[i] - args0[i] for i in tensors))
                expanded = at_reference + tangent
                return (expanded, *output[1:]) if isinstance(output, tuple) else expanded
            handles.append(m.register_forward_hook(expand, with_kwargs=True))
    try:
        with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.MATH]):
            z1 = moved(x)
    finally:
        for h in handles:
            h.remove()
    return z1 - z0


@pytest.mark.parametrize("name", sorted(ZOO))
def test_laftr_on_any_graph_equals_the_brute_force_expansion(name):
    model, x = _build(name)
    moved = _moved(model)
    expected = brute_force_laftr(model, moved, x)
    reference = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    reference = {k: v.detach() for k, v in reference.items()}
    _, dz = linearized_outputs(moved, reference, x)
    torch.testing.assert_close(dz, expected, rtol=1e-9, atol=1e-12)
    # and the estimator: ½ mean ‖Δz‖² over the coreset
    value = fsd.LAFTR(inputs="coreset").fit(model, x).distance(moved)
    torch.testing.assert_close(value, 0.5 * expected.pow(2).sum(-1).mean(), rtol=1e-9, atol=0)


@pytest.mark.parametrize("mode", ["reflect", "replicate", "circular"])
@pytest.mark.parametrize("name", ["tiny-resnet", "padded-chain"])
def test_laftr_pads_as_the_convolution_does(name, mode):
    # the pass once padded every Conv2d with zeros, whatever its padding_mode (−18 to −31 %
    # on a linear CNN); the brute force runs each module's own forward
    model, x = _build(name)
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            m.padding_mode = mode
    moved = _moved(model)
    expected = brute_force_laftr(model, moved, x)
    for estimator in (fsd.LAFTR(inputs="coreset"), fsd.BGLN(inputs="coreset")):
        value = estimator.fit(model, x).distance(moved)
        if isinstance(estimator, fsd.LAFTR):
            torch.testing.assert_close(value, 0.5 * expected.pow(2).sum(-1).mean(),
                                       rtol=1e-9, atol=0)
    reference = {k: v.detach() for k, v in [*model.named_parameters(), *model.named_buffers()]}
    _, dz = linearized_outputs(moved, reference, x, true_gates)  # BGLN-S's pass, LAFTR's gates
    torch.testing.assert_close(dz, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("name", ["residual-mlp", "tiny-resnet", "transformer"])
def test_laftr_gradient_is_the_brute_force_gradient(name):
    model, x = _build(name)
    moved = _moved(model)
    est = fsd.LAFTR(inputs="coreset").fit(model, x)
    est.distance(moved).backward()
    got = [p.grad.clone() for p in moved.parameters()]
    moved.zero_grad()
    (0.5 * brute_force_laftr(model, moved, x).pow(2).sum(-1).mean()).backward()
    for g, p in zip(got, moved.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-8, atol=1e-12)


def test_the_generic_pass_equals_the_chain_walker_on_chains():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                          nn.Flatten(), nn.Linear(27, 8), nn.ReLU(), nn.Linear(8, 3)).to(DTYPE)
    x = torch.randn(10, 1, 6, 6, dtype=DTYPE)
    moved = _moved(model)
    params0 = {k: v.detach() for k, v in model.named_parameters()}
    z0, dz = propagate_linearized(trace(model), params0, dict(moved.named_parameters()), x)
    g0, gz = linearized_outputs(moved, params0, x)
    torch.testing.assert_close(g0, z0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gz, dz, rtol=1e-12, atol=1e-14)


class AffineGraph(nn.Module):
    """No nonlinearity: residual add, concatenation, BatchNorm (evaluation), average pooling."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.bn = nn.BatchNorm2d(3)
        self.skip = nn.Conv2d(2, 3, 1)
        self.pool = nn.AdaptiveAvgPool2d(2)
        self.head = nn.Linear(24, 3)

    def forward(self, x):
        h = self.bn(self.conv(x)) + self.skip(x)
        h = torch.cat([h, 2 * h], dim=1)
        return self.head(self.pool(h).flatten(1))


def test_laftr_is_the_exact_fsd_on_affine_graphs():
    torch.manual_seed(4)
    model = AffineGraph().to(DTYPE).eval()
    x = torch.randn(20, 2, 5, 5, dtype=DTYPE)
    moved = _moved(model, 0.3)
    torch.testing.assert_close(fsd.LAFTR().fit(model, x).distance(moved),
                               fsd.ExactFSD().fit(model, x).distance(moved), rtol=1e-10, atol=0)


@pytest.mark.parametrize("make", [lambda: fsd.LAFTR(), lambda: fsd.NTK(), fsd.ExactFSD])
def test_running_statistics_alone_count_as_movement(make):
    # only the BatchNorm running statistics change: the function moved (a true FSD > 0)
    model, x = _build("tiny-resnet")
    moved = _moved(model, 0.2)
    with torch.no_grad():
        for p, q in zip(model.parameters(), moved.parameters(), strict=True):
            q.copy_(p)
    truth = 0.5 * (moved(x) - model(x)).pow(2).sum(-1).mean()
    value = make().fit(model, x).distance(moved)
    assert float(truth) > 1e-3
    if isinstance(make(), fsd.ExactFSD):
        torch.testing.assert_close(value, truth, rtol=1e-12, atol=0)
    elif isinstance(make(), fsd.LAFTR):
        expected = brute_force_laftr(model, moved, x)
        torch.testing.assert_close(value, 0.5 * expected.pow(2).sum(-1).mean(), rtol=1e-9,
                                   atol=0)
    else:  # NTK: the first-order change in the buffers, by central differences
        buffers0 = dict(model.named_buffers())
        buffers1 = dict(moved.named_buffers())
        h = 1e-5

        def at(t):
            state = {**dict(model.named_parameters()),
                     **{k: (v + t * (buffers1[k] - v) if v.is_floating_point() else v)
                        for k, v in buffers0.items()}}
            return torch.func.functional_call(model, state, (x,))

        jv = (at(h) - at(-h)) / (2 * h)
        torch.testing.assert_close(value, 0.5 * jv.pow(2).sum(-1).mean(), rtol=1e-6, atol=0)


@pytest.mark.parametrize("make", [fsd.EWC, fsd.KFAC])
def test_parameter_only_estimators_warn_that_moved_buffers_are_not_counted(make):
    model, x = _build("tiny-resnet")
    moved = _moved(model, 0.2)
    est = make(metric="euclidean").fit(model, x)
    with pytest.warns(UserWarning, match=rf"^{make.__name__} measures parameter movement only"
                                         r".*buffers .*running_mean.* are not counted"):
        est.distance(moved)


def test_laftr_with_gaussian_inputs_on_a_residual_network():
    model, _ = _build("residual-mlp")
    data = torch.randn(400, 6, dtype=DTYPE)
    est = fsd.LAFTR(inputs="gaussian", num_samples=64, seed=1).fit(model, data)
    value = est.distance(_moved(model))
    assert torch.isfinite(value) and float(value) > 0


def test_bgln_d_refuses_a_graph_it_cannot_walk_and_says_what_works():
    model, x = _build("residual-mlp")
    with pytest.raises(fsd.UnsupportedModuleError,
                       match=r"not a chain.*'add'.*Algorithm 2\) takes chains.*BGLN-S or LAFTR "
                             r"on any graph.*ExactFSD"):
        fsd.BGLN(deterministic=True).fit(model, x)


GATES = {"residual-mlp": ["act1", "act2"], "tiny-resnet": ["stem.2", "act1", "act2"],
         "transformer": ["mlp.1"], "gelu-mlp": ["1", "3"], "leaky-mlp": ["1", "3"],
         "tanh-mlp": ["1", "3"], "softplus-mlp": ["1", "3"], "padded-chain": ["1"]}


@pytest.mark.parametrize("name", sorted(ZOO))
def test_the_gate_callback_with_the_true_gates_is_laftr(name):
    # BGLN-S's hook into the graph walk: with the reference's own gates it is LAFTR again
    model, x = _build(name)
    moved = _moved(model)
    reference = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    reference = {k: v.detach() for k, v in reference.items()}
    seen = []

    def gate(layer, s0):
        seen.append(layer.path)
        return true_gates(layer, s0)

    z0, dz = linearized_outputs(moved, reference, x)
    g0, gz = linearized_outputs(moved, reference, x, gate)
    assert seen == GATES[name]  # every activation, once, by its module path
    torch.testing.assert_close(g0, z0, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(gz, dz, rtol=1e-12, atol=1e-14)


def test_a_functional_activation_is_linearized_too():
    class Functional(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(6, 10), nn.Linear(10, 3)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x)))

    torch.manual_seed(5)
    model = Functional().to(DTYPE)
    twin = nn.Sequential(model.fc1, nn.GELU(), model.fc2)
    x = torch.randn(15, 6, dtype=DTYPE)
    moved = _moved(model)
    moved_twin = nn.Sequential(moved.fc1, nn.GELU(), moved.fc2)
    torch.testing.assert_close(
        fsd.LAFTR().fit(model, x).distance(moved),
        0.5 * brute_force_laftr(twin, moved_twin, x).pow(2).sum(-1).mean(), rtol=1e-9, atol=0)


# ----------------------------------------------------------------------------------------
# weights read in forward (F.linear, x @ W, a learnable gain): exact, as nn.Linear's are
# ----------------------------------------------------------------------------------------
class ModuleForm(nn.Module):
    """6-8-8-3, nn.Linear layers; the subclasses read the same parameters in forward."""

    def __init__(self, act: bool = False) -> None:
        super().__init__()
        self.l1, self.l2, self.l3 = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.act = act
        self.a1, self.a2 = nn.ReLU(), nn.ReLU()

    def gate(self, h, a):
        return a(h) if self.act else h

    def forward(self, x):
        return self.l3(self.gate(self.l2(self.gate(self.l1(x), self.a1)), self.a2))


class FLinearForm(ModuleForm):
    def layer(self, h, m):
        return F.linear(h, m.weight, m.bias)

    def gate(self, h, a):
        return F.relu(h) if self.act else h

    def forward(self, x):
        h = self.gate(self.layer(x, self.l1), None)
        h = self.gate(self.layer(h, self.l2), None)
        return self.layer(h, self.l3)


class MatmulForm(FLinearForm):
    def layer(self, h, m):
        return h @ m.weight.T + m.bias


class MethodForm(FLinearForm):
    def layer(self, h, m):
        return h.matmul(m.weight.t()).add(m.bias)


class MmForm(FLinearForm):
    def layer(self, h, m):
        return torch.add(torch.mm(h, m.weight.t()), m.bias)


class AddmmForm(FLinearForm):
    def layer(self, h, m):
        return torch.addmm(m.bias, h, m.weight.T)


class BmmForm(FLinearForm):  # the weight expanded to the batch: parameters alone, x.size(0)
    def layer(self, h, m):
        w = m.weight.T.unsqueeze(0).expand(h.size(0), -1, -1)
        return torch.bmm(h.unsqueeze(1), w).squeeze(1) + m.bias


FORMS = {"F.linear": FLinearForm, "matmul": MatmulForm, "method": MethodForm, "mm": MmForm,
         "addmm": AddmmForm, "bmm": BmmForm}


def _twins(form, act: bool, seed: int = 0):
    """The module form and ``form`` with the same parameters, x, and both moved alike."""
    torch.manual_seed(seed)
    model = ModuleForm(act).to(DTYPE)
    other = form(act).to(DTYPE)
    other.load_state_dict(model.state_dict())
    x = torch.randn(40, 6, dtype=DTYPE, generator=torch.Generator().manual_seed(seed + 1))
    moved = _moved(model, 0.3)
    moved_other = form(act).to(DTYPE)
    moved_other.load_state_dict(moved.state_dict())
    return model, other, moved, moved_other, x


def _value_and_grad(est, moved: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    value = est.distance(moved)
    return value.detach(), list(torch.autograd.grad(value, list(moved.parameters())))


@pytest.mark.parametrize("form", sorted(FORMS))
def test_laftr_on_a_linear_network_written_with_weights_in_forward_is_the_exact_fsd(form):
    # LAFTR's Δa·ΔW term: dropped here it gave NTK's value (0.41× ExactFSD)
    model, other, moved, moved_other, x = _twins(FORMS[form], act=False)
    exact = fsd.ExactFSD().fit(model, x).distance(moved)
    twin, twin_grad = _value_and_grad(fsd.LAFTR(coreset_size=None).fit(model, x), moved)
    value, grad = _value_and_grad(fsd.LAFTR(coreset_size=None).fit(other, x), moved_other)
    ntk = fsd.NTK(coreset_size=None).fit(model, x).distance(moved)
    assert abs(float(ntk.detach() / exact.detach()) - 1) > 0.1  # far from first order
    torch.testing.assert_close(twin, exact, rtol=1e-9, atol=0)
    torch.testing.assert_close(value, exact, rtol=1e-9, atol=0)
    for g, h in zip(grad, twin_grad, strict=True):
        torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-12)


class Gains(nn.Module):
    """Linear in x, but not in the parameters: gains, a softplus scale, a quotient, a sign mask,
    a product of two weight matrices, a convolution and a bias, all read in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.conv_w = nn.Parameter(0.3 * torch.randn(3, 2, 3, 3))
        self.conv_b = nn.Parameter(0.1 * torch.randn(3))
        self.l1 = nn.Linear(48, 8)
        self.g = nn.Parameter(1 + 0.2 * torch.randn(8))
        self.s = nn.Parameter(torch.tensor(1.5))
        self.raw = nn.Parameter(0.5 * torch.randn(8))
        self.a, self.b = nn.Parameter(torch.randn(8, 5) / 3), nn.Parameter(torch.randn(5, 3) / 2)
        self.bias = nn.Parameter(0.1 * torch.randn(3))

    def forward(self, x):
        h = F.conv2d(x, self.conv_w, self.conv_b, padding=1).flatten(1)
        h = self.l1(h) * self.g * self.s  # elementwise gain, then a scalar one
        h = h * F.softplus(self.raw) / self.s  # a function of parameters alone; a quotient
        h = torch.where(self.raw > 0, h, -0.5 * h)  # a mask of parameters: it moves too
        return torch.einsum("ni,ij,jk->nk", h, self.a, self.b) + self.bias


def test_laftr_is_the_exact_fsd_on_a_linear_network_with_gains_convolutions_and_products():
    torch.manual_seed(2)
    model = Gains().to(DTYPE)
    x = torch.randn(30, 2, 4, 4, dtype=DTYPE)
    moved = _moved(model, 0.3)
    assert ((moved.raw > 0) != (model.raw > 0)).any()
    exact = fsd.ExactFSD().fit(model, x).distance(moved)
    value = fsd.LAFTR(coreset_size=None).fit(model, x).distance(moved)
    torch.testing.assert_close(value, exact, rtol=1e-9, atol=0)
    # and for the graph walk itself, a moved copy with a grad: ½ mean ‖z1 − z0‖²
    reference = {k: v.detach() for k, v in model.named_parameters()}
    z0, dz = linearized_outputs(moved, reference, x)
    with torch.no_grad():
        torch.testing.assert_close(z0, model(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(dz, moved(x) - model(x), rtol=1e-9, atol=1e-12)


class ConvForm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.head = nn.Linear(48, 3)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


class FConvForm(ConvForm):
    def forward(self, x):
        h = F.conv2d(x, self.conv.weight, self.conv.bias, padding=1)
        return F.linear(torch.relu(h).flatten(1), self.head.weight, self.head.bias)


@pytest.mark.parametrize("form", ["F.linear", "matmul", "conv"])
def test_a_relu_network_with_weights_read_in_forward_is_its_module_twin(form):
    # LAFTR, and BGLN-S with the same seed (the same gates, in the same order, get the same
    # draws): value and gradient
    if form == "conv":
        torch.manual_seed(0)
        model, other = ConvForm().to(DTYPE), FConvForm().to(DTYPE)
        other.load_state_dict(model.state_dict())
        x = torch.randn(40, 2, 4, 4, dtype=DTYPE)
        moved, moved_other = _moved(model, 0.3), FConvForm().to(DTYPE)
        moved_other.load_state_dict(moved.state_dict())
    else:
        model, other, moved, moved_other, x = _twins(FORMS[form], act=True)
    makes = [lambda: fsd.LAFTR(coreset_size=None),
             lambda: fsd.BGLN(inputs="coreset", coreset_size=None, num_samples=8, seed=3),
             lambda: fsd.BGLN(num_samples=16, seed=4)]
    for make in makes:
        twin, twin_grad = _value_and_grad(make().fit(model, x), moved)
        value, grad = _value_and_grad(make().fit(other, x), moved_other)
        torch.testing.assert_close(value, twin, rtol=1e-9, atol=0)
        for g, h in zip(grad, twin_grad, strict=True):
            torch.testing.assert_close(g, h, rtol=1e-9, atol=1e-12)


def test_weights_read_in_forward_lose_no_more_digits_than_nn_linear_near_the_reference():
    # float32, a move of 1e-4: Δz is formed as f(Δa, W1) + f(a0, ΔW), to float32's 1e-7 as
    # the module's; as the difference of two nearly equal outputs it is off by 2e-4
    model, _, _, _, x = _twins(FLinearForm, act=True)
    model, x = model.float(), x.float()
    moved, moved_other = _moved(model, 1e-4), FLinearForm(True)
    moved_other.load_state_dict(moved.state_dict())
    reference = {k: v.detach() for k, v in model.named_parameters()}
    with torch.no_grad():
        twin = linearized_outputs(moved, reference, x)[1]
        dz = linearized_outputs(moved_other, reference, x)[1]
    assert float((dz - twin).abs().max()) < 1e-5 * float(twin.abs().max())


def test_layer_norm_read_in_forward_is_the_module():
    class Module(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp, self.norm, self.out = nn.Linear(6, 8), nn.LayerNorm(8), nn.Linear(8, 3)

        def forward(self, x):
            return self.out(F.gelu(self.norm(self.inp(x))))

    class Functional(Module):
        def forward(self, x):
            h = F.layer_norm(self.inp(x), (8,), self.norm.weight, self.norm.bias)
            return self.out(F.gelu(h))

    torch.manual_seed(6)
    model, other = Module().to(DTYPE), Functional().to(DTYPE)
    other.load_state_dict(model.state_dict())
    x = torch.randn(20, 6, dtype=DTYPE)
    moved, moved_other = _moved(model, 0.3), Functional().to(DTYPE)
    moved_other.load_state_dict(moved.state_dict())
    torch.testing.assert_close(fsd.LAFTR(coreset_size=None).fit(other, x).distance(moved_other),
                               fsd.LAFTR(coreset_size=None).fit(model, x).distance(moved),
                               rtol=1e-9, atol=0)
