"""One rule per supported layer type, in one registry.

A rule says what kind of operation a module is and how to apply it functionally, with
parameters passed in (so the same module can be evaluated at θ0, at θ, or with ΔW):

- ``affine``: linear in its input and in its parameters jointly, y = op(x; W, b)
  (Linear, Conv2d, BatchNorm in evaluation). The interpreter needs op(x; W, b) and
  op(x; W, None); the rule says where W and b come from (:meth:`LayerRule.affine_parameters`:
  a Linear's own weight and bias; BatchNorm's scale and shift from its weight, bias and
  running statistics) and, for BGLN-D's moments, W as a dense matrix.
- ``fixed``: a parameter-free linear map (Flatten, AvgPool2d, Dropout at evaluation,
  Identity); applied to reference activations and to differences alike.
- ``gate``: an elementwise piecewise-linear activation with slope 1 for s > 0 and α below
  (ReLU: α = 0; LeakyReLU: α = its ``negative_slope``), so φ(s) = g·s with the gate
  g = α + (1 − α)·u, u = 1{s > 0}. LAFTR uses the reference's own u = 1{s0 > 0}; BGLN draws
  u ~ Bernoulli(μ), μ the unit's firing frequency on the data, so the gate has mean
  α + (1 − α)μ and variance (1 − α)²μ(1 − μ) (:meth:`LayerRule.gate_moments`).
- ``gate`` with ``smooth=True``: any other elementwise activation φ (GELU, SiLU, Tanh,
  Sigmoid, ELU, Softplus). LAFTR uses a0 = φ(s0) and Δa = φ'(s0)·Δs. BGLN generalises the
  Bernoulli gate to a per-unit random pair (r, g): a0 = r·s0 + φ(0), Δa = g·Δs, where on the
  data r = (φ(s) − φ(0))/s is the secant through (0, φ(0)) and g = φ'(s) the slope. The fit
  stores their first and second moments E[r], E[g], E[r²], E[rg], E[g²] per unit; BGLN-D
  with exact moments needs nothing else, and BGLN-S draws (r, g) from the normal
  distribution with those moments. For a ReLU the pair is r = g = u ~ Bernoulli(μ), so
  the two forms agree (:class:`GateMoments`).
- ``maxpool``: MaxPool2d, linearized around the reference: the reference's argmax routes the
  differences too.

The walker in :mod:`fsd.interpreter` is generic; adding a layer type means registering a rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import jvp

RuleKind = Literal["affine", "fixed", "gate", "maxpool"]

SMOOTH_MOMENTS = 5
"""Moments a smooth gate stores per unit: E[r], E[g], E[r²], E[rg], E[g²] (last dimension)."""


@dataclass(frozen=True)
class GateMoments:
    """Per-unit moments of a gate layer's random gate pair (r, g) under BGLN.

    BGLN's activation is a0 = r·s0 + offset on the reference side and Δa = g·Δs on the
    difference side, with the pairs of different units independent of each other and of the
    inputs. Then E[(r⊙u)(g⊙v)ᵀ] = Q_rg ⊙ E[u vᵀ] with Q_rg = E[r]E[g]ᵀ + diag(Cov(r, g)),
    and likewise Q_rr, Q_gg: these moments are all that BGLN-D needs. A ReLU-family gate has
    r = g (all three variances equal).

    Attributes:
        reference_mean: E[r], (…, units).
        delta_mean: E[g].
        reference_variance: Var r.
        covariance: Cov(r, g).
        delta_variance: Var g.
        offset: φ(0), the same for every unit (0 for the ReLU family).
    """

    reference_mean: Tensor
    delta_mean: Tensor
    reference_variance: Tensor
    covariance: Tensor
    delta_variance: Tensor
    offset: float = 0.0

    def second_moments(self) -> tuple[Tensor, Tensor, Tensor]:
        """(Q_rr, Q_rg, Q_gg) = E[r rᵀ], E[r gᵀ], E[g gᵀ] over units, each (…, units, units)."""
        def outer(a: Tensor, b: Tensor, diagonal: Tensor) -> Tensor:
            return a.unsqueeze(-1) * b.unsqueeze(-2) + torch.diag_embed(diagonal)
        return (outer(self.reference_mean, self.reference_mean, self.reference_variance),
                outer(self.reference_mean, self.delta_mean, self.covariance),
                outer(self.delta_mean, self.delta_mean, self.delta_variance))


@dataclass(frozen=True)
class LayerRule:
    """How the interpreter treats one module type.

    Attributes:
        kind: one of ``affine``, ``fixed``, ``gate``, ``maxpool`` (module docstring).
        apply: ``affine``: ``apply(module, x, weight, bias)``; ``maxpool``:
            ``apply(module, x)`` returning ``(y, indices)``; otherwise ``apply(module, x)``.
        hyper: the module's hyper-parameters that change its function (part of the
            architecture signature that a fitted summary checks).
        flat_moments: whether BGLN-D's moment propagation (which works on flattened
            feature vectors) supports this particular module.
        negative_slope: ``gate`` rules: the slope α for s ≤ 0 (0 for ReLU).
        smooth: ``gate`` rules for an elementwise activation that is not piecewise linear
            through 0 (``apply(module, s)`` is φ; its slope comes from forward-mode
            differentiation of ``apply``); see the module docstring.
        parameters: ``affine`` rules whose W and b are not the module's ``weight`` and
            ``bias``: ``parameters(module, state, path) -> (W, b)`` from the model's
            parameters and buffers by name (``None``: :func:`weight_bias`).
        dense: ``affine`` rules whose W is not already the (out, in) matrix of a flat
            layer: W as that matrix, for BGLN-D's moment propagation.
        delta: ``affine`` rules whose (ΔW, Δb) between two states is better computed than
            as the difference of two ``parameters`` results (which loses digits in float32
            near θ0): ``delta(module, state0, state1, path) -> (ΔW, Δb)``.

    The callables receive a module of exactly the registered type, so they may use its own
    attributes (annotated ``Any``: the type checker cannot tie a rule to its type).
    """

    kind: RuleKind
    apply: Callable[..., Any]
    hyper: Callable[[Any], dict] = field(default=lambda m: {})
    flat_moments: Callable[[Any], bool] = field(default=lambda m: False)
    negative_slope: Callable[[Any], float] = field(default=lambda m: 0.0)
    smooth: bool = False
    parameters: Callable[[Any, Mapping[str, Tensor], str],
                         tuple[Tensor, Tensor | None]] | None = None
    dense: Callable[[Tensor], Tensor] = field(default=lambda weight: weight)
    delta: Callable[[Any, Mapping[str, Tensor], Mapping[str, Tensor], str],
                    tuple[Tensor, Tensor | None]] | None = None

    def affine_parameters(self, module: nn.Module, state: Mapping[str, Tensor], path: str
                          ) -> tuple[Tensor, Tensor | None]:
        """(W, b) of an ``affine`` rule's layer at ``path``, from parameters and buffers."""
        if self.parameters is None:
            return weight_bias(state, path)
        return self.parameters(module, state, path)

    def affine_delta(self, module: nn.Module, state0: Mapping[str, Tensor],
                     state1: Mapping[str, Tensor], path: str) -> tuple[Tensor, Tensor | None]:
        """(ΔW, Δb) of an ``affine`` rule's layer from state0 to state1, formed first.

        ``None`` for Δb when the layer has no bias.
        """
        if self.delta is not None:
            return self.delta(module, state0, state1, path)
        w0, b0 = self.affine_parameters(module, state0, path)
        w1, b1 = self.affine_parameters(module, state1, path)
        return w1 - w0, None if b0 is None or b1 is None else b1 - b0

    def affine_delta_matrix(self, module: nn.Module, state0: Mapping[str, Tensor],
                            state1: Mapping[str, Tensor], path: str
                            ) -> tuple[Tensor, Tensor | None]:
        """:meth:`affine_delta` with ΔW as a dense (…, out, in) matrix."""
        dw, db = self.affine_delta(module, state0, state1, path)
        return self.dense(dw), db

    def affine_matrix(self, module: nn.Module, state: Mapping[str, Tensor], path: str
                      ) -> tuple[Tensor, Tensor | None]:
        """(W as a dense (…, out, in) matrix, b): the layer's map on flat feature vectors."""
        weight, bias = self.affine_parameters(module, state, path)
        return self.dense(weight), bias

    def gate_values(self, module: nn.Module, on: Tensor) -> Tensor:
        """The gate α + (1 − α)·u of a ReLU-family rule, given u (1 above 0, 0 below, or a draw)."""
        slope = self.negative_slope(module)
        return on if slope == 0.0 else slope + (1.0 - slope) * on

    def gate_offset(self, module: nn.Module) -> float:
        """φ(0): what a smooth gate adds to r·s0 on the reference side (0 for the ReLU family)."""
        if not self.smooth:
            return 0.0
        return float(self.apply(module, torch.zeros((), dtype=torch.float64)))

    def slope(self, module: nn.Module, s: Tensor) -> Tensor:
        """φ'(s), elementwise: the gate LAFTR uses at the reference pre-activation s."""
        if not self.smooth:
            return self.gate_values(module, (s > 0).to(s.dtype))
        s = s.contiguous()  # forward-mode AD refuses expanded (overlapping) memory
        return jvp(lambda x: self.apply(module, x), (s,), (torch.ones_like(s),))[1]

    def reference_gates(self, module: nn.Module, s0: Tensor) -> tuple[Tensor, Tensor]:
        """(φ(s0), φ'(s0)): the reference activation and LAFTR's gate at ``s0``."""
        if not self.smooth:
            gate = self.slope(module, s0)
            return gate * s0, gate
        return self.apply(module, s0), self.slope(module, s0)

    def gate_pair(self, module: nn.Module, s: Tensor) -> tuple[Tensor, Tensor]:
        """(r, g) at pre-activations ``s``: the secant (φ(s) − φ(0))/s and the slope φ'(s).

        At s = 0 the secant is the slope. For the ReLU family both are the gate α + (1 − α)u.
        """
        g = self.slope(module, s)
        if not self.smooth:
            return g, g
        nonzero = s != 0
        secant = (self.apply(module, s) - self.gate_offset(module)) / torch.where(nonzero, s, 1)
        return torch.where(nonzero, secant, g), g

    def gate_statistics(self, module: nn.Module, s: Tensor) -> Tensor:
        """What the fit averages over examples, per example, in float64.

        ReLU family: u = 1{s > 0}, shape of ``s``. Smooth: [r, g, r², rg, g²]
        stacked on a new last dimension of size :data:`SMOOTH_MOMENTS`.
        """
        s = s.detach().to(torch.float64)
        if not self.smooth:
            return (s > 0).to(torch.float64)
        r, g = self.gate_pair(module, s)
        return torch.stack([r, g, r * r, r * g, g * g], dim=-1)

    def gate_moments(self, module: nn.Module, statistics: Tensor) -> GateMoments:
        """The moments of the gate pair from the stored averages of :meth:`gate_statistics`.

        ReLU family (``statistics`` = firing frequencies μ): u ~ Bernoulli(μ) and the gate
        α + (1 − α)u has mean α + (1 − α)μ and variance (1 − α)²μ(1 − μ); r = g.
        """
        if not self.smooth:
            slope = self.negative_slope(module)
            variance = (1.0 - slope) ** 2 * statistics * (1 - statistics)
            mean = self.gate_values(module, statistics)
            return GateMoments(mean, mean, variance, variance, variance)
        r, g, rr, rg, gg = statistics.unbind(-1)
        return GateMoments(r, g, rr - r * r, rg - r * g, gg - g * g, self.gate_offset(module))

    def sample_gates(self, module: nn.Module, statistics: Tensor, generator: torch.Generator
                     ) -> tuple[Tensor, Tensor]:
        """One draw of (r, g) per unit given the stored statistics (one row per example).

        ReLU family: u ~ Bernoulli(μ), r = g = α + (1 − α)u. Smooth: the bivariate normal
        with the stored means and covariance (any law with these moments has the same
        BGLN-D; the normal needs no more parameters).
        """
        if not self.smooth:
            gate = self.gate_values(module, torch.bernoulli(statistics, generator=generator))
            return gate, gate
        moments = self.gate_moments(module, statistics)
        noise = torch.randn((2, *moments.reference_mean.shape), generator=generator,
                            dtype=statistics.dtype, device=statistics.device)
        # Cholesky factor of [[Var r, Cov], [Cov, Var g]], clamped against round-off
        root = moments.reference_variance.clamp_min(0).sqrt()
        lower = torch.where(root > 0, moments.covariance / torch.where(root > 0, root, 1), 0)
        rest = (moments.delta_variance - lower * lower).clamp_min(0).sqrt()
        r = moments.reference_mean + root * noise[0]
        g = moments.delta_mean + lower * noise[0] + rest * noise[1]
        return r, g


