"""fsd.KFAC against dense Gauss-Newton matrices built from per-example Jacobians (float64)."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

import fsd
from fsd.metrics import output_hessian_factors

DTYPE = torch.float64


def _mlp(bias_last: bool = True) -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4), nn.Tanh(),
                         nn.Linear(4, 3, bias=bias_last)).to(DTYPE)


def _moved(model: nn.Module, scale: float = 0.2) -> nn.Module:
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


def _hessian(metric: str, z0: torch.Tensor) -> torch.Tensor:
    h = output_hessian_factors(metric, z0.unsqueeze(0))[0]
    return h.T @ h


def dense_gauss_newton(model: nn.Module, x: torch.Tensor, metric: str) -> torch.Tensor:
    """(1/N) Σ_i J_iᵀ H_i J_i over all parameters, in named_parameters order."""
    params = {k: v.detach() for k, v in model.named_parameters()}
    total = 0
    for xi in x:
        def f(p, xi=xi):
            return functional_call(model, p, (xi.unsqueeze(0),))[0]
        jac = jacrev(f)(params)
        j = torch.cat([jac[k].reshape(jac[k].shape[0], -1) for k in params], dim=1)
        total = total + j.T @ _hessian(metric, f(params).detach()) @ j
    return total / x.shape[0]


def _layer_indices(model: nn.Module) -> list[torch.Tensor]:
    """Per Linear or Conv2d: the flat indices of its weight and bias (one K-FAC block)."""
    offset, blocks = 0, []
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            size = sum(p.numel() for p in module.parameters())
            blocks.append(torch.arange(offset, offset + size))
            offset += size
    return blocks


def _patches_by_slicing(layer: nn.Conv2d, h: torch.Tensor) -> list[torch.Tensor]:
    """One (C·kh·kw) vector per output location, row-major, cut out of the padded input."""
    (kh, kw), (sh, sw), (dh, dw) = layer.kernel_size, layer.stride, layer.dilation
    ph, pw = ((dh * (kh - 1) // 2, dw * (kw - 1) // 2) if layer.padding == "same"
              else layer.padding)
    padded = nn.functional.pad(h, (pw, pw, ph, ph))
    rows = (padded.shape[1] - dh * (kh - 1) - 1) // sh + 1
    cols = (padded.shape[2] - dw * (kw - 1) - 1) // sw + 1
    return [padded[:, i * sh:i * sh + dh * (kh - 1) + 1:dh, j * sw:j * sw + dw * (kw - 1) + 1:dw]
            .reshape(-1) for i in range(rows) for j in range(cols)]


def brute_force_factors(model: nn.Sequential, x: torch.Tensor, metric: str):
    """A and G per Linear or Conv2d, one example, factor and output location at a time.

    Linear: A = mean ā āᵀ, G = mean Σ_k g_k g_kᵀ. Conv2d (KFC): A = mean Σ_t ā_t ā_tᵀ over
    its output locations t, G = mean (1/T) Σ_t Σ_k g_kt g_ktᵀ.
    """
    layers = [i for i, m in enumerate(model) if isinstance(m, (nn.Linear, nn.Conv2d))]
    factors = {}
    for i in layers:
        a_sum, g_sum = 0, 0
        for xi in x:
            h = xi.unsqueeze(0)
            for layer in model[:i]:
                h = layer(h)
            conv = isinstance(model[i], nn.Conv2d)
            inputs = _patches_by_slicing(model[i], h[0]) if conv else [h[0]]
            for a in inputs:
                a_bar = torch.cat([a, torch.ones(1, dtype=DTYPE)])
                a_sum = a_sum + torch.outer(a_bar, a_bar)
            s = model[i](h).detach().requires_grad_(True)
            z = s
            for layer in model[i + 1:]:
                z = layer(z)
            for hk in output_hessian_factors(metric, z.detach())[0]:
                (g,) = torch.autograd.grad((z[0] * hk).sum(), s, retain_graph=True)
                if conv:  # (C_out, H', W'): one vector per location, averaged over them
                    per_location = g[0].reshape(g.shape[1], -1).T
                    g_sum = g_sum + per_location.T @ per_location / per_location.shape[0]
                else:
                    g_sum = g_sum + torch.outer(g[0], g[0])
        factors[str(i)] = (a_sum / x.shape[0], g_sum / x.shape[0])
    return factors


def _cnn(same: bool = True) -> nn.Sequential:
    # stride, zero padding, dilation and padding="same": every way a patch is cut
    return nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=1), nn.ReLU(),
                         nn.Conv2d(3, 4, 2, dilation=2, bias=False), nn.Tanh(),
                         nn.Conv2d(4, 2, 3, padding="same" if same else 1), nn.ReLU(),
                         nn.Flatten(),
                         nn.Linear(2 * 2 * 2, 3)).to(DTYPE)


def _flat_delta(model: nn.Module, moved: nn.Module) -> torch.Tensor:
    return torch.cat([(q - p).reshape(-1) for p, q in zip(model.parameters(),
                                                          moved.parameters(), strict=True)])


@pytest.mark.parametrize("metric", ["euclidean", "kl", "softmax_euclidean"])
def test_factors_equal_per_example_brute_force(metric):
    torch.manual_seed(0)
    model = _mlp(bias_last=False)
    x = torch.randn(17, 3, dtype=DTYPE)
    est = fsd.KFAC(metric=metric).fit(model, [x[:10], x[10:]])
    for path, (a, g) in brute_force_factors(model, x, metric).items():
        torch.testing.assert_close(est._state[f"kfac.{path}.A"], a, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(est._state[f"kfac.{path}.G"], g, rtol=1e-10, atol=1e-13)


@pytest.mark.parametrize("metric", ["euclidean", "kl", "softmax_euclidean"])
def test_convolution_factors_equal_kfc_computed_patch_by_patch(metric):
    torch.manual_seed(10)
    model = _cnn()
    x = torch.randn(9, 2, 7, 7, dtype=DTYPE)
    est = fsd.KFAC(metric=metric).fit(model, [x[:4], x[4:]])
    for path, (a, g) in brute_force_factors(model, x, metric).items():
        torch.testing.assert_close(est._state[f"kfac.{path}.A"], a, rtol=1e-10, atol=1e-13)
        torch.testing.assert_close(est._state[f"kfac.{path}.G"], g, rtol=1e-10, atol=1e-13)


def test_penalty_of_a_cnn_is_the_kronecker_quadratic_formed_densely():
    torch.manual_seed(11)
    model = _cnn()
    x = torch.randn(6, 2, 7, 7, dtype=DTYPE)
    moved = _moved(model)
    expected = {}
    for path, (a, g) in brute_force_factors(model, x, "kl").items():
        layer, other = model[int(path)], moved[int(path)]
        dw = (other.weight - layer.weight).detach().reshape(layer.weight.shape[0], -1)
        db = ((other.bias - layer.bias).detach() if layer.bias is not None
              else torch.zeros(dw.shape[0], dtype=DTYPE))
        vec = torch.cat([dw, db.unsqueeze(1)], dim=1).T.reshape(-1)
        expected[path] = 0.5 * vec @ torch.kron(a, g) @ vec
    est = fsd.KFAC(metric="kl").fit(model, x)
    terms = est.layer_terms(moved)  # the distance split by layer, each its own quadratic
    assert terms.keys() == expected.keys()
    for path, value in terms.items():
        torch.testing.assert_close(value, expected[path], rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(est.distance(moved), sum(expected.values()), rtol=1e-10,
                               atol=1e-13)


def test_float32_convolution_factors_are_symmetric_and_load_back(tmp_path):
    # a float32 Gram over many patches is asymmetric at round-off, which fsd.load refused
    torch.manual_seed(13)
    model = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3),
                          nn.ReLU(), nn.Flatten(), nn.Linear(8 * 26 * 26, 2))
    x = torch.rand(256, 1, 28, 28)
    est = fsd.KFAC().fit(model, [x[i:i + 64] for i in range(0, 256, 64)])
    for key, value in est._state.items():
        if key.startswith("kfac."):
            assert torch.equal(value, value.T), key
    est.save(tmp_path / "k.fsd")
    fsd.load(tmp_path / "k.fsd")


@pytest.mark.parametrize("metric", ["euclidean", "kl"])
def test_penalty_is_the_kronecker_quadratic_formed_densely(metric):
    torch.manual_seed(1)
    model = _mlp()
    x = torch.randn(20, 3, dtype=DTYPE)
    moved = _moved(model)
    est = fsd.KFAC(metric=metric).fit(model, x)
    delta = _flat_delta(model, moved)
    expected = 0
    for path, (a, g) in brute_force_factors(model, x, metric).items():
        layer = model[int(path)]
        dw = (moved[int(path)].weight - layer.weight).detach()
        db = (moved[int(path)].bias - layer.bias).detach()
        w_bar = torch.cat([dw, db.unsqueeze(1)], dim=1)
        vec = w_bar.T.reshape(-1)  # column-major vec, as in (A ⊗ G) vec(W̄) = vec(G W̄ A)
        expected = expected + vec @ torch.kron(a, g) @ vec
    torch.testing.assert_close(est.distance(moved), 0.5 * expected, rtol=1e-10, atol=1e-13)
    assert float(delta.abs().sum()) > 0


def _one_location_cnn() -> nn.Sequential:
    # the first convolution covers its whole input (T = 1), which K-FAC factorizes exactly
    return nn.Sequential(nn.Conv2d(2, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4, 3)).to(DTYPE)


class _ResidualMLP(nn.Module):
    """x + relu(fc1(x)) into a head: KFAC runs the forward, so graphs are fine."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.head = nn.Linear(3, 3), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x + torch.relu(self.fc1(x)))


