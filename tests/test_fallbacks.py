"""Models whose operations lack a derivative an estimator takes: the fallbacks, or one line at fit.

Forward mode is missing for ``weight_norm``'s kernel, oneDNN's LSTM and attention's fused fast
paths (taken in evaluation mode under ``torch.no_grad()``); ``vmap`` cannot batch a GRU. Each
estimator checks at ``fit`` that its derivatives work on the model and falls back (two vjps for
a JVP, a per-example loop for ``vmap``) or refuses in one line; ``distance`` never fails.
The values are checked against brute forces (reverse-mode Jacobians, float64).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev
from torch.nn.utils.parametrizations import spectral_norm, weight_norm

import fsd
from conftest import NotDifferentiable
from fsd.metrics import output_hessian_factors

DTYPE = torch.float64


class _Encoder(nn.Module):
    """A transformer classifier: ``nn.TransformerEncoderLayer`` alone or in an encoder."""

    def __init__(self, layers: int = 0):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.encoder = layer if layers == 0 else nn.TransformerEncoder(
            layer, layers, enable_nested_tensor=False)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.encoder(self.inp(x)).mean(1))


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 8)
        self.attention = nn.MultiheadAttention(8, 2, batch_first=True)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        h = self.inp(x)
        a, _ = self.attention(h, h, h)
        return self.out((h + a).mean(1))


class _Recurrent(nn.Module):
    def __init__(self, cell: type[nn.Module]):
        super().__init__()
        self.rnn = cell(3, 5, batch_first=True)
        self.out = nn.Linear(5, 3)

    def forward(self, x):
        return self.out(self.rnn(x)[0][:, -1])


def _normed(norm) -> nn.Module:
    return nn.Sequential(norm(nn.Linear(4, 6)), nn.Tanh(), norm(nn.Linear(6, 3)))


MODELS = {
    "transformer_encoder_layer": (lambda: _Encoder(0), (4, 3)),
    "transformer_encoder": (lambda: _Encoder(2), (4, 3)),
    "multihead_attention": (_Attention, (4, 3)),
    "weight_norm": (lambda: _normed(weight_norm), (4,)),
    "spectral_norm": (lambda: _normed(spectral_norm), (4,)),
    "gru": (lambda: _Recurrent(nn.GRU), (4, 3)),
    "lstm": (lambda: _Recurrent(nn.LSTM), (4, 3)),
}


def _setup(name: str, dtype: torch.dtype = DTYPE, n: int = 6):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model = make().to(dtype).eval()
    x = torch.randn(n, *shape, dtype=dtype)
    moved = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model, x, moved


def _jacobian(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """J (n, K, P) of the outputs in the parameters at the model's own, by reverse mode."""
    params = {k: v.detach() for k, v in model.named_parameters()}

    def f(p):
        return functional_call(model, p, (x,))

    jac = jacrev(f)(params)
    return torch.cat([jac[k].reshape(*jac[k].shape[:2], -1) for k in params], dim=2)


def _delta(model: nn.Module, moved: nn.Module) -> torch.Tensor:
    return torch.cat([(q - p).detach().reshape(-1) for p, q in zip(
        model.parameters(), moved.parameters(), strict=True)])


def _one_line(error: pytest.ExceptionInfo) -> str:
    text = str(error.value)
    assert "\n" not in text, text
    return text


# ----- NTK: the double-vjp trick where forward mode is missing ------------------------------

@pytest.mark.parametrize("name", ["transformer_encoder_layer", "transformer_encoder",
                                  "multihead_attention", "weight_norm", "spectral_norm", "gru",
                                  "lstm"])
def test_ntk_is_the_first_order_expansion_with_its_gradient(name):
    # before: NotImplementedError at distance ("Trying to use forward AD with
    # aten::_transformer_encoder_layer_fwd / _native_multi_head_attention /
    # _weight_norm_interface"); spectral_norm and the float64 RNNs passed already
    model, x, moved = _setup(name)
    est = fsd.NTK(coreset_size=None).fit(model, x)
    jac = _jacobian(model, x)
    dz = jac @ _delta(model, moved)
    expected = 0.5 * dz.pow(2).sum(1).mean()
    value = est.distance(moved)
    torch.testing.assert_close(value, expected, rtol=1e-9, atol=1e-14)
    grads = torch.autograd.grad(value, list(moved.parameters()))
    # d/dθ ½ mean ‖J Δθ‖² = mean Jᵀ J Δθ
    expected_grad = torch.einsum("nkp,nk->p", jac, dz) / x.shape[0]
    torch.testing.assert_close(torch.cat([g.reshape(-1) for g in grads]), expected_grad,
                               rtol=1e-8, atol=1e-13)