RULES: dict[type, LayerRule] = {}


def register_rule(module_type: type, rule: LayerRule) -> None:
    """Register (or replace) the rule for exactly ``module_type`` (subclasses are not matched)."""
    RULES[module_type] = rule


class UnsupportedModuleError(TypeError):
    """A model contains a module that no rule covers."""


def rule_for(module: nn.Module, path: str) -> LayerRule:
    """The rule for ``module``; a clear error naming its class and path when there is none."""
    rule = RULES.get(type(module))
    if rule is None:
        where = path or "<root>"
        supported = ", ".join(sorted(t.__name__ for t in RULES)) + ", Sequential"
        raise UnsupportedModuleError(
            f"module {type(module).__name__} at '{where}' has no rule, so BGLN-D cannot walk "
            f"it (rules: {supported}); LAFTR and BGLN-S linearize it on the graph path, "
            f"ExactFSD, NTK, EWC and KFAC run the model's forward, or add a rule with "
            f"fsd.register_rule"
        )
    return rule


def weight_bias(params: Mapping[str, Tensor], path: str) -> tuple[Tensor, Tensor | None]:
    """The ``weight`` and ``bias`` (``None`` without one) of the affine layer at ``path``.

    Args:
        params: parameters by dotted name, as ``model.named_parameters()`` gives them.
        path: the layer's dotted path (``""`` for a model that is a single layer).
    """
    prefix = f"{path}." if path else ""
    return params[prefix + "weight"], params.get(prefix + "bias")


