"""Several fitted summaries (e.g. one per previous task) evaluated as one penalty.

Continual learning sums D(θ, θ_i, p_i) over all previous tasks i at every step.
:class:`SummarySet` returns that (weighted) sum; BGLN-D summaries of the same architecture
and covariance form are evaluated in one batched pass — their mixture components are stacked
along the component dimension of :func:`fsd.interpreter.delta_moments` (``moments="paper"``)
or :func:`fsd.exact_moments.delta_second_moment_adjoint` (``moments="exact"``), and (for
Algorithm 2) their reference networks once per summary where all have as many components
(else once per component) — so the number of operations per call does not grow with the
number of tasks. Other estimators are evaluated one by one.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import torch
from torch import Tensor, nn

from .calls import call_key
from .estimator import Estimator, evaluation_mode, model_dtype_device
from .exact_moments import delta_second_moment_adjoint
from .graph import unwrap
from .interpreter import delta_moments, model_state, trace
from .linearized import BGLN
from .precision import float32_view


def _form(estimator: BGLN) -> tuple:
    """Estimators whose stored input covariances can be concatenated share this key."""
    cov = estimator.input_covariance()
    if isinstance(cov, tuple):
        return ("lowrank", cov[0].shape[-1])
    return ("full" if cov.dim() == 3 else "diag",)


def _batch_key(estimator: Estimator) -> tuple | None:
    """Summaries with equal keys are evaluated in one pass; ``None``: one by one."""
    # convolutional BGLN-D (fsd.conv_moments), BGLN-D on graphs (fsd.graph_moments) and the
    # prototype moment variants (fsd.corrected_moments) are evaluated summary by summary
    if isinstance(estimator, BGLN) and estimator.config["deterministic"] \
            and estimator.config["moments"] in ("paper", "exact") \
            and not estimator._meta.get("convolutional") and not estimator._meta.get("graph"):
        # summaries that call the model differently (another task's head through
        # forward_kwargs) walk different graphs: one batch per call
        call = call_key(estimator._meta.get("output"), estimator._meta.get("forward_kwargs", {}))
        return (call, estimator.config["moments"], *_form(estimator))
    return None


def _cat_padded(tensors: list[Tensor]) -> Tensor:
    """Concatenate along dim 0, zero-padding the last dim to the widest.

    Extra zero columns of a factor Φ leave ΦΦᵀ unchanged.
    """
    width = max(t.shape[-1] for t in tensors)
    return torch.cat([torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in tensors])


def _cat_covariance(covs: list[Any]) -> Any:
    if isinstance(covs[0], tuple):
        return tuple(torch.cat(parts) for parts in zip(*covs, strict=True))
    return torch.cat(covs)


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
        with float32_view(model, differentiable=True):
            return self._distance(model)

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
        # the members share their call (_batch_key): the model as the first calls it
        layers = trace(self.estimators[members[0]].bind(model))
        for i in members:
            estimator = self.estimators[i]
            estimator.check_architecture(model)
            estimator.place(dtype, device)
        key = (tuple(members), str(dtype), str(device))
        if key not in self._cache:
            self._cache[key] = self._stack(layers, members)
        stacked = self._cache[key]
        with evaluation_mode(model):
            params1 = model_state(model)
            if stacked["exact"]:
                per_group = 0.5 * delta_second_moment_adjoint(
                    layers, stacked["params0"], params1, stacked["reference"],
                    stacked["gate_means"], stacked["output_rows"]).clamp_min(0)
            else:
                mean_d, trace_d = delta_moments(layers, stacked["params0"], params1,
                                                stacked["reference"], stacked["gate_means"],
                                                stacked["output_rows"])
                # clamped as each summary's own distance is (fsd.BGLN)
                per_group = 0.5 * mean_d.pow(2).sum(-1) + 0.5 * trace_d.clamp_min(0)
        return (stacked["weights"] * per_group).sum()

    def _stack(self, layers, members: list[int]) -> dict[str, Any]:
        """Concatenate the members' fixed parts along the component dimension."""
        parts, params0, counts = [], [], []
        for i in members:
            estimator = self.estimators[i]
            assert isinstance(estimator, BGLN)  # _batch_key batches BGLN-D summaries only
            theta0 = estimator.reference_state()
            part = estimator.moment_parts(layers, theta0)
            parts.append(part)
            params0.append(theta0)
            counts.append(part["weights"].shape[0])
        exact = self.estimators[members[0]].config["moments"] == "exact"
        if not exact and len(set(counts)) == 1:
            # one reference network per summary, shared by its components (the classes of a
            # class-wise summary): ΔW is formed once per summary, not once per class
            stacked_params = {name: torch.stack([p[name] for p in params0])
                              for name in params0[0]}
        else:
            stacked_params = {
                name: torch.cat([p[name].expand(c, *p[name].shape)
                                 for p, c in zip(params0, counts, strict=True)])
                for name in params0[0]}
        if exact:  # per affine layer a dict of blocks (fsd.exact_moments.reference_blocks)
            reference = [
                {name: (_cat_padded if name in ("factor", "p0") else torch.cat)(
                    [p["reference"][j][name] for p in parts])
                 for name in parts[0]["reference"][j]}
                for j in range(len(parts[0]["reference"]))]
        else:
            reference = [
                (torch.cat([p["reference"][j][0] for p in parts]),
                 _cat_covariance([p["reference"][j][1] for p in parts]),
                 torch.cat([p["reference"][j][2] for p in parts]))
                for j in range(len(parts[0]["reference"]))]
        gate_means = {path: torch.cat([p["gate_means"][path] for p in parts])
                      for path in parts[0]["gate_means"]}
        widest = max(p["output_rows"].shape[0] for p in parts)
        rows = []
        for p, c in zip(parts, counts, strict=True):
            r = p["output_rows"]
            padded = r.new_zeros(widest, r.shape[1])
            padded[: r.shape[0]] = r  # zero rows select nothing
            rows.append(padded.expand(c, *padded.shape))
        weights = torch.cat([self.weights[i] * p["weights"]
                             for i, p in zip(members, parts, strict=True)])
        return {"params0": stacked_params, "reference": reference, "gate_means": gate_means,
                "output_rows": torch.cat(rows), "weights": weights, "exact": exact}


def combine(estimators: Sequence[Estimator], weights: Sequence[float] | None = None
            ) -> SummarySet:
    """A :class:`SummarySet` of ``estimators`` (sum of their distances, batched)."""
    return SummarySet(estimators, weights)
