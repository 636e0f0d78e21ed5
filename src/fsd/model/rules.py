"""One rule per supported layer type, in one registry.

A rule is an instance of one class per operation type — :class:`AffineRule` (Linear, Conv2d,
BatchNorm in evaluation), :class:`FixedRule` (a parameter-free linear map), :class:`GateRule`
(the ReLU family), :class:`SmoothGateRule` (any other elementwise activation) and
:class:`MaxPoolRule` — that says how to apply the module functionally, with parameters passed
in (so the same module can be evaluated at θ0, at θ, or with ΔW), and carries what every
estimator family needs from that operation:

- the linearized pass of LAFTR and BGLN-S (:meth:`Rule.linearized`, one layer of
  :func:`fsd.model.linearize.propagate_linearized`);
- what a fit collects at the layer (:attr:`Rule.collects`, :meth:`Rule.fit_statistics`);
- its step of BGLN-D's moment propagation: the map that replaces its random gates by their
  expectations (:meth:`Rule.expected_reference`, :meth:`Rule.expected_delta`), a gate's
  moments (:meth:`GateRule.gate_moments`) and Algorithm 2's gating of means and covariances
  (:meth:`GateRule.reference_moments`); affine layers give their (W, b) as dense matrices
  (:meth:`AffineRule.affine_matrix`), which the walkers compose.

The walkers (:mod:`fsd.moments.algorithm2`, :mod:`fsd.moments.exact`,
:mod:`fsd.moments.algorithm2_conv`) are generic; adding a layer type means registering a rule
(:func:`register_rule`). Where a walk's structure depends on the operation type, a walker reads the
rule's :attr:`Rule.kind` (:func:`is_affine`, :func:`is_fixed`, :func:`is_gate`, :func:`is_pool`),
never its class.

The traced layer (:class:`TracedLayer`) and the gate callback (:data:`GateFn`) that rules
receive are defined here, in the module the walkers import (the old path ``fsd.interpreter``
still hands them on, with a warning, for one release).
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence, TypeGuard

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import jvp
from torch.nn.modules.utils import _pair

from ..covariance import gate as gate_covariance
from . import support

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
class TracedLayer:
    """A leaf module of the model with its dotted path and its rule."""

    path: str
    module: nn.Module
    rule: Rule


GateFn = Callable[[TracedLayer, Tensor], tuple[Tensor, Tensor]]
"""``gate(layer, s0) -> (a0, g)``: at the gate layer ``layer``, given the reference
pre-activation ``s0``, the reference activation a0 and the gate g that multiplies the
differences (Δa = g·Δs), both broadcastable to ``s0``.
"""


@dataclass(frozen=True)
class Rule(ABC):
    """How the estimators treat one module type: the operation it is and how to apply it.

    An abstract base: a rule is an instance of one of its subclasses, one per operation type
    (:class:`AffineRule`, :class:`FixedRule`, :class:`GateRule`, :class:`SmoothGateRule`,
    :class:`MaxPoolRule`), registered for a module type with :func:`register_rule`. The
    walkers call its methods without asking which operation it is; only where the structure
    of a walk depends on the operation type (runs of affine layers composed into one map,
    affine layers before gates) do they read its :attr:`kind`, which a subclass inherits.

    The callables receive a module of exactly the registered type, so they may use its own
    attributes (annotated ``Any``: the type checker cannot tie a rule to its type).

    Attributes:
        apply: the module's function with its parameters passed in; the arguments depend on
            the operation type (each subclass says).
        hyper: ``hyper(module) -> dict``: the module's hyper-parameters that change its
            function (part of the architecture signature that a fitted summary checks);
            none by default.
        flat_moments: ``flat_moments(module) -> bool``: whether BGLN-D's moment propagation
            on flattened feature vectors (the MLP path:
            :func:`fsd.moments.algorithm2.reference_moments`, :mod:`fsd.moments.exact`) supports
            this particular module; ``False`` by default, which sends BGLN-D to Algorithm 2 on layer
            outputs of any shape (:mod:`fsd.moments.algorithm2_conv`).
    """

    apply: Callable[..., Any]
    hyper: Callable[[Any], dict] = field(default=lambda m: {})
    flat_moments: Callable[[Any], bool] = field(default=lambda m: False)

    kind: ClassVar[str] = "other"
    """The operation type, which says what the rule promises the walkers that dispatch on it
    (:func:`is_affine`, :func:`is_fixed`, :func:`is_gate`, :func:`is_pool`):

    - ``"affine"`` (:class:`AffineRule`): ``apply(module, x, weight, bias)`` and
      :meth:`~AffineRule.affine_parameters`, :meth:`~AffineRule.affine_delta`,
      :meth:`~AffineRule.affine_matrix`, :meth:`~AffineRule.affine_delta_matrix`; the moment
      walkers compose consecutive affine layers into one map.
    - ``"fixed"`` (:class:`FixedRule`): ``apply(module, x)``, a parameter-free linear map
      applied to activations, differences, means and covariance factors alike; it may join a
      run of affine layers.
    - ``"gate"`` (:class:`GateRule`, :class:`SmoothGateRule`): an elementwise activation with
      the gate methods :meth:`~GateRule.reference_gates`, :meth:`~GateRule.gate_pair`,
      :meth:`~GateRule.gate_statistics`, :meth:`~GateRule.gate_moments`,
      :meth:`~GateRule.reference_moments`, :meth:`~GateRule.sample_gates` (and
      :attr:`~GateRule.smooth`: whether its statistics are a smooth gate's moments).
    - ``"pool"`` (:class:`MaxPoolRule`): ``apply(module, x) -> (y, indices)``, the routing of
      a max-pool (:attr:`collects` ``"routing"``).
    - ``"other"``: an operation of a user's own :class:`Rule` subclass, which promises only
      the methods of :class:`Rule`; the walkers that need a known kind refuse it or take
      their general path.
    """

    collects: ClassVar[str | None] = None
    """What a fit records at the layer's input, for BGLN: ``"gates"`` (the per-unit average of
    :meth:`fit_statistics`: a gate's statistics), ``"routing"`` (the same for a max-pool's
    routing, which BGLN-D needs on convolutional networks), ``"layer_moments"`` (the mean and
    covariance of the input, for ``BGLN(reference="layerwise")``, at every such layer after
    the first) or ``None`` (nothing)."""

    @abstractmethod
    def linearized(self, layer: TracedLayer, a0: Tensor, da: Tensor | None,
                   params0: Mapping[str, Tensor], params1: Mapping[str, Tensor] | None,
                   gate: GateFn) -> tuple[Tensor, Tensor | None]:
        """One layer of the linearized pass (LAFTR, and BGLN-S with sampled gates).

        The reference network θ0 runs as usual and the network θ is linearized around it;
        differences are propagated directly (paper eqs. 4–9), never as the difference of
        two nearly equal activations.

        Args:
            layer: the traced layer (its path, module and this rule).
            a0: the reference activation entering the layer.
            da: the difference Δa of the linearized network entering it; ``None`` while it
                is zero (before the first layer with parameters) or when only the reference
                runs.
            params0: reference parameters θ0 (and buffers) by name.
            params1: parameters θ (and buffers) of the other network by name, or ``None`` to
                run the reference only.
            gate: the reference activation and the gate at a gate layer
                (:data:`GateFn`); only gate rules call it.

        Returns:
            ``(a0, da)`` leaving the layer, ``da`` ``None`` as long as it is zero.
        """

    def fit_statistics(self, module: nn.Module, x: Tensor) -> Tensor:
        """Per example, what a fit averages at the layer's input ``x`` (float64).

        Defined where :attr:`collects` is ``"gates"`` or ``"routing"``; the fit keeps the
        average over examples (per mixture component).
        """
        raise NotImplementedError(f"{type(self).__name__} collects no statistics at fit")

    def expected_reference(self, layer: TracedLayer, x: Tensor,
                           statistics: Mapping[str, Tensor], offset: bool) -> Tensor:
        """The layer on the reference side of BGLN-D (paper Algorithm 2), away from affine runs.

        Algorithm 2 replaces every random gate by its expectation on the data, which makes
        the reference network's map from one affine run to the next a fixed map. This is
        that map on a batch of ``x`` (G, n, *shape): n vectors (means, or columns of a
        covariance factor) for each of G mixture components.

        Args:
            layer: the traced layer.
            x: (G, n, *shape).
            statistics: the stored statistics by layer path, (G, …) each.
            offset: add the map's constant part (for means; not for covariance factors).
        """
        raise NotImplementedError(f"{type(self).__name__} has no step of Algorithm 2 outside "
                                  f"affine runs")

    def expected_delta(self, layer: TracedLayer, x: Tensor,
                       statistics: Mapping[str, Tensor]) -> Tensor:
        """The layer on the difference side of Algorithm 2 (linear), on (G, n, *shape).

        As :meth:`expected_reference`, for the differences Δa: gates scale them by their
        mean slope. The walker also pulls rows back through it (vector-Jacobian products).
        """
        raise NotImplementedError(f"{type(self).__name__} has no step of Algorithm 2 outside "
                                  f"affine runs")


@dataclass(frozen=True)
class AffineRule(Rule):
    """An operation linear in its input and in its parameters jointly: y = op(x; W, b).

    Linear, Conv2d, BatchNorm in evaluation. ``apply(module, x, weight, bias)`` computes
    op(x; W, b); the walkers also call it with ``bias=None`` (op(x; W, None), the linear part)
    and with (ΔW, Δb) for the differences. The rule says where W and b come from
    (:meth:`affine_parameters`: a Linear's own weight and bias; BatchNorm's scale and shift
    from its weight, bias and running statistics) and, for BGLN-D's moments on flat feature
    vectors, W as a dense matrix (:meth:`affine_matrix`). Consecutive affine layers with no
    gate between them are composed into one map by the moment walkers.

    Attributes:
        parameters: for a layer whose W and b are not the module's ``weight`` and ``bias``:
            ``parameters(module, state, path) -> (W, b)`` from the model's parameters and
            buffers by name (``None``: :func:`weight_bias`).
        dense: for a layer whose W is not already the (out, in) matrix of a flat layer:
            ``dense(W)``, that matrix (with any leading dimensions kept), for BGLN-D's moment
            propagation; the identity by default.
        delta: for a layer whose (ΔW, Δb) between two states is better computed than as the
            difference of two ``parameters`` results (which loses digits in float32 near
            θ0): ``delta(module, state0, state1, path) -> (ΔW, Δb)``.
    """

    parameters: Callable[[Any, Mapping[str, Tensor], str],
                         tuple[Tensor, Tensor | None]] | None = None
    dense: Callable[[Tensor], Tensor] = field(default=lambda weight: weight)
    delta: Callable[[Any, Mapping[str, Tensor], Mapping[str, Tensor], str],
                    tuple[Tensor, Tensor | None]] | None = None

    kind: ClassVar[str] = "affine"
    collects: ClassVar[str | None] = "layer_moments"

    def linearized(self, layer: TracedLayer, a0: Tensor, da: Tensor | None,
                   params0: Mapping[str, Tensor], params1: Mapping[str, Tensor] | None,
                   gate: GateFn) -> tuple[Tensor, Tensor | None]:
        """s0 = op(a0; W0, b0) and Δs = op(a0; ΔW, Δb) + op(Δa; W1, None), ΔW formed first."""
        module = layer.module
        w0, b0 = self.affine_parameters(module, params0, layer.path)
        s0 = self.apply(module, a0, w0, b0)
        if params1 is None:
            return s0, da
        w1 = self.affine_parameters(module, params1, layer.path)[0]
        dw, db = self.affine_delta(module, params0, params1, layer.path)
        ds = self.apply(module, a0, dw, db)
        if da is not None:
            ds = ds + self.apply(module, da, w1, None)
        return s0, ds

    def affine_parameters(self, module: nn.Module, state: Mapping[str, Tensor], path: str
                          ) -> tuple[Tensor, Tensor | None]:
        """(W, b) of the layer at ``path``, from parameters and buffers by name."""
        if self.parameters is None:
            return weight_bias(state, path)
        return self.parameters(module, state, path)

    def affine_delta(self, module: nn.Module, state0: Mapping[str, Tensor],
                     state1: Mapping[str, Tensor], path: str) -> tuple[Tensor, Tensor | None]:
        """(ΔW, Δb) of the layer from state0 to state1, formed first.

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


