"""Several fitted summaries (e.g. one per previous task) evaluated as one penalty.

Continual learning sums D(θ, θ_i, p_i) over all previous tasks i at every step.
:class:`SummarySet` returns that (weighted) sum. BGLN-D summaries whose evaluator stacks them
(:meth:`fsd.moments.evaluators.Evaluator.stack`: Algorithm 2, exact moments and the corrected
recursion on chains) and that share a call, an evaluator and a covariance form are evaluated
in one batched pass — their mixture components stacked along the component dimension — so
the number of operations per call does not grow with the number of tasks. Other estimators
are evaluated one by one.
"""

from __future__ import annotations

import math
from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..model.calls import call_key
from ..model.plan import trace
from ..model.signature import check_signature, model_state
from ..model.tracing import unwrap
from ..precision import float32_view
from .base import Estimator, evaluation_mode, model_dtype_device
from .linearized import BGLN
from .model_state import check_distance, refuse_meta


def _batch_key(estimator: Estimator) -> tuple | None:
    """Summaries with equal keys are evaluated in one pass; ``None``: one by one."""
    if not (isinstance(estimator, BGLN) and estimator.config["deterministic"]):
        return None
    if "batch_key" not in estimator._cache:  # fixed after fit: read once per placement
        evaluator = estimator._evaluator
        key = evaluator.stack_key(estimator._moment_summary({})) \
            if evaluator.walks == "chain" else None
        # summaries that call the model differently (another task's head through
        # forward_kwargs) walk different graphs: one batch per call
        estimator._cache["batch_key"] = None if key is None else (
            call_key(estimator._meta.get("output"), estimator._meta.get("forward_kwargs", {})),
            *key)
    return estimator._cache["batch_key"]


class SummarySet:
    """Weighted sum of fitted estimators' distances, batched where the math allows.

    Args:
        estimators: fitted estimators (any mix of types) for the same model architecture.
        weights: one weight per estimator (default 1 each).
    """

    def __init__(self, estimators: Sequence[Estimator], weights: Sequence[float] | None = None
                 ) -> None:
        self.estimators = list(estimators)
        if weights is None:
            weights = [1.0] * len(self.estimators)
        if len(weights) != len(self.estimators):
            raise ValueError(f"{len(weights)} weights for {len(self.estimators)} estimators")
        for e in self.estimators:
            e.require_fitted()
        self.weights = [float(w) for w in weights]
        bad = [w for w in self.weights if not (math.isfinite(w) and w >= 0)]
        if bad:
            raise ValueError(f"weights must be finite and non-negative, got {bad[0]}")
        self._cache: dict[Any, Any] = {}

    def __len__(self) -> int:
        return len(self.estimators)

    def __iter__(self) -> Iterator[Estimator]:
        return iter(self.estimators)

    @property
    def nbytes(self) -> int:
        """Bytes held by all summaries."""
        return sum(e.nbytes for e in self.estimators)

    def distance(self, model: nn.Module) -> Tensor:
        """Σ_i weight_i · D_i(model): a differentiable 0-dim tensor (0 for an empty set).

        A float16 or bfloat16 model is measured in float32, as by :meth:`Estimator.distance`.
        """
        model = unwrap(model)
        refuse_meta(model)
        with float32_view(model, differentiable=True):
            value = self._distance(model)
        return check_distance(value, model)  # the batched members are not checked one by one

    def _distance(self, model: nn.Module) -> Tensor:
        dtype, device = model_dtype_device(model)
        batches: dict[tuple, list[int]] = {}
        singles: list[int] = []
        for i, e in enumerate(self.estimators):
            key = _batch_key(e)
            if key is None:
                singles.append(i)
            else:
                batches.setdefault(key, []).append(i)
        total = torch.zeros((), dtype=dtype, device=device)
        for members in batches.values():
            if len(members) == 1:
                singles.extend(members)
            else:
                total = total + self._batched_moment_distance(model, members, dtype, device)
        for i in singles:
            total = total + self.weights[i] * self.estimators[i].distance(model)
        return total

    def _batched_moment_distance(self, model: nn.Module, members: list[int],
                                 dtype: torch.dtype, device: torch.device) -> Tensor:
        # the members share their call and evaluator (_batch_key): the model as the first
        # calls it
        first = self.estimators[members[0]]
        assert isinstance(first, BGLN)  # _batch_key batches BGLN-D summaries only
        evaluator = first._evaluator
        layers = trace(first.bind(model))
        # the members call the model alike: its signature is read once, not once per member
        # (what Estimator.check_architecture reads for each; a step with K summaries paid K)
        signatures: dict[type, Any] = {}
        for i in members:
            estimator = self.estimators[i]
            kind = type(estimator)
            if kind not in signatures:
                signatures[kind] = estimator._full_signature(estimator.bind(model))
            check_signature(estimator._meta["signature"], signatures[kind])
            estimator.place(dtype, device)
        # a member fitted again holds new tensors (a new dict): its parts are stacked again
        key = (tuple(members), tuple(id(self.estimators[i]._stored) for i in members),
               str(dtype), str(device))
        if key not in self._cache:
            self._cache = {k: v for k, v in self._cache.items() if k[0] != key[0]}
            parts, params0 = [], []
            for i in members:
                estimator = self.estimators[i]
                assert isinstance(estimator, BGLN)
                theta0 = estimator.reference_state()
                parts.append(estimator.moment_parts(layers, theta0))
                params0.append(theta0)
            self._cache[key] = evaluator.stack(parts, params0,
                                               [self.weights[i] for i in members])
        with evaluation_mode(model):
            return evaluator.distance(layers, self._cache[key], model_state(model))


def combine(estimators: Sequence[Estimator], weights: Sequence[float] | None = None
            ) -> SummarySet:
    """A :class:`SummarySet` of ``estimators`` (sum of their distances, batched)."""
    return SummarySet(estimators, weights)