def _conv2d_hyper(m: nn.Conv2d) -> dict:
    if m.padding_mode != "zeros":
        raise UnsupportedModuleError(
            f"Conv2d with padding_mode={m.padding_mode!r} is not supported (only 'zeros')"
        )
    return {
        "stride": list(m.stride),
        "padding": m.padding if isinstance(m.padding, str) else list(m.padding),
        "dilation": list(m.dilation),
        "groups": m.groups,
    }


def _conv2d(m: nn.Conv2d, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    return F.conv2d(x, weight, bias, m.stride, m.padding, m.dilation, m.groups)


def _pool_hyper(m: nn.Module) -> dict:
    keys = ("kernel_size", "stride", "padding", "dilation", "ceil_mode", "count_include_pad",
            "divisor_override")
    return {k: getattr(m, k) for k in keys if hasattr(m, k)}


def _maxpool(m: nn.MaxPool2d, x: Tensor) -> tuple[Tensor, Tensor]:
    return F.max_pool2d(x, m.kernel_size, m.stride, m.padding, m.dilation, m.ceil_mode,
                        return_indices=True)


def _avgpool(m: nn.AvgPool2d, x: Tensor) -> Tensor:
    return F.avg_pool2d(x, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                        m.count_include_pad, m.divisor_override)


def _always(m: nn.Module) -> bool:
    return True


def _batch_norm_hyper(m: nn.modules.batchnorm._BatchNorm) -> dict:
    if m.running_mean is None or m.running_var is None:
        raise UnsupportedModuleError(
            f"{type(m).__name__} without running statistics (track_running_stats=False) "
            f"normalises by each batch's own statistics, which is not a fixed affine map; "
            f"LAFTR and BGLN need track_running_stats=True")
    return {"eps": m.eps, "affine": m.affine}


def _batch_norm_parameters(m: nn.modules.batchnorm._BatchNorm, state: Mapping[str, Tensor],
                           path: str) -> tuple[Tensor, Tensor]:
    """Scale γ/√(v + ε) and shift β − scale·m of a BatchNorm in evaluation.

    The running mean m and variance v are read from ``state`` like the parameters, so a
    network whose only change is its running statistics has moved.
    """
    prefix = f"{path}." if path else ""
    mean, variance = state[prefix + "running_mean"], state[prefix + "running_var"]
    scale = torch.rsqrt(variance + m.eps)
    if m.affine:
        scale = state[prefix + "weight"] * scale
    shift = -scale * mean
    if m.affine:
        shift = state[prefix + "bias"] + shift
    return scale, shift


def _batch_norm_delta(m: nn.modules.batchnorm._BatchNorm, state0: Mapping[str, Tensor],
                      state1: Mapping[str, Tensor], path: str) -> tuple[Tensor, Tensor]:
    """(Δscale, Δshift) of a BatchNorm, without subtracting two rescaled values.

    With r = 1/√(v + ε): r1 − r0 = −(v1 − v0)·r0·r1 / (√(v1 + ε) + √(v0 + ε)), then
    Δscale = Δγ·r1 + γ0·Δr and Δshift = Δβ − (Δscale·m0 + scale1·Δm).
    """
    prefix = f"{path}." if path else ""
    m0, v0 = state0[prefix + "running_mean"], state0[prefix + "running_var"]
    m1, v1 = state1[prefix + "running_mean"], state1[prefix + "running_var"]
    root0, root1 = torch.sqrt(v0 + m.eps), torch.sqrt(v1 + m.eps)
    r0, r1 = 1 / root0, 1 / root1
    dr = -(v1 - v0) * r0 * r1 / (root0 + root1)
    scale1, dscale = r1, dr
    if m.affine:
        g0, g1 = state0[prefix + "weight"], state1[prefix + "weight"]
        scale1, dscale = g1 * r1, (g1 - g0) * r1 + g0 * dr
    dshift = -(dscale * m0 + scale1 * (m1 - m0))
    if m.affine:
        dshift = (state1[prefix + "bias"] - state0[prefix + "bias"]) + dshift
    return dscale, dshift


def _batch_norm(m: nn.Module, x: Tensor, scale: Tensor, shift: Tensor | None) -> Tensor:
    # channels are dimension 1: (n, C) or (n, C, L) or (n, C, H, W)
    shape = (-1,) + (1,) * (x.dim() - 2)
    y = x * scale.reshape(shape)
    return y if shift is None else y + shift.reshape(shape)


register_rule(nn.Linear, LayerRule(
    kind="affine", apply=lambda m, x, w, b: F.linear(x, w, b), flat_moments=_always))
register_rule(nn.Conv2d, LayerRule(kind="affine", apply=_conv2d, hyper=_conv2d_hyper))
# BatchNorm is evaluated as in eval mode: an affine map per channel from the running statistics
# (training-mode batch statistics are not a fixed map of one input)
for _batch_norm_type in (nn.BatchNorm1d, nn.BatchNorm2d):
    register_rule(_batch_norm_type, LayerRule(
        kind="affine", apply=_batch_norm, hyper=_batch_norm_hyper,
        flat_moments=lambda m: isinstance(m, nn.BatchNorm1d),
        parameters=_batch_norm_parameters, dense=torch.diag_embed, delta=_batch_norm_delta))
register_rule(nn.ReLU, LayerRule(kind="gate", apply=lambda m, x: F.relu(x), flat_moments=_always))
register_rule(nn.LeakyReLU, LayerRule(
    kind="gate", apply=lambda m, x: F.leaky_relu(x, m.negative_slope),
    hyper=lambda m: {"negative_slope": m.negative_slope}, flat_moments=_always,
    negative_slope=lambda m: float(m.negative_slope)))
register_rule(nn.MaxPool2d, LayerRule(kind="maxpool", apply=_maxpool, hyper=_pool_hyper))
register_rule(nn.AvgPool2d, LayerRule(kind="fixed", apply=_avgpool, hyper=_pool_hyper))
register_rule(nn.Flatten, LayerRule(
    kind="fixed", apply=lambda m, x: x.flatten(m.start_dim, m.end_dim),
    hyper=lambda m: {"start_dim": m.start_dim, "end_dim": m.end_dim},
    flat_moments=lambda m: m.start_dim == 1 and m.end_dim == -1))
# Dropout is the identity at evaluation, which is where FSD is measured.
register_rule(nn.Dropout, LayerRule(kind="fixed", apply=lambda m, x: x, flat_moments=_always))
register_rule(nn.Identity, LayerRule(kind="fixed", apply=lambda m, x: x, flat_moments=_always))

# Smooth activations: elementwise, so flat moments hold; the hyper-parameters that change φ
# are part of the signature
for _smooth_type, _smooth_apply, _smooth_hyper in (
        (nn.GELU, lambda m, x: F.gelu(x, approximate=m.approximate),
         lambda m: {"approximate": m.approximate}),
        (nn.SiLU, lambda m, x: F.silu(x), lambda m: {}),
        (nn.Tanh, lambda m, x: torch.tanh(x), lambda m: {}),
        (nn.Sigmoid, lambda m, x: torch.sigmoid(x), lambda m: {}),
        (nn.ELU, lambda m, x: F.elu(x, m.alpha), lambda m: {"alpha": m.alpha}),
        (nn.Softplus, lambda m, x: F.softplus(x, m.beta, m.threshold),
         lambda m: {"beta": m.beta, "threshold": m.threshold})):
    register_rule(_smooth_type, LayerRule(kind="gate", apply=_smooth_apply, hyper=_smooth_hyper,
                                          flat_moments=_always, smooth=True))