@dataclass(frozen=True)
class FixedRule(Rule):
    """A parameter-free linear map: Flatten, AvgPool2d, Dropout at evaluation, Identity.

    ``apply(module, x)`` is the map; it is applied to reference activations and to
    differences alike (the linearized pass), and to means and covariance factors in
    BGLN-D. On the MLP path BGLN-D takes such a layer as the identity on flattened feature
    vectors, so ``flat_moments`` may be true only for a layer that is the identity there (a
    Flatten to (n, features), Dropout, Identity); for any other map, e.g. a scaling, leave it
    ``False``: BGLN-D then takes the path of :mod:`fsd.moments.algorithm2_conv`, which applies the
    map. ``fit`` refuses a rule that claims it for a map that is not the identity on a probe.

    Attributes:
        squared: ``squared(module, v)``: the map with every coefficient squared,
            Σ_i J_ji² v_i, which carries independent per-unit variances through the layer
            (the corrected recursion, :mod:`fsd.moments.corrected_conv`); ``None`` (the
            default) where it is not known, which that recursion refuses. For a selection
            (each output a copy of one input: Flatten, Dropout, Identity) it is ``apply``.
    """

    squared: Callable[[Any, Tensor], Tensor] | None = None

    kind: ClassVar[str] = "fixed"

    def linearized(self, layer: TracedLayer, a0: Tensor, da: Tensor | None,
                   params0: Mapping[str, Tensor], params1: Mapping[str, Tensor] | None,
                   gate: GateFn) -> tuple[Tensor, Tensor | None]:
        """The map applied to a0 and to Δa."""
        module = layer.module
        return self.apply(module, a0), None if da is None else self.apply(module, da)

    def expected_reference(self, layer: TracedLayer, x: Tensor,
                           statistics: Mapping[str, Tensor], offset: bool) -> Tensor:
        """The map itself (it has no constant part)."""
        return _batched(lambda v: self.apply(layer.module, v), x)

    def expected_delta(self, layer: TracedLayer, x: Tensor,
                       statistics: Mapping[str, Tensor]) -> Tensor:
        """The map itself."""
        return _batched(lambda v: self.apply(layer.module, v), x)