def test_ntk_on_a_float32_lstm_takes_two_vjps():
    # oneDNN's float32 LSTM kernel on CPU has no forward mode: before, NotImplementedError
    # "Trying to use forward AD with mkldnn_rnn_layer" at distance
    model, x, moved = _setup("lstm", torch.float32)
    est = fsd.NTK(coreset_size=None).fit(model, x)
    value = est.distance(moved)
    reference = fsd.NTK(coreset_size=None).fit(model.double(), x.double()).distance(
        moved.double())
    torch.testing.assert_close(value.double(), reference, rtol=1e-4, atol=1e-9)


# ----- under torch.no_grad() and torch.inference_mode() ------------------------------------

@pytest.mark.parametrize("name", ["transformer_encoder_layer", "transformer_encoder",
                                  "multihead_attention", "weight_norm"])
@pytest.mark.parametrize("make", [lambda: fsd.NTK(), lambda: fsd.LAFTR()],
                         ids=["NTK", "LAFTR"])
def test_distance_under_no_grad_and_inference_mode_is_the_value(name, make):
    # before: LAFTR raised NotImplementedError under torch.no_grad() on attention (the fast
    # path has no forward mode), NTK on all four
    model, x, moved = _setup(name)
    est = make().fit(model, x)
    value = est.distance(moved)
    assert value.requires_grad
    with torch.no_grad():
        quiet = est.distance(moved)
    with torch.inference_mode():
        inferred = est.distance(moved)
    assert not quiet.requires_grad and not inferred.requires_grad
    torch.testing.assert_close(quiet, value.detach(), rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(inferred.clone(), value.detach(), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name", ["transformer_encoder_layer", "multihead_attention"])
def test_bgln_s_on_attention_runs_in_every_grad_mode(name):
    # before: NotImplementedError at every distance (its probe of the units runs under
    # torch.no_grad(), where attention takes its fast path)
    model, x, moved = _setup(name)
    est = fsd.BGLN(num_samples=16).fit(model, x)
    value = est.distance(moved)
    value.backward()
    with torch.no_grad():
        quiet = est.distance(moved)
    assert torch.isfinite(value) and torch.isfinite(quiet) and float(quiet) > 0


# ----- one line at fit where no fallback works ---------------------------------------------

def test_ntk_refuses_at_fit_in_one_line_what_neither_mode_differentiates():
    # before: fit passed and every distance raised RuntimeError ("In order to use an
    # autograd.Function with functorch transforms ...")
    torch.manual_seed(0)
    with pytest.raises(ValueError) as error:
        fsd.NTK().fit(NotDifferentiable().double(), torch.randn(5, 4, dtype=DTYPE))
    assert _one_line(error).startswith("NTK cannot take Jacobian-vector products")
    assert str(error.value).endswith("use ExactFSD, EWC or KFAC on any model")


@pytest.mark.parametrize("make,name", [(lambda: fsd.LAFTR(), "LAFTR"),
                                       (lambda: fsd.BGLN(num_samples=4), "BGLN-S")])
def test_laftr_and_bgln_s_refuse_at_fit_a_graph_they_cannot_linearize(make, name):
    # before: fit passed and every distance raised RuntimeError from torch.func.jvp
    torch.manual_seed(0)
    with pytest.raises(ValueError) as error:
        make().fit(NotDifferentiable().double(), torch.randn(5, 4, dtype=DTYPE))
    assert _one_line(error).startswith(f"{name} cannot linearize this model's graph")
    assert str(error.value).endswith("use ExactFSD, EWC or KFAC on any model")


# ----- EWC: a per-example loop where vmap cannot batch the model ---------------------------

@pytest.mark.parametrize("metric", ["euclidean", "kl"])
def test_ewc_on_a_gru_is_the_diagonal_of_the_dense_gauss_newton(metric):
    # before: RuntimeError at fit ("output with shape [1, 5] doesn't match the broadcast
    # shape [...]") from vmap
    model, x, moved = _setup("gru")
    est = fsd.EWC(metric=metric, chunk_size=4).fit(model, [x[:4], x[4:]])
    jac = _jacobian(model, x)
    z0 = model(x).detach()
    hs = output_hessian_factors(metric, z0)  # (n, factors, K)
    projected = torch.einsum("nfk,nkp->nfp", hs, jac)
    expected = projected.pow(2).sum(1).mean(0)
    stored = torch.cat([est._stored[f"fisher.{k}"].reshape(-1)
                        for k, _ in model.named_parameters()])
    torch.testing.assert_close(stored, expected, rtol=1e-10, atol=1e-14)
    delta = _delta(model, moved)
    torch.testing.assert_close(est.distance(moved), 0.5 * (expected * delta ** 2).sum(),
                               rtol=1e-10, atol=1e-14)
