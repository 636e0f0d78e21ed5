"""BGLN-D with a moment recursion between Algorithm 2 and exact moments (prototypes).

The maths is :mod:`fsd.moments.corrected` (:mod:`fsd.moments.corrected_conv` on CNNs); the
evaluators that run it are in :mod:`fsd.moments.evaluators`. Not part of the public API: the
ablations and the corrected estimator, for the fidelity study and continual-learning
experiments (``fsd_experiments.presets``).
"""

from __future__ import annotations

from typing import Any

from ..moments.corrected import VARIANTS
from .linearized import BGLN

#: the max-pool routing models of :class:`BGLNVariant` (``pool_routing=``)
POOL_ROUTINGS: tuple[str, ...] = ("independent", "fired")


class BGLNVariant(BGLN):
    """BGLN-D whose moments are one of :data:`fsd.moments.corrected.VARIANTS` (prototype).

    Chains only (no graphs: ``fit`` refuses them). ``"corrected"`` and ``"no-gate-variance"``
    also walk chains with convolutions and pools (:mod:`fsd.moments.corrected_conv`);
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