@dataclass(frozen=True)
class GateRule(Rule):
    """An elementwise piecewise-linear activation: slope 1 for s > 0 and α below (ReLU family).

    ReLU: α = 0; LeakyReLU: α = its ``negative_slope``. φ(s) = g·s with the gate
    g = α + (1 − α)·u, u = 1{s > 0}. LAFTR uses the reference's own u = 1{s0 > 0}; BGLN draws
    u ~ Bernoulli(μ), μ the unit's firing frequency on the data, so the gate has mean
    α + (1 − α)μ and variance (1 − α)²μ(1 − μ) (:meth:`gate_moments`). ``apply(module, s)``
    is φ. In BGLN's terms the gate is the pair r = g of :class:`GateMoments`.

    Attributes:
        negative_slope: ``negative_slope(module) -> float``: α (0 by default, a ReLU).
            Not used by :class:`SmoothGateRule`.
    """

    negative_slope: Callable[[Any], float] = field(default=lambda m: 0.0)

    kind: ClassVar[str] = "gate"
    collects: ClassVar[str | None] = "gates"
    smooth: ClassVar[bool] = False
    """Whether the gate is a smooth one (:class:`SmoothGateRule`): its stored statistics are
    the :data:`SMOOTH_MOMENTS` moments of (r, g) per unit, not firing frequencies."""

    def linearized(self, layer: TracedLayer, a0: Tensor, da: Tensor | None,
                   params0: Mapping[str, Tensor], params1: Mapping[str, Tensor] | None,
                   gate: GateFn) -> tuple[Tensor, Tensor | None]:
        """(a0, g) from ``gate`` at the pre-activation, and Δa = g·Δs."""
        a0, slope = gate(layer, a0)
        return a0, None if da is None else da * slope

    def fit_statistics(self, module: nn.Module, x: Tensor) -> Tensor:
        """:meth:`gate_statistics`."""
        return self.gate_statistics(module, x)

    def expected_reference(self, layer: TracedLayer, x: Tensor,
                           statistics: Mapping[str, Tensor], offset: bool) -> Tensor:
        """The input scaled by the mean gate E[r] per unit, plus φ(0) with ``offset``."""
        moments = self.gate_moments(layer.module, statistics[layer.path])
        return x * _per_group(moments.reference_mean, x) + (moments.offset if offset else 0.0)

    def expected_delta(self, layer: TracedLayer, x: Tensor,
                       statistics: Mapping[str, Tensor]) -> Tensor:
        """The input scaled by the mean slope E[g] per unit."""
        moments = self.gate_moments(layer.module, statistics[layer.path])
        return x * _per_group(moments.delta_mean, x)

    def reference_moments(self, module: nn.Module, statistics: Tensor, mean: Tensor,
                          cov: Tensor) -> tuple[Tensor, Tensor]:
        """Algorithm 2's gate on the reference side, on flat feature vectors.

        The mean is scaled by E[r] per unit (μ for a ReLU) and, for a smooth gate,
        a0 = r·s0 + φ(0) also shifts it; the covariance is gated by E[r]E[r]ᵀ (Algorithm 2
        drops the gates' own variance).

        Args:
            module: the activation.
            statistics: its stored statistics (:meth:`gate_statistics` averaged), (G, units…).
            mean: E[s0], (G, units).
            cov: Cov(s0), full (G, units, units): the one an affine layer's map gives.

        Returns:
            (E[a0], Cov(a0)).
        """
        moments = self.gate_moments(module, statistics)
        r = moments.reference_mean
        return mean * r + moments.offset, gate_covariance(cov, r)

    def gate_values(self, module: nn.Module, on: Tensor) -> Tensor:
        """The gate α + (1 − α)·u, given u (1 above 0, 0 below, or a draw)."""
        slope = self.negative_slope(module)
        return on if slope == 0.0 else slope + (1.0 - slope) * on

    def gate_offset(self, module: nn.Module) -> float:
        """φ(0): what a gate adds to r·s0 on the reference side (0 for the ReLU family)."""
        return 0.0

    def slope(self, module: nn.Module, s: Tensor) -> Tensor:
        """φ'(s), elementwise: the gate LAFTR uses at the reference pre-activation s."""
        return self.gate_values(module, (s > 0).to(s.dtype))

    def reference_gates(self, module: nn.Module, s0: Tensor) -> tuple[Tensor, Tensor]:
        """(φ(s0), φ'(s0)): the reference activation and LAFTR's gate at ``s0``."""
        gate = self.slope(module, s0)
        return gate * s0, gate

    def gate_pair(self, module: nn.Module, s: Tensor) -> tuple[Tensor, Tensor]:
        """(r, g) at pre-activations ``s``: the secant (φ(s) − φ(0))/s and the slope φ'(s).

        For the ReLU family both are the gate α + (1 − α)u.
        """
        g = self.slope(module, s)
        return g, g

    def gate_statistics(self, module: nn.Module, s: Tensor) -> Tensor:
        """What the fit averages over examples, per example, in float64.

        ReLU family: u = 1{s > 0}, shape of ``s``.
        """
        s = s.detach().to(torch.float64)
        return (s > 0).to(torch.float64)

    def gate_moments(self, module: nn.Module, statistics: Tensor) -> GateMoments:
        """The moments of the gate pair from the stored averages of :meth:`gate_statistics`.

        ReLU family (``statistics`` = firing frequencies μ): u ~ Bernoulli(μ) and the gate
        α + (1 − α)u has mean α + (1 − α)μ and variance (1 − α)²μ(1 − μ); r = g.
        """
        slope = self.negative_slope(module)
        variance = (1.0 - slope) ** 2 * statistics * (1 - statistics)
        mean = self.gate_values(module, statistics)
        return GateMoments(mean, mean, variance, variance, variance)

    def sample_gates(self, module: nn.Module, statistics: Tensor, generator: torch.Generator
                     ) -> tuple[Tensor, Tensor]:
        """One draw of (r, g) per unit given the stored statistics (one row per example).

        ReLU family: u ~ Bernoulli(μ), r = g = α + (1 − α)u.
        """
        gate = self.gate_values(module, torch.bernoulli(statistics, generator=generator))
        return gate, gate


