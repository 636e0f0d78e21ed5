"""The corrected recursion's ablations: BGLN-D between Algorithm 2 and exact moments.

For the fidelity study and the continual-learning experiments (``fsd_experiments.presets``:
``bgln-d-no-gate-variance``, ``bgln-d-no-cross-covariance``, ``bgln-d-corrected-cut``,
``bgln-d-corrected-fired``), not recommended to users and so not in the library:

- :class:`BGLNVariant`, BGLN-D with ``moments`` one of :data:`VARIANTS`, the injections sized
  from a cut covariance (``injection_rank``) or fired max-pool routing (``pool_routing``);
- the evaluators of the two omissions of Algorithm 2 taken one at a time, registered with
  :mod:`fsd.moments.evaluators` when this module is imported: ``"no-gate-variance"`` and
  ``"no-gate-variance-conv"`` (the mean-gate network: the corrected recursion without its
  injections) and ``"no-cross-covariance"`` (exact moments without Cov(a0, Δa), dense).

A summary of :class:`BGLNVariant` loads with :func:`fsd.load` once this module is imported.
The maths is the library's (:mod:`fsd.moments.corrected`, :mod:`fsd.moments.corrected_conv`).
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor

from fsd import BGLN
from fsd.moments import corrected
from fsd.moments.evaluators import ConvCorrected, Corrected, MomentSummary, Walk, register

#: the moment recursions of :class:`BGLNVariant` (``moments=``)
VARIANTS: tuple[str, ...] = ("corrected", "no-gate-variance", "no-cross-covariance")
#: the max-pool routing models of :class:`BGLNVariant` (``pool_routing=``)
POOL_ROUTINGS: tuple[str, ...] = ("independent", "fired")


class BGLNVariant(BGLN):
    """BGLN-D whose moments are one of :data:`VARIANTS`: the corrected recursion's ablations.

    Chains only (no graphs: ``fit`` refuses them). ``moments="corrected"`` with the default
    options is :class:`fsd.BGLN` with ``deterministic=True, moments="corrected"``.
    ``"corrected"`` and ``"no-gate-variance"`` also walk chains with convolutions and pools
    (:mod:`fsd.moments.corrected_conv`);
    ``"no-cross-covariance"`` (dense) MLP chains only. :func:`fsd.combine` stacks
    ``"corrected"`` and ``"no-gate-variance"`` summaries of MLP chains with one component
    (not class-wise) into one call per covariance form; the others go one by one.

    Args:
        moments: ``"corrected"`` (:func:`fsd.moments.corrected.corrected_second_moment`);
            ``"no-gate-variance"`` (the same without its correction: the mean-gate network,
            equal to :func:`fsd.moments.corrected.ablated_second_moment` with
            ``gate_variance=False``, at Algorithm 2's cost) or ``"no-cross-covariance"``
            (:func:`fsd.moments.corrected.ablated_second_moment`, dense).
        injection_rank: with ``moments="corrected"``, size the gates' injected variance from
            the input covariance cut to this many directions plus its diagonal
            (:func:`fsd.moments.corrected.truncated_input`); ``None`` (the default) uses the
            whole stored covariance. The mean-gate network's term always uses all of it.
        pool_routing: how a max-pool routes. ``"independent"`` (the default): every unit
            before it gated by its own Bernoulli gate, every window routed by an independent
            draw with E = π (its argmax frequencies). ``"fired"``: a ``nn.ReLU`` directly
            before a max-pool is not gated; the window instead draws position p with
            probability P(p is its argmax and the maximum is > 0) and no position (output 0)
            otherwise (:func:`fsd.model.rules.fired_routing_statistics`), which keeps how
            often a window fires (ReLU and max commute). Other pools route as by default.
        **options: as :class:`fsd.BGLN`; ``deterministic`` must be ``True``.
    """

    def __init__(self, moments: str = "corrected", injection_rank: int | None = None,
                 pool_routing: str = "independent", **options: Any) -> None:
        if moments not in VARIANTS:
            raise ValueError(f"moments must be one of {', '.join(VARIANTS)}, got {moments!r}")
        if not options.pop("deterministic", True):
            raise ValueError("BGLNVariant is deterministic (a BGLN-D)")
        if injection_rank is not None:
            if moments != "corrected":
                raise ValueError(f"injection_rank applies to moments='corrected' only, not "
                                 f"{moments!r}")
            if isinstance(injection_rank, bool) or not isinstance(injection_rank, int) \
                    or injection_rank < 1:
                raise ValueError(f"injection_rank must be a positive integer, got "
                                 f"{injection_rank!r}")
        if pool_routing not in POOL_ROUTINGS:
            raise ValueError(f"pool_routing must be one of {', '.join(POOL_ROUTINGS)}, got "
                             f"{pool_routing!r}")
        if pool_routing != "independent" and moments == "no-cross-covariance":
            raise ValueError("pool_routing='fired' applies to the convolutional walks "
                             "(moments='corrected' or 'no-gate-variance')")
        super().__init__(deterministic=True, **options)
        self.config["moments"] = moments
        if injection_rank is not None:  # absent otherwise: summaries stay as they were
            self.config["injection_rank"] = injection_rank
        if pool_routing != "independent":  # likewise
            self.config["pool_routing"] = pool_routing

class NoGateVariance(Corrected):
    """The mean-gate network alone on MLP chains: the corrected recursion without injections."""

    name = "no-gate-variance"
    gate_variance = False

class ConvNoGateVariance(ConvCorrected):
    """The mean-gate network alone on chains with convolutions and pools."""

    name = "no-gate-variance-conv"
    gate_variance = False

class NoCrossCovariance(Corrected):
    """Exact moments without Cov(a0, Δa) on MLP chains (dense; Algorithm 2's other omission)."""

    name = "no-cross-covariance"

    def stack_key(self, summary: MomentSummary) -> tuple | None:
        """Never stacked: the dense recursion goes summary by summary."""
        return None

    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """The output rows, θ0 and the input moments (nothing else is fixed after fit)."""
        parts = self.shared_parts(walk, summary)
        parts.update(params0=summary.params0, mean=summary.mean,
                     covariance=summary.covariance)
        return parts

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½ E‖PΔz‖² with Cov(a0, Δa) dropped after every gate, mixed over components."""
        value = corrected.ablated_second_moment(
            walk, parts["params0"], params1, parts["mean"], parts["covariance"],
            parts["gate_means"], parts["output_rows"], cross_covariance=False)
        return (parts["weights"] * 0.5 * value.clamp_min(0)).sum()

for _evaluator in (NoGateVariance(), ConvNoGateVariance(), NoCrossCovariance()):
    register(_evaluator)
