"""One rule per supported layer type, in one registry.

A rule says what kind of operation a module is and how to apply it functionally, with
parameters passed in (so the same module can be evaluated at θ0, at θ, or with ΔW):

- ``affine``: linear in its input and in its parameters jointly, y = op(x; W, b)
  (Linear, Conv2d). The interpreter needs op(x; W, b) and op(x; W, None).
- ``fixed``: a parameter-free linear map (Flatten, AvgPool2d, Dropout at evaluation,
  Identity); applied to reference activations and to differences alike.
- ``gate``: an elementwise piecewise-linear activation with slope 1 for s > 0 and α below
  (ReLU: α = 0; LeakyReLU: α = its ``negative_slope``), so φ(s) = g·s with the gate
  g = α + (1 − α)·u, u = 1{s > 0}. LAFTR uses the reference's own u = 1{s0 > 0}; BGLN draws
  u ~ Bernoulli(μ), μ the unit's firing frequency on the data, so the gate has mean
  α + (1 − α)μ and variance (1 − α)²μ(1 − μ) (:meth:`LayerRule.gate_moments`).
- ``maxpool``: MaxPool2d, linearized around the reference: the reference's argmax routes the
  differences too.

The walker in :mod:`fsd.interpreter` is generic; adding a layer type means registering a rule.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Mapping

import torch.nn.functional as F
from torch import Tensor, nn

RuleKind = Literal["affine", "fixed", "gate", "maxpool"]


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

    The callables receive a module of exactly the registered type, so they may use its own
    attributes (annotated ``Any``: the type checker cannot tie a rule to its type).
    """

    kind: RuleKind
    apply: Callable[..., Any]
    hyper: Callable[[Any], dict] = field(default=lambda m: {})
    flat_moments: Callable[[Any], bool] = field(default=lambda m: False)
    negative_slope: Callable[[Any], float] = field(default=lambda m: 0.0)

    def gate_values(self, module: nn.Module, on: Tensor) -> Tensor:
        """The gate α + (1 − α)·u of a ``gate`` rule, given u (1 above 0, 0 below, or a draw)."""
        slope = self.negative_slope(module)
        return on if slope == 0.0 else slope + (1.0 - slope) * on

    def gate_moments(self, module: nn.Module, firing: Tensor) -> tuple[Tensor, Tensor]:
        """Mean and variance of a ``gate`` rule's gate when u ~ Bernoulli(``firing``).

        ReLU: (μ, μ(1 − μ)); with slope α: (α + (1 − α)μ, (1 − α)²μ(1 − μ)). Independent
        units have E[g gᵀ] = mean meanᵀ + diag(variance), all that BGLN-D needs.
        """
        slope = self.negative_slope(module)
        variance = (1.0 - slope) ** 2 * firing * (1 - firing)
        return self.gate_values(module, firing), variance


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
            f"module {type(module).__name__} at '{where}' has no rule, so BGLN cannot walk "
            f"it (rules: {supported}); LAFTR linearizes it on the graph path, ExactFSD, NTK, "
            f"EWC and KFAC run the model's forward, or add a rule with fsd.register_rule"
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


register_rule(nn.Linear, LayerRule(
    kind="affine", apply=lambda m, x, w, b: F.linear(x, w, b), flat_moments=_always))
register_rule(nn.Conv2d, LayerRule(kind="affine", apply=_conv2d, hyper=_conv2d_hyper))
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