@dataclass(frozen=True)
class SmoothGateRule(GateRule):
    """Any other elementwise activation φ: GELU, SiLU, Tanh, Sigmoid, ELU, Softplus.

    ``apply(module, s)`` is φ; its slope comes from forward-mode differentiation of ``apply``.
    LAFTR uses a0 = φ(s0) and Δa = φ'(s0)·Δs. BGLN generalises the Bernoulli gate to a
    per-unit random pair (r, g): a0 = r·s0 + φ(0), Δa = g·Δs, where on the data
    r = (φ(s) − φ(0))/s is the secant through (0, φ(0)) and g = φ'(s) the slope. The fit
    stores their first and second moments E[r], E[g], E[r²], E[rg], E[g²] per unit; BGLN-D
    with exact moments needs nothing else, and BGLN-S draws (r, g) from the normal
    distribution with those moments. For a ReLU the pair is r = g = u ~ Bernoulli(μ), so the
    two forms agree (:class:`GateMoments`). ``negative_slope`` is not used. Its
    :attr:`~Rule.kind` is ``"gate"``, with :attr:`~GateRule.smooth` true.
    """

    smooth: ClassVar[bool] = True

    def gate_offset(self, module: nn.Module) -> float:
        """φ(0)."""
        return float(self.apply(module, torch.zeros((), dtype=torch.float64)))

    def slope(self, module: nn.Module, s: Tensor) -> Tensor:
        """φ'(s) by forward-mode differentiation of ``apply``."""
        s = s.contiguous()  # forward-mode AD refuses expanded (overlapping) memory
        return jvp(lambda x: self.apply(module, x), (s,), (torch.ones_like(s),))[1]

    def reference_gates(self, module: nn.Module, s0: Tensor) -> tuple[Tensor, Tensor]:
        """(φ(s0), φ'(s0))."""
        return self.apply(module, s0), self.slope(module, s0)

    def gate_pair(self, module: nn.Module, s: Tensor) -> tuple[Tensor, Tensor]:
        """(r, g): the secant (φ(s) − φ(0))/s and the slope φ'(s).

        At s = 0 the secant is the slope.
        """
        g = self.slope(module, s)
        nonzero = s != 0
        secant = (self.apply(module, s) - self.gate_offset(module)) / torch.where(nonzero, s, 1)
        return torch.where(nonzero, secant, g), g

    def gate_statistics(self, module: nn.Module, s: Tensor) -> Tensor:
        """[r, g, r², rg, g²] per example, in float64.

        Stacked on a new last dimension of size :data:`SMOOTH_MOMENTS`.
        """
        s = s.detach().to(torch.float64)
        r, g = self.gate_pair(module, s)
        return torch.stack([r, g, r * r, r * g, g * g], dim=-1)

    def gate_moments(self, module: nn.Module, statistics: Tensor) -> GateMoments:
        """Means, variances and covariance of (r, g) from the averaged [r, g, r², rg, g²]."""
        r, g, rr, rg, gg = statistics.unbind(-1)
        return GateMoments(r, g, rr - r * r, rg - r * g, gg - g * g, self.gate_offset(module))

    def sample_gates(self, module: nn.Module, statistics: Tensor, generator: torch.Generator
                     ) -> tuple[Tensor, Tensor]:
        """One draw of (r, g) per unit from the bivariate normal with the stored moments.

        Any law with these moments has the same BGLN-D; the normal needs no more parameters.
        """
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