@pytest.mark.parametrize("metric", ["euclidean", "kl"])
@pytest.mark.parametrize("make,shape", [(_mlp, (3,)), (_one_location_cnn, (2, 3, 3)),
                                        (lambda: _ResidualMLP().to(DTYPE), (3,))])
def test_one_example_gives_the_block_diagonal_of_the_dense_gauss_newton(metric, make, shape):
    # with one example (and any number of factors) E[āāᵀ ⊗ ggᵀ] factorizes exactly
    torch.manual_seed(2)
    model = make()
    x = torch.randn(1, *shape, dtype=DTYPE)
    moved = _moved(model, 0.05)
    gn = dense_gauss_newton(model, x, metric)
    delta = _flat_delta(model, moved)
    expected = 0
    for idx in _layer_indices(model):
        expected = expected + delta[idx] @ gn[idx][:, idx] @ delta[idx]
    value = fsd.KFAC(metric=metric).fit(model, x).distance(moved)
    torch.testing.assert_close(value, 0.5 * expected, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("make,shape", [
    (lambda: nn.Sequential(nn.Linear(4, 3)), (40, 4)),
    (lambda: nn.Sequential(nn.Conv2d(2, 3, 3, stride=2, padding=2), nn.Flatten()), (30, 2, 6, 5)),
])
def test_one_layer_under_the_euclidean_metric_is_the_exact_fsd(make, shape):
    # Linear: G = I, so K-FAC is the full Gauss-Newton, which is the exact FSD of a linear
    # network. Conv2d read out directly: Σ_k g_kt g_kt'ᵀ = δ_tt' I, so KFC's factorisation is
    # the full Gauss-Newton too
    torch.manual_seed(3)
    model = make().to(DTYPE)
    x = torch.randn(*shape, dtype=DTYPE) * 2 + 1
    moved = _moved(model, 0.5)
    kfac = fsd.KFAC().fit(model, x).distance(moved)
    torch.testing.assert_close(kfac, fsd.ExactFSD().fit(model, x).distance(moved),
                               rtol=1e-10, atol=1e-13)
    gn = dense_gauss_newton(model, x, "euclidean")
    delta = _flat_delta(model, moved)
    torch.testing.assert_close(kfac, 0.5 * delta @ gn @ delta, rtol=1e-10, atol=1e-13)


def test_outputs_restrict_the_penalty_to_a_head():
    torch.manual_seed(4)
    model = _mlp()
    x = torch.randn(12, 3, dtype=DTYPE)
    moved = _moved(model)
    head = fsd.KFAC(metric="kl").fit(model, x, outputs=[0, 2])
    # brute force on a model whose last layer keeps only those rows
    sliced = copy.deepcopy(model)
    sliced[4] = nn.Linear(4, 2).to(DTYPE)
    with torch.no_grad():
        sliced[4].weight.copy_(model[4].weight[[0, 2]])
        sliced[4].bias.copy_(model[4].bias[[0, 2]])
    for path, (a, g) in brute_force_factors(sliced, x, "kl").items():
        torch.testing.assert_close(head._state[f"kfac.{path}.A"], a, rtol=1e-10, atol=1e-13)
        if path != "4":  # the full last layer's G has zero rows for the dropped outputs
            torch.testing.assert_close(head._state[f"kfac.{path}.G"], g, rtol=1e-10,
                                       atol=1e-13)
    assert float(head.distance(moved)) > 0


def test_gradient_flows_and_is_zero_at_the_reference():
    torch.manual_seed(5)
    model = _mlp()
    est = fsd.KFAC(metric="kl").fit(model, torch.randn(16, 3, dtype=DTYPE))
    value = est.distance(model)
    value.backward()
    assert float(value) == 0
    assert all(float(p.grad.abs().max()) == 0 for p in model.parameters())


def test_save_load_roundtrip_and_tampered_factors(tmp_path):
    torch.manual_seed(6)
    model = _mlp()
    moved = _moved(model)
    est = fsd.KFAC(metric="kl").fit(model, torch.randn(16, 3, dtype=DTYPE))
    est.save(tmp_path / "k.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "k.fsd").distance(moved), est.distance(moved))
    payload = torch.load(tmp_path / "k.fsd", weights_only=True)
    payload["tensors"]["kfac.2.G"] = -payload["tensors"]["kfac.2.G"]
    torch.save(payload, tmp_path / "bad.fsd")
    with pytest.raises(fsd.SummaryFormatError, match=r"'kfac\.2\.G'.*positive semi-definite"):
        fsd.load(tmp_path / "bad.fsd")


class _Twice(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(3, 3)

    def forward(self, x):
        return self.layer(torch.relu(self.layer(x)))


@pytest.mark.parametrize("make,shape,diagonal", [
    # before: each refused at fit ("KFAC needs a model whose parameters all belong to ...",
    # "groups=1", "padding_mode", "even kernel", "called once", "(batch, features) inputs")
    (lambda: nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3), nn.Linear(3, 2)), (3,),
     ["1.weight", "1.bias"]),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, groups=2), nn.Flatten()), (2, 5, 5),
     ["0.weight", "0.bias"]),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 3, padding=1, padding_mode="reflect"),
                           nn.Flatten()), (2, 4, 4), ["0.weight", "0.bias"]),
    (lambda: nn.Sequential(nn.Conv2d(2, 2, 2, padding="same"), nn.Flatten()), (2, 4, 4),
     ["0.weight", "0.bias"]),
    (_Twice, (3,), ["layer.weight", "layer.bias"]),
    (lambda: nn.Sequential(nn.Linear(3, 2), nn.Flatten()), (5, 3), ["0.weight", "0.bias"]),
])
def test_layers_kfac_cannot_factor_get_the_dense_gauss_newton_diagonal(make, shape, diagonal):
    torch.manual_seed(2)
    model = make().to(DTYPE)
    x = torch.randn(6, *shape, dtype=DTYPE)
    est = fsd.KFAC(metric="kl").fit(model, x)
    assert est.diagonal_parameters == diagonal
    dense = dense_gauss_newton(model, x, "kl").diagonal()
    offsets = _parameter_offsets(model)
    for name in diagonal:
        torch.testing.assert_close(est._stored[f"kfac_diag.{name}"].reshape(-1),
                                   dense[offsets[name]], rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("make,shape", [
    (lambda: nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 4)).to(DTYPE), (3,)),
    (lambda: _cnn(same=False), (2, 7, 7)),  # BackPACK cuts patches with numeric padding only
])
def test_factors_agree_with_backpack_kflr(make, shape):
    # an independent implementation: BackPACK's exact Kronecker factors (KFLR) of the
    # cross-entropy Gauss-Newton; BackPACK has no bias column in A, so compare A's weight
    # block. Its Conv2d G is Σ_k (Σ_t g_kt)(Σ_t g_kt)ᵀ (the bias block), not KFC's, so a
    # convolution's G is checked patch by patch above instead
    backpack = pytest.importorskip("backpack")
    from backpack.extensions import KFLR

    torch.manual_seed(7)
    model = make()
    x = torch.randn(20, *shape, dtype=DTYPE)
    est = fsd.KFAC(metric="kl").fit(model, x)
    extended = backpack.extend(copy.deepcopy(model))
    loss_fn = backpack.extend(nn.CrossEntropyLoss())
    with torch.no_grad():
        labels = extended(x).argmax(1)  # any labels: the GN does not depend on them
    with backpack.backpack(KFLR()):
        loss_fn(extended(x), labels).backward()
    for path, module in model.named_children():
        if not isinstance(module, (nn.Linear, nn.Conv2d)):
            continue
        g, a = extended.get_parameter(f"{path}.weight").kflr
        torch.testing.assert_close(est._state[f"kfac.{path}.A"][:-1, :-1], a, rtol=1e-10,
                                   atol=1e-14)
        if isinstance(module, nn.Linear):
            torch.testing.assert_close(est._state[f"kfac.{path}.G"], g, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("metric", ["euclidean", "kl"])
def test_gradient_and_hessian_are_the_dense_gauss_newton_on_one_example(metric):
    # one example: K-FAC is the block diagonal of the dense Gauss-Newton (test above), so the
    # penalty's gradient is that matrix times Δθ and its Hessian is that matrix; the backward
    # pass reuses the forward's product, and double backward must rebuild it with a graph
    torch.manual_seed(8)
    model = _mlp()
    x = torch.randn(1, 3, dtype=DTYPE)
    moved = _moved(model, 0.05)
    gn = dense_gauss_newton(model, x, metric)
    block = torch.zeros_like(gn)
    for idx in _layer_indices(model):
        block[idx.unsqueeze(1), idx] = gn[idx][:, idx]
    est = fsd.KFAC(metric=metric).fit(model, x)
    names = [k for k, _ in moved.named_parameters()]
    shapes = [p.shape for p in moved.parameters()]

    def penalty(flat: torch.Tensor) -> torch.Tensor:
        pieces = torch.split(flat, [s.numel() for s in shapes])
        params = {k: v.reshape(s) for k, v, s in zip(names, pieces, shapes, strict=True)}
        return est.distance(_Parametrized(moved, params))

    theta = torch.cat([p.detach().reshape(-1) for p in moved.parameters()]).requires_grad_()
    delta = _flat_delta(model, moved).detach()
    (grad,) = torch.autograd.grad(penalty(theta), theta, create_graph=True)
    torch.testing.assert_close(grad, block @ delta, rtol=1e-10, atol=1e-13)
    v = torch.randn_like(theta)
    (hvp,) = torch.autograd.grad(grad @ v, theta)
    torch.testing.assert_close(hvp, block @ v, rtol=1e-10, atol=1e-13)
    hessian = torch.func.hessian(penalty)(theta.detach())
    torch.testing.assert_close(hessian, block, rtol=1e-10, atol=1e-13)


class _Parametrized(nn.Module):
    """``model`` with its parameters replaced by ``params`` (tensors that carry a graph)."""

    def __init__(self, model: nn.Module, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.model, self.params = model, params

    def named_parameters(self, *args, **kwargs):  # what KFAC.distance reads
        return iter(self.params.items())


def test_kronecker_quadratic_derivatives_match_finite_differences_and_vmap():
    from fsd.estimators.kfac import _KroneckerQuadratic

    torch.manual_seed(9)
    b, c = torch.randn(4, 4, dtype=DTYPE), torch.randn(6, 6, dtype=DTYPE)
    g, a = (b @ b.T).requires_grad_(), (c @ c.T).requires_grad_()
    delta = torch.randn(4, 6, dtype=DTYPE, requires_grad=True)

    def value(d, gg, aa):
        return _KroneckerQuadratic.apply(d, gg, aa)[0]

    assert torch.autograd.gradcheck(value, (delta, g, a), check_forward_ad=True)
    assert torch.autograd.gradgradcheck(value, (delta, g, a))
    # torch.func: per-sample gradients over a batch of D share the factors
    deltas = torch.randn(5, 4, 6, dtype=DTYPE)
    batched = torch.func.vmap(torch.func.grad(value), in_dims=(0, None, None))(
        deltas, g.detach(), a.detach())
    torch.testing.assert_close(batched, 2 * g.detach() @ deltas @ a.detach(), rtol=1e-12,
                               atol=1e-12)


# ----- Conv1d and the diagonal Gauss–Newton blocks of every other parameter ----------------

def _parameter_offsets(model: nn.Module) -> dict[str, torch.Tensor]:
    """The flat indices of each parameter in ``dense_gauss_newton``'s order."""
    offset, out = 0, {}
    for name, p in model.named_parameters():
        out[name] = torch.arange(offset, offset + p.numel())
        offset += p.numel()
    return out


class _NormMLP(nn.Module):
    """LayerNorm between Linears, and a positional parameter added to the input."""

    def __init__(self):
        super().__init__()
        self.position = nn.Parameter(0.3 * torch.randn(4))
        self.inp = nn.Linear(4, 6)
        self.norm = nn.LayerNorm(6)
        self.out = nn.Linear(6, 3)

    def forward(self, x):
        return self.out(torch.tanh(self.norm(self.inp(x + self.position))))


class _Tokens(nn.Module):
    """An Embedding over token ids carried as floats (the ids index the table inside)."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(7, 4)
        self.position = nn.Parameter(0.3 * torch.randn(3, 4))
        self.conv = nn.Conv1d(4, 5, 2, padding=1)
        self.out = nn.Linear(5 * 4, 3)

    def forward(self, x):
        h = self.embed(x.long()) + self.position  # (n, 3, 4)
        return self.out(torch.relu(self.conv(h.transpose(1, 2))).flatten(1))


class _Recurrent(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)  # vmap cannot batch it: per-example loop
        self.out = nn.Linear(4, 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


_DIAGONAL_MODELS = [
    (_NormMLP, lambda n: torch.randn(n, 4, dtype=DTYPE),
     ["position", "norm.weight", "norm.bias"]),
    (_Tokens, lambda n: torch.randint(0, 7, (n, 3)).to(DTYPE),
     ["position", "embed.weight"]),
    (_Recurrent, lambda n: torch.randn(n, 3, 3, dtype=DTYPE),
     ["rnn.weight_ih_l0", "rnn.weight_hh_l0", "rnn.bias_ih_l0", "rnn.bias_hh_l0"]),
]


@pytest.mark.parametrize("make,inputs,diagonal", _DIAGONAL_MODELS)
@pytest.mark.parametrize("metric", ["euclidean", "kl"])
def test_diagonal_blocks_are_the_dense_gauss_newton_diagonal(make, inputs, diagonal, metric):
    # before: "KFAC needs a model whose parameters all belong to nn.Linear or nn.Conv2d"
    torch.manual_seed(4)
    model = make().to(DTYPE)
    x = inputs(9)
    est = fsd.KFAC(metric=metric).fit(model, [x[:5], x[5:]])  # two batches
    assert est.diagonal_parameters == diagonal
    dense = dense_gauss_newton(model, x, metric)
    offsets = _parameter_offsets(model)
    for name in diagonal:
        torch.testing.assert_close(est._stored[f"kfac_diag.{name}"].reshape(-1),
                                   dense.diagonal()[offsets[name]], rtol=1e-10, atol=1e-14)
    # the penalty: Kronecker terms as before, plus ½ Σ D Δp² per module of diagonal blocks
    moved = _moved(model, 0.1)
    delta = dict(zip(offsets, (q - p for p, q in zip(model.parameters(), moved.parameters(),
                                                    strict=True)), strict=True))
    terms = est.layer_terms(moved)
    for name in diagonal:
        path = name.rpartition(".")[0]
        expected = sum(0.5 * (dense.diagonal()[offsets[n]] * delta[n].reshape(-1) ** 2).sum()
                       for n in diagonal if n.rpartition(".")[0] == path)
        torch.testing.assert_close(terms[path], expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(est.distance(moved), sum(terms.values()))


def test_a_conv1d_has_the_kronecker_factors_of_the_same_conv2d_of_height_one():
    # before: "KFAC needs a model whose parameters all belong to nn.Linear or nn.Conv2d"
    torch.manual_seed(5)
    conv1d = nn.Sequential(nn.Conv1d(2, 3, 3, stride=2, padding=1), nn.ReLU(),
                           nn.Conv1d(3, 2, 2, dilation=2, padding=1),
                           nn.Flatten(), nn.Linear(2 * 4, 3)).to(DTYPE)
    conv2d = nn.Sequential(nn.Conv2d(2, 3, (1, 3), stride=(1, 2), padding=(0, 1)), nn.ReLU(),
                           nn.Conv2d(3, 2, (1, 2), dilation=(1, 2), padding=(0, 1)),
                           nn.Flatten(), nn.Linear(2 * 4, 3)).to(DTYPE)
    with torch.no_grad():
        for a, b in zip(conv1d.parameters(), conv2d.parameters(), strict=True):
            b.copy_(a.reshape(b.shape))
    x = torch.randn(7, 2, 7, dtype=DTYPE)
    assert conv1d(x).shape == conv2d(x.unsqueeze(2)).shape
    one = fsd.KFAC(metric="kl").fit(conv1d, x)
    two = fsd.KFAC(metric="kl").fit(conv2d, x.unsqueeze(2))
    assert one.diagonal_parameters == [] and one._meta["layers"] == two._meta["layers"]
    for key, value in two._stored.items():
        if key.startswith("kfac."):
            torch.testing.assert_close(one._stored[key], value, rtol=1e-12, atol=1e-15)


def test_one_conv1d_under_the_euclidean_metric_is_the_exact_fsd():
    torch.manual_seed(6)
    model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1), nn.Flatten()).to(DTYPE)
    x = torch.randn(11, 2, 5, dtype=DTYPE)
    moved = _moved(model)
    est = fsd.KFAC().fit(model, x)
    exact = 0.5 * (moved(x) - model(x)).pow(2).sum(1).mean()
    torch.testing.assert_close(est.distance(moved), exact, rtol=1e-10, atol=1e-14)


def test_summaries_of_kronecker_blocks_only_are_written_as_before(tmp_path):
    # no "diagonal" entry in the metadata and no diagonal field: files as older versions
    # wrote, besides the outputs on a few inputs that distance's check of the function reads
    est = fsd.KFAC().fit(_mlp(), torch.randn(8, 3, dtype=DTYPE))
    assert "diagonal" not in est._meta
    assert all(k.startswith(("theta0.", "kfac.", "probe.")) for k in est._stored)


def test_diagonal_blocks_save_load_and_refuse_tampering(tmp_path):
    torch.manual_seed(8)
    model = _NormMLP().to(DTYPE)
    est = fsd.KFAC().fit(model, torch.randn(8, 4, dtype=DTYPE))
    est.save(tmp_path / "k.fsd")
    moved = _moved(model)
    loaded = fsd.load(tmp_path / "k.fsd")
    assert loaded.diagonal_parameters == est.diagonal_parameters
    torch.testing.assert_close(loaded.distance(moved), est.distance(moved), rtol=0, atol=0)
    payload = torch.load(tmp_path / "k.fsd", weights_only=True)
    payload.pop("checksums")  # as a file written before checksums: the checks themselves
    for change, message in [
        (lambda p: p["tensors"].__setitem__("kfac_diag.norm.bias",
                                            -p["tensors"]["kfac_diag.norm.bias"]),
         r"kfac_diag\.norm\.bias"),
        (lambda p: p["tensors"].pop("kfac_diag.position"), r"kfac_diag\.position"),
        (lambda p: p.__setitem__("meta", json.dumps(
            {**json.loads(p["meta"]), "diagonal": ["norm.weight", "norm.bias"]})),
         r"cover the parameters"),
    ]:
        bad = copy.deepcopy(payload)
        change(bad)
        torch.save(bad, tmp_path / "bad.fsd")
        with pytest.raises(fsd.SummaryFormatError, match=message):
            fsd.load(tmp_path / "bad.fsd")


# ----- hook-based reparametrizations: weight_norm, spectral_norm, prune --------------------
# These delete a layer's registered ``weight`` (or ``bias``) and recompute a plain tensor
# attribute of that name in a forward pre-hook from the parameters that move. Before, KFAC
# factored such a layer all the same: fit and save succeeded, distance raised
# KeyError: '0.weight' and fsd.load refused the file ("cover the parameters ...").

def _hooked(kind: str) -> nn.Sequential:
    """A tiny float64 network whose first layers a hook or a parametrization reparametrizes."""
    from torch.nn.utils import prune, spectral_norm, weight_norm

    torch.manual_seed(11)
    if kind == "conv1d_weight_norm":
        model = nn.Sequential(nn.Conv1d(2, 3, 2), nn.Tanh(), nn.Flatten(),
                              nn.Linear(3 * 3, 3)).to(DTYPE)
        weight_norm(model[0])
        return model.eval()
    model = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 4), nn.Tanh(),
                          nn.Linear(4, 3)).to(DTYPE)
    if kind == "weight_norm":
        weight_norm(model[0])
        # dim=None: one g for the whole matrix
        weight_norm(model[2], dim=None)  # pyright: ignore[reportArgumentType]
    elif kind == "spectral_norm":
        spectral_norm(model[0])
        model.train()
        with torch.no_grad():  # converge the power iteration's u and v, as training would
            for _ in range(30):
                model(torch.randn(4, 3, dtype=DTYPE))
    elif kind == "parametrizations":  # torch.nn.utils.parametrize: worked before, kept
        torch.nn.utils.parametrizations.weight_norm(model[0])
        torch.nn.utils.parametrizations.spectral_norm(model[2])
    elif kind == "prune":
        prune.l1_unstructured(model[0], "weight", amount=0.5)
        prune.random_unstructured(model[2], "bias", amount=0.5)  # a hook computes the bias
    return model.eval()


def _hooked_inputs(kind: str, n: int) -> torch.Tensor:
    torch.manual_seed(12)
    shape = (2, 4) if kind == "conv1d_weight_norm" else (3,)
    return torch.randn(n, *shape, dtype=DTYPE)


def _moved_in_place_copy(kind: str, model: nn.Module, scale: float = 0.1) -> nn.Sequential:
    """A copy of ``model`` with every registered parameter moved (a hooked layer's plain
    ``weight`` attribute holds a graph after a forward, so ``copy.deepcopy`` is avoided)."""
    moved = _hooked(kind)
    moved.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(13)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return moved


_HOOKED = {
    # kind: (the Kronecker layers, the diagonal parameters)
    "weight_norm": (["4"], ["0.bias", "0.weight_g", "0.weight_v",
                            "2.bias", "2.weight_g", "2.weight_v"]),
    "spectral_norm": (["2", "4"], ["0.bias", "0.weight_orig"]),
    "prune": (["4"], ["0.bias", "0.weight_orig", "2.weight", "2.bias_orig"]),
    "conv1d_weight_norm": (["3"], ["0.bias", "0.weight_g", "0.weight_v"]),
    "parametrizations": (["4"], ["0.bias", "0.parametrizations.weight.original0",
                                 "0.parametrizations.weight.original1", "2.bias",
                                 "2.parametrizations.weight.original"]),
}


@pytest.mark.parametrize("metric", ["euclidean", "kl"])
@pytest.mark.parametrize("kind", list(_HOOKED))
def test_hook_reparametrized_layers_get_diagonal_blocks_of_their_parameters(kind, metric,
                                                                           tmp_path):
    model = _hooked(kind)
    x = _hooked_inputs(kind, 9)
    est = fsd.KFAC(metric=metric)
    est.fit(model, [x[:4], x[4:]])
    kronecker, diagonal = _HOOKED[kind]
    assert [path for path, _ in est._meta["layers"]] == kronecker
    assert est.diagonal_parameters == diagonal
    # the diagonal blocks: the dense Gauss-Newton diagonal from per-example Jacobians with
    # respect to the registered parameters, through the hook (float64)
    dense = dense_gauss_newton(model, x, metric)
    offsets = _parameter_offsets(model)
    for name in diagonal:
        torch.testing.assert_close(est._stored[f"kfac_diag.{name}"].reshape(-1),
                                   dense.diagonal()[offsets[name]], rtol=1e-10, atol=1e-14)
    # the ordinary layers' Kronecker factors: as on any model (one example and factor at a
    # time, through the hooked layers before them)
    if kind != "conv1d_weight_norm":
        factors = brute_force_factors(model, x, metric)
        for path in kronecker:
            a, g = factors[path]
            torch.testing.assert_close(est._stored[f"kfac.{path}.A"], a, rtol=1e-10, atol=1e-12)
            torch.testing.assert_close(est._stored[f"kfac.{path}.G"], g, rtol=1e-10, atol=1e-12)
    # distance: 0 at θ0, > 0 once the registered parameters moved, and each diagonal
    # module's term is ½ Σ D Δp² with the dense diagonal
    assert float(est.distance(model).detach()) == 0.0
    moved = _moved_in_place_copy(kind, model)
    d = est.distance(moved)
    assert torch.isfinite(d) and float(d) > 0
    current, reference = dict(moved.named_parameters()), dict(model.named_parameters())
    terms = est.layer_terms(moved)
    for path in {name.rpartition(".")[0] for name in diagonal} - set(kronecker):
        expected = sum(0.5 * (dense.diagonal()[offsets[n]]
                              * (current[n] - reference[n]).detach().reshape(-1) ** 2).sum()
                       for n in diagonal if n.rpartition(".")[0] == path)
        torch.testing.assert_close(terms[path], expected, rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(d, sum(terms.values()))
    # save -> fsd.load: the same distance
    est.save(tmp_path / "k.fsd")
    loaded = fsd.load(tmp_path / "k.fsd")
    assert isinstance(loaded, fsd.KFAC) and loaded.diagonal_parameters == diagonal
    torch.testing.assert_close(loaded.distance(moved), d, rtol=1e-12, atol=0)
    assert float(loaded.distance(model).detach()) == 0.0


def test_an_ordinary_linear_keeps_its_kronecker_block_beside_a_weight_normed_one():
    # the weight-normed layer's parameters get diagonal blocks; the ordinary Linear after it
    # keeps the very factors it has in the same network without the hook (the same function)
    from torch.nn.utils import weight_norm

    torch.manual_seed(14)
    plain = nn.Sequential(nn.Linear(3, 5), nn.Tanh(), nn.Linear(5, 3)).to(DTYPE)
    normed = copy.deepcopy(plain)
    weight_norm(normed[0])
    x = torch.randn(10, 3, dtype=DTYPE)
    torch.testing.assert_close(normed(x), plain(x), rtol=1e-12, atol=1e-14)
    one, two = fsd.KFAC(metric="kl"), fsd.KFAC(metric="kl")
    one.fit(plain, x)
    two.fit(normed, x)
    assert one._meta["layers"] == [["0", True], ["2", True]] and one.diagonal_parameters == []
    assert two._meta["layers"] == [["2", True]]
    assert two.diagonal_parameters == ["0.bias", "0.weight_g", "0.weight_v"]
    for factor in "AG":
        torch.testing.assert_close(two._stored[f"kfac.2.{factor}"], one._stored[f"kfac.2.{factor}"],
                                   rtol=1e-12, atol=1e-15)
    # the bias's diagonal block is the diagonal of G, the bias column of A ⊗ G (A's corner 1)
    torch.testing.assert_close(two._stored["kfac_diag.0.bias"], one._stored["kfac.0.G"].diagonal(),
                               rtol=1e-10, atol=1e-14)
    torch.testing.assert_close(one._stored["kfac.0.A"][-1, -1], torch.tensor(1.0, dtype=DTYPE))
    # moving only the ordinary layer: the same term, and only it
    with torch.no_grad():
        for p in (dict(plain.named_parameters())["2.weight"],
                  dict(normed.named_parameters())["2.weight"]):
            p.add_(0.1)
    terms = two.layer_terms(normed)
    torch.testing.assert_close(terms["2"], one.layer_terms(plain)["2"], rtol=1e-12, atol=0)
    assert float(terms["0"].detach()) == 0.0
    torch.testing.assert_close(two.distance(normed), one.distance(plain), rtol=1e-12, atol=0)


def test_a_regularizer_of_weight_normed_kfac_summaries_saves_and_loads(tmp_path):
    # before: ContinualRegularizer.load refused the file, losing every task's summary
    from torch.nn.utils import weight_norm

    torch.manual_seed(15)
    model = nn.Sequential(weight_norm(nn.Linear(3, 5)), nn.ReLU(), nn.Linear(5, 3)).to(DTYPE)
    reg = fsd.ContinualRegularizer(fsd.KFAC)
    reg.end_task(model, torch.randn(8, 3, dtype=DTYPE))
    with torch.no_grad():
        dict(model.named_parameters())["0.weight_v"].add_(0.05)
    reg.end_task(model, torch.randn(8, 3, dtype=DTYPE))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    penalty = reg.penalty(model)
    assert float(penalty) > 0
    reg.save(tmp_path / "reg.fsd")
    loaded = fsd.ContinualRegularizer.load(tmp_path / "reg.fsd")
    torch.testing.assert_close(loaded.penalty(model), penalty, rtol=1e-12, atol=0)


def test_a_summary_factoring_a_hook_computed_weight_is_refused_in_one_line(tmp_path):
    # the file the old KFAC wrote for a weight_norm model: a Kronecker block for '0' whose
    # weight is no parameter. It is refused, saying to refit
    from torch.nn.utils import weight_norm

    torch.manual_seed(16)
    model = nn.Sequential(weight_norm(nn.Linear(3, 5)), nn.ReLU(), nn.Linear(5, 3)).to(DTYPE)
    fsd.KFAC().fit(model, torch.randn(8, 3, dtype=DTYPE)).save(tmp_path / "k.fsd")
    payload = torch.load(tmp_path / "k.fsd", weights_only=True)
    payload.pop("checksums")
    meta = json.loads(payload["meta"])
    meta["layers"] = [["0", True], *meta["layers"]]
    meta["diagonal"] = ["0.weight_g", "0.weight_v"]
    payload["meta"] = json.dumps(meta)
    payload["tensors"].pop("kfac_diag.0.bias")
    payload["tensors"]["kfac.0.A"] = torch.eye(4, dtype=DTYPE)
    payload["tensors"]["kfac.0.G"] = torch.eye(5, dtype=DTYPE)
    torch.save(payload, tmp_path / "old.fsd")
    with pytest.raises(fsd.SummaryFormatError,
                       match=r"Kronecker block of '0' covers '0\.weight'.*refit"):
        fsd.load(tmp_path / "old.fsd")


@pytest.mark.parametrize("kind", list(_HOOKED))
def test_ewc_on_hook_reparametrized_layers_is_the_dense_gauss_newton_diagonal(kind, tmp_path):
    # EWC already measured the registered parameters (its Linear fast path steps aside for
    # any forward pre-hook); kept here beside KFAC's blocks, which must equal it
    model = _hooked(kind)
    x = _hooked_inputs(kind, 7)
    ewc, kfac = fsd.EWC(metric="kl"), fsd.KFAC(metric="kl")
    ewc.fit(model, x)
    kfac.fit(model, x)
    dense = dense_gauss_newton(model, x, "kl").diagonal()
    for name, offset in _parameter_offsets(model).items():
        torch.testing.assert_close(ewc._stored[f"fisher.{name}"].reshape(-1), dense[offset],
                                   rtol=1e-10, atol=1e-14)
    for name in kfac.diagonal_parameters:
        torch.testing.assert_close(kfac._stored[f"kfac_diag.{name}"],
                                   ewc._stored[f"fisher.{name}"], rtol=1e-10, atol=1e-14)
    moved = _moved_in_place_copy(kind, model)
    ewc.save(tmp_path / "e.fsd")
    torch.testing.assert_close(fsd.load(tmp_path / "e.fsd").distance(moved), ewc.distance(moved),
                               rtol=1e-12, atol=0)