@dataclass(frozen=True)
class MaxPoolRule(Rule):
    """MaxPool2d, linearized around the reference: the reference's argmax routes differences too.

    ``apply(module, x)`` returns ``(y, indices)`` as ``max_pool2d(..., return_indices=True)``.
    BGLN-D treats a max-pool as Algorithm 2 treats a gate: its routing is replaced by its
    expectation, each window taking each of its positions with the frequency that position
    was the window's argmax on the data (:func:`routing_statistics`, stored at fit).
    """

    kind: ClassVar[str] = "pool"
    collects: ClassVar[str | None] = "routing"

    def linearized(self, layer: TracedLayer, a0: Tensor, da: Tensor | None,
                   params0: Mapping[str, Tensor], params1: Mapping[str, Tensor] | None,
                   gate: GateFn) -> tuple[Tensor, Tensor | None]:
        """The pooled a0, and Δa gathered at the reference's argmax (linearization of max)."""
        a0, indices = self.apply(layer.module, a0)
        if da is not None:
            da = da.flatten(2).gather(2, indices.flatten(2)).view_as(a0)
        return a0, da

    def fit_statistics(self, module: nn.Module, x: Tensor) -> Tensor:
        """:func:`routing_statistics`, then :func:`fired_routing_statistics`, on the last axis.

        One record (n, C, H', W', 2·k·k) so that both are averaged alike; the collector
        splits them (:attr:`fsd.statistics.collector.Statistics.fired_routing`).
        """
        routing = routing_statistics(module, x)  # type: ignore[arg-type]
        fired = routing * _pooled_positive(module, x)  # type: ignore[arg-type]
        return torch.cat([routing, fired], -1)

    def expected_reference(self, layer: TracedLayer, x: Tensor,
                           statistics: Mapping[str, Tensor], offset: bool) -> Tensor:
        """:func:`expected_routing` with the stored routing frequencies."""
        return expected_routing(layer.module, x, statistics[layer.path].to(x.dtype))  # type: ignore[arg-type]

    def expected_delta(self, layer: TracedLayer, x: Tensor,
                       statistics: Mapping[str, Tensor]) -> Tensor:
        """:func:`expected_routing` with the stored routing frequencies."""
        return expected_routing(layer.module, x, statistics[layer.path].to(x.dtype))  # type: ignore[arg-type]


def is_affine(rule: Rule | None) -> TypeGuard[AffineRule]:
    """Whether ``rule`` is of kind ``"affine"`` (``None``, a module without a rule: no)."""
    return rule is not None and rule.kind == "affine"


def is_fixed(rule: Rule | None) -> TypeGuard[FixedRule]:
    """Whether ``rule`` is of kind ``"fixed"``: a parameter-free linear map."""
    return rule is not None and rule.kind == "fixed"


def is_gate(rule: Rule | None) -> TypeGuard[GateRule]:
    """Whether ``rule`` is of kind ``"gate"``, smooth or not (:attr:`GateRule.smooth`)."""
    return rule is not None and rule.kind == "gate"


def is_pool(rule: Rule | None) -> TypeGuard[MaxPoolRule]:
    """Whether ``rule`` is of kind ``"pool"``: a max-pool's routing."""
    return rule is not None and rule.kind == "pool"


def _batched(fn: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """A layer function ``fn`` of a batch applied to x (G, n, *shape), (G, n) restored."""
    y = fn(x.reshape(x.shape[0] * x.shape[1], *x.shape[2:]))
    return y.view(*x.shape[:2], *y.shape[1:])


def _per_group(statistic: Tensor, x: Tensor) -> Tensor:
    """A per-component (G, *units) statistic broadcast against x (G, n, *units)."""
    return statistic.unsqueeze(1).to(x.dtype)


# ----- max-pool routing ----------------------------------------------------------------------
def _pool_geometry(module: nn.MaxPool2d) -> tuple[tuple[int, int], ...]:
    kernel, stride = _pair(module.kernel_size), _pair(module.stride or module.kernel_size)
    return kernel, stride, _pair(module.padding), _pair(module.dilation)


def routing_statistics(module: nn.MaxPool2d, x: Tensor) -> Tensor:
    """Per example, which position of each window is its argmax: one-hot (n, C, H', W', k·k).

    Taken from ``max_pool2d``'s own indices, so ties resolve as the pooling itself does.
    """
    kernel, stride, padding, dilation = _pool_geometry(module)
    _, index = F.max_pool2d(x.detach(), kernel, stride, padding, dilation, module.ceil_mode,
                            return_indices=True)
    width = x.shape[-1]
    row, column = index // width, index % width
    out_h, out_w = index.shape[-2:]
    top = torch.arange(out_h, device=x.device) * stride[0] - padding[0]
    left = torch.arange(out_w, device=x.device) * stride[1] - padding[1]
    offset = ((row - top[:, None]) // dilation[0]) * kernel[1] + (column - left) // dilation[1]
    return F.one_hot(offset, kernel[0] * kernel[1]).to(torch.float64)


def _pooled_positive(module: nn.MaxPool2d, x: Tensor) -> Tensor:
    """Per example and window, whether the pooled value is positive: (n, C, H', W', 1)."""
    kernel, stride, padding, dilation = _pool_geometry(module)
    pooled = F.max_pool2d(x.detach(), kernel, stride, padding, dilation, module.ceil_mode)
    return (pooled > 0).to(torch.float64).unsqueeze(-1)


def fired_routing_statistics(module: nn.MaxPool2d, x: Tensor) -> Tensor:
    """Per example, the argmax's one-hot where the pooled value is positive, else zeros.

    Averaged over data: P(position p is the window's argmax and the maximum is > 0), which
    sums over a window to its firing frequency, not to 1. After a ReLU, ``max(relu(s)) =
    relu(max(s))``: the pair is one draw per window — position p with this probability, no
    position (output 0) otherwise — instead of an independent gate per unit and then a
    routing (``BGLNVariant(pool_routing="fired")``).
    """
    return routing_statistics(module, x) * _pooled_positive(module, x)


def fired_pairs(layers: Sequence[TracedLayer]) -> list[tuple[str, str]]:
    """(ReLU path, MaxPool2d path) of every ``nn.ReLU`` directly followed by a max-pool.

    The pairs whose gate and routing ``BGLNVariant(pool_routing="fired")`` replaces by one
    draw per window (:func:`fired_routing_statistics`): only a plain ReLU, whose output is
    exactly 0 where it is off, commutes with the max that way.
    """
    return [(first.path, second.path) for first, second in itertools.pairwise(layers)
            if type(first.module) is nn.ReLU and is_pool(second.rule)]


def expected_routing(module: nn.MaxPool2d, x: Tensor, frequencies: Tensor) -> Tensor:
    """The max-pool with each window's routing replaced by its expectation (linear in x).

    Args:
        module: the MaxPool2d.
        x: (G, n, C, H, W), G mixture components.
        frequencies: (G, C, H', W', k·k) routing frequencies (each window's sum to 1).

    Returns:
        (G, n, C, H', W'): Σ_t π[…, t] · x[window position t].
    """
    kernel, stride, padding, dilation = _pool_geometry(module)
    groups, n, channels = x.shape[:3]
    windows = F.unfold(x.reshape(groups * n, *x.shape[2:]), kernel, dilation, padding, stride)
    out_h, out_w = frequencies.shape[2:4]
    windows = windows.view(groups, n, channels, kernel[0] * kernel[1], out_h, out_w)
    weights = frequencies.permute(0, 1, 4, 2, 3).unsqueeze(1)  # (G, 1, C, k·k, H', W')
    return (windows * weights).sum(3)


RULES: dict[type, Rule] = {}
"""The rule of every supported module type (exact types: subclasses are not matched)."""


def register_rule(module_type: type, rule: Rule) -> None:
    """Register (or replace) the rule for exactly ``module_type`` (subclasses are not matched).

    Args:
        module_type: the module class.
        rule: an instance of the :class:`Rule` subclass for its operation type.
    """
    if not isinstance(rule, Rule):
        raise TypeError(f"a rule is an instance of a subclass of fsd.Rule (AffineRule, "
                        f"FixedRule, GateRule, SmoothGateRule, MaxPoolRule), got "
                        f"{type(rule).__name__}")
    RULES[module_type] = rule


class UnsupportedModuleError(TypeError):
    """A model contains a module that no rule covers."""


def rule_for(module: nn.Module, path: str) -> Rule:
    """The rule for ``module``; a clear error naming its class and path when there is none."""
    rule = RULES.get(type(module))
    if rule is None:
        where = path or "<root>"
        # the layers a user writes: not Cast, which plans make of x.float()
        supported = ", ".join(sorted(t.__name__ for t in RULES if t is not Cast)) + ", Sequential"
        raise UnsupportedModuleError(
            f"module {type(module).__name__} at '{where}' has no rule, so BGLN-D cannot walk "
            f"it (rules: {supported}); add a rule with fsd.register_rule, or "
            f"{support.advice(support.BGLN_D, support.Feature.NO_RULE)}")
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
    hyper = {
        "stride": list(m.stride),
        "padding": m.padding if isinstance(m.padding, str) else list(m.padding),
        "dilation": list(m.dilation),
        "groups": m.groups,
    }
    if m.padding_mode != "zeros":  # absent for zeros: summaries written before keep loading
        hyper["padding_mode"] = m.padding_mode
    return hyper


def _conv2d(m: nn.Conv2d, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    if m.padding_mode != "zeros":
        # as nn.Conv2d pads: reflect/replicate/circular are linear maps of x, so the
        # linearized passes and Algorithm 2 stay exact; the corrected recursion refuses them
        x = F.pad(x, m._reversed_padding_repeated_twice, mode=m.padding_mode)
        return F.conv2d(x, weight, bias, m.stride, 0, m.dilation, m.groups)
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


def _avgpool_squared(m: nn.AvgPool2d, x: Tensor) -> Tensor:
    """Σ_i J_ji² x_i of an average pool.

    Every weight of window j is the same c_j, so it is c_j times the window's sum, with
    c_j = pool(1)_j / (the number of inputs in window j).
    """
    def summed(v: Tensor) -> Tensor:
        return F.avg_pool2d(v, m.kernel_size, m.stride, m.padding, m.ceil_mode,
                            count_include_pad=False, divisor_override=1)
    ones = torch.ones_like(x[:1])
    weight = _avgpool(m, ones) / summed(ones)
    return summed(x) * weight.pow(2)


def _flatten(m: nn.Flatten, x: Tensor) -> Tensor:
    return x.flatten(m.start_dim, m.end_dim)


def _identity(m: nn.Module, x: Tensor) -> Tensor:
    return x


def _always(m: nn.Module) -> bool:
    return True


def check_running_statistics(model: nn.Module) -> None:
    """Refuse a BatchNorm without running statistics: it is no function of one input."""
    for path, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and (
                m.running_mean is None or m.running_var is None):
            where = f" at '{path}'" if path else ""
            raise UnsupportedModuleError(
                f"{type(m).__name__}{where} without running statistics "
                f"(track_running_stats=False) normalises by each batch's own statistics, "
                f"which is not a fixed affine map; LAFTR and BGLN need "
                f"track_running_stats=True (ExactFSD, EWC and KFAC take it)")


def _batch_norm_hyper(m: nn.modules.batchnorm._BatchNorm) -> dict:
    check_running_statistics(m)
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


register_rule(nn.Linear, AffineRule(
    apply=lambda m, x, w, b: F.linear(x, w, b), flat_moments=_always))
register_rule(nn.Conv2d, AffineRule(apply=_conv2d, hyper=_conv2d_hyper))
# BatchNorm is evaluated as in eval mode: an affine map per channel from the running statistics
# (training-mode batch statistics are not a fixed map of one input)
for _batch_norm_type in (nn.BatchNorm1d, nn.BatchNorm2d):
    register_rule(_batch_norm_type, AffineRule(
        apply=_batch_norm, hyper=_batch_norm_hyper,
        flat_moments=lambda m: isinstance(m, nn.BatchNorm1d),
        parameters=_batch_norm_parameters, dense=torch.diag_embed, delta=_batch_norm_delta))
register_rule(nn.ReLU, GateRule(apply=lambda m, x: F.relu(x), flat_moments=_always))
register_rule(nn.LeakyReLU, GateRule(
    apply=lambda m, x: F.leaky_relu(x, m.negative_slope),
    hyper=lambda m: {"negative_slope": m.negative_slope}, flat_moments=_always,
    negative_slope=lambda m: float(m.negative_slope)))
register_rule(nn.MaxPool2d, MaxPoolRule(apply=_maxpool, hyper=_pool_hyper))
register_rule(nn.AvgPool2d, FixedRule(apply=_avgpool, hyper=_pool_hyper,
                                      squared=_avgpool_squared))
register_rule(nn.Flatten, FixedRule(
    apply=_flatten, hyper=lambda m: {"start_dim": m.start_dim, "end_dim": m.end_dim},
    flat_moments=lambda m: m.start_dim == 1 and m.end_dim == -1, squared=_flatten))
# Dropout is the identity at evaluation, which is where FSD is measured.
register_rule(nn.Dropout, FixedRule(apply=_identity, flat_moments=_always, squared=_identity))
register_rule(nn.Identity, FixedRule(apply=_identity, flat_moments=_always, squared=_identity))


class Cast(nn.Module):
    """``x.to(dtype)`` as a layer: what a chain holds for ``x.float()`` or ``x.to(torch.float32)``.

    The identity on values: the moment walks, which run in the model's dtype, take it as such.
    """

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: Tensor) -> Tensor:
        """``x`` in this layer's dtype."""
        return x.to(self.dtype)


def _cast(m: nn.Module, x: Tensor) -> Tensor:
    assert isinstance(m, Cast)  # the rule is registered for Cast only
    return x.to(m.dtype)


register_rule(Cast, FixedRule(apply=_cast, hyper=lambda m: {"dtype": str(m.dtype)},
                              flat_moments=_always, squared=_cast))

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
    register_rule(_smooth_type, SmoothGateRule(apply=_smooth_apply, hyper=_smooth_hyper,
                                               flat_moments=_always))
