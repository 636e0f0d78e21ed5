"""BGLN-D's evaluators: one interface over the ways a summary's moments give its distance.

A BGLN-D summary stores θ0, the input moments and the gate statistics. Turning them into
E‖Δz‖² takes one of several walks of the model, each an :class:`Evaluator`:

- ``"algorithm2"``: paper Algorithm 2 on a chain of flat layers (:mod:`fsd.moments.algorithm2`);
- ``"algorithm2-conv"``: Algorithm 2 on a chain with convolutions and pools
  (:mod:`fsd.moments.algorithm2_conv`);
- ``"exact"``: exact moments on a chain of flat layers (:mod:`fsd.moments.exact`);
- ``"exact-graph"``: exact moments on a graph of flat layers (:mod:`fsd.moments.exact_graph`);
- ``"corrected"``: the corrected recursion on chains of flat layers
  (:mod:`fsd.moments.corrected`);
- ``"corrected-conv"``: the corrected recursion on chains with convolutions and pools
  (:mod:`fsd.moments.corrected_conv`);
- ``"corrected-graph"``: the corrected recursion on graphs — residual MLPs and CNNs
  (:mod:`fsd.moments.corrected_graph`).

The ablations of the corrected recursion (``"no-gate-variance"``, ``"no-cross-covariance"``,
``"no-gate-variance-conv"``) are registered by ``fsd_experiments.ablations``.

``fit`` picks one (:func:`choose`) and the summary records its name (``meta["evaluator"]``);
the estimator's distance and :class:`fsd.SummarySet`'s batching talk to the interface only.
An evaluator *prepares* what is fixed after fit once (:meth:`Evaluator.prepare`, cached by
the estimator), *evaluates* the distance from it and θ, and — where summaries can share one
pass — *stacks* several prepared summaries along the mixture-component dimension
(:meth:`Evaluator.stack`). A new evaluator is one subclass registered with
:func:`register`; ``docs/architecture.md`` has a worked example.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Sequence

import torch
from torch import Tensor, nn

from ..covariance import Covariance
from ..model import support
from ..model.linearize import propagate_linearized
from ..model.rules import TracedLayer, UnsupportedModuleError, is_affine
from ..validation import SummaryFormatError
from . import algorithm2_conv, corrected, corrected_conv, corrected_graph
from .algorithm2 import affine_rule, check_moment_support, delta_moments, reference_moments
from .exact import delta_second_moment_adjoint, reference_blocks
from .exact_graph import graph_plan, graph_second_moment

Walk = Any  # a chain of traced layers (``list[TracedLayer]``), or the model for a graph


@dataclass(frozen=True)
class MomentSummary:
    """What a fitted BGLN-D summary hands its evaluator, in the current placement.

    Attributes:
        params0: θ0's parameters and buffers by name.
        mean: the input means, one row per mixture component (G, d).
        covariance: the input covariances (:mod:`fsd.covariance`'s forms).
        gate_means: gate statistics by call-site path.
        routing: max-pool routing frequencies by path (convolutional chains).
        layer_moments: ``{path: (mean, cov)}`` of every affine layer's input for
            ``reference="layerwise"``, else ``None``.
        weights: the mixture weights (G,).
        input_shape: one example's shape.
        select: restricts outputs (…, k) to the units the summary was fitted on.
        config: the estimator's configuration, for evaluators that take options
            (``injection_rank`` of :class:`Corrected`).
    """

    params0: dict[str, Tensor]
    mean: Tensor
    covariance: Covariance
    gate_means: dict[str, Tensor]
    routing: dict[str, Tensor]
    layer_moments: dict[str, tuple[Tensor, Tensor]] | None
    weights: Tensor
    input_shape: tuple[int, ...]
    select: Callable[[Tensor], Tensor]
    config: Mapping[str, Any] = field(default_factory=dict)

    def output_rows(self, size: int, contiguous: bool = True) -> Tensor:
        """The rows selecting the fitted outputs among ``size`` (k', size)."""
        eye = torch.eye(size, dtype=self.mean.dtype, device=self.mean.device)
        rows = self.select(eye).T
        return rows.contiguous() if contiguous else rows


class Evaluator(ABC):
    """One way to turn a BGLN-D summary into its distance.

    Attributes:
        name: recorded in the summary; :func:`get` finds the evaluator by it.
        walks: ``"chain"`` — :meth:`prepare` and :meth:`distance` take the model's traced
            layers (:func:`fsd.trace`); ``"graph"`` — they take the model itself.
        statistics: what the summary must hold besides gate frequencies (``"routing"``:
            max-pool routing frequencies).
    """

    name: ClassVar[str]
    walks: ClassVar[str] = "chain"
    statistics: ClassVar[frozenset[str]] = frozenset()

    def check(self, walk: Walk, summary: MomentSummary) -> None:
        """Refuse at ``fit`` what :meth:`distance` could not evaluate (raise)."""
        if "routing" in self.statistics:
            pools = [layer.path for layer in walk if layer.rule.collects == "routing"]
            missing = [p for p in pools if p not in summary.routing]
            if missing:
                raise ValueError(f"the statistics hold no max-pool routing for {missing} "
                                 f"(a collector made with gates=False?)")

    @abstractmethod
    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """What is fixed after fit, computed once: at least ``"weights"`` (G,)."""

    @abstractmethod
    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """The summary's distance at θ = ``params1`` (a 0-dim tensor, differentiable)."""

    def stack_key(self, summary: MomentSummary) -> tuple | None:
        """Summaries of equal keys are evaluated in one pass by :meth:`stack`.

        ``None``: this evaluator evaluates summaries one by one. Called with the summary's
        fixed fields only (``params0`` empty): the key may depend on shapes and forms, not
        on θ0. :class:`fsd.SummarySet` batches chain evaluators only (``walks="chain"``).
        """
        return None

    def stack(self, parts: Sequence[dict[str, Any]], params0: Sequence[dict[str, Tensor]],
              weights: Sequence[float]) -> dict[str, Any]:
        """Several summaries' prepared parts as one, weights folded into the mixture weights.

        :meth:`distance` of the result is Σ weight_i · distance_i. A subclass whose
        :meth:`prepare` adds parts must stack them too (override this), or return ``None``
        from :meth:`stack_key`.
        """
        raise NotImplementedError(f"the {self.name!r} evaluator does not stack summaries")


_EVALUATORS: dict[str, Evaluator] = {}


def register(evaluator: Evaluator) -> Evaluator:
    """Make ``evaluator`` known by its name (summaries record it; :func:`get` returns it)."""
    if not isinstance(evaluator, Evaluator):
        raise TypeError(f"an evaluator is an instance of a subclass of fsd.moments.evaluators."
                        f"Evaluator, got {type(evaluator).__name__}")
    _EVALUATORS[evaluator.name] = evaluator
    return evaluator


def get(name: str) -> Evaluator:
    """The evaluator registered under ``name`` (``ValueError`` naming the known ones)."""
    if name not in _EVALUATORS:
        raise ValueError(f"unknown evaluator {name!r}; known: {', '.join(sorted(_EVALUATORS))}")
    return _EVALUATORS[name]


def names() -> list[str]:
    """The registered evaluators' names."""
    return sorted(_EVALUATORS)


# ----- the choice at fit -------------------------------------------------------------------
_CHAIN_NAMES: dict[str, str] = {"paper": "algorithm2", "exact": "exact", "corrected": "corrected"}
#: the evaluator of each ``moments`` on a chain with convolutions or pools
_CONV_NAMES: dict[str, str] = {"paper": "algorithm2-conv"}


def _conv_name(moments: str) -> str | None:
    """The registered evaluator of ``moments`` on chains with convolutions (``<name>-conv``)."""
    name = _CONV_NAMES.get(moments, f"{moments}-conv")
    return name if name in _EVALUATORS else None


def choose(layers: list[TracedLayer] | None, config: Mapping[str, Any],
           input_shape: tuple[int, ...]) -> Evaluator:
    """The evaluator for a BGLN-D ``config`` on a model, or refuse in one line.

    Args:
        layers: the model's chain (:func:`fsd.trace`), or ``None`` for a graph that is not
            one (:meth:`fsd.BGLN.fit` has let only ``moments="exact"`` through then).
        config: the estimator's configuration (``moments``, ``reference``).
        input_shape: one example's shape.
    """
    moments: str = config["moments"]
    if layers is None:
        if moments == "corrected":
            return get("corrected-graph")
        _check_flat_inputs(input_shape)
        return get("exact-graph")
    flat = check_moment_support(layers, input_shape, exact=moments == "exact",
                                layerwise=config.get("reference") == "layerwise")
    if moments == "paper":
        _check_affine_first(layers)
    if not flat:
        conv = _conv_name(moments)
        if conv is not None:
            return get(conv)
        use = support.advice(support.BGLN_D, support.Feature.UNFLAT)
        raise NotImplementedError(f"BGLN-D with moments={moments!r} walks MLP chains "
                                  f"only; {use}")
    return get(_CHAIN_NAMES.get(moments, moments))


def _check_flat_inputs(input_shape: tuple[int, ...]) -> None:
    if len(input_shape) != 1:
        use = support.advice(support.BGLN_D_EXACT, support.Feature.BRANCH,
                             support.Feature.UNFLAT)
        raise NotImplementedError(
            f"BGLN-D on a graph that is not a chain needs flat inputs (got examples of "
            f"shape {input_shape}); {use}")


def _check_affine_first(layers: list[TracedLayer]) -> None:
    """Algorithm 2 starts from the input's moments at an affine layer: refuse a gate before."""
    for layer in layers:
        if is_affine(layer.rule):
            return
        if layer.rule.collects is not None:  # a gate or max-pool, whose statistics it reads
            raise NotImplementedError(
                f"BGLN-D with moments='paper' (Algorithm 2) needs an affine layer (Linear, "
                f"Conv2d, BatchNorm) before the first activation or max-pool; "
                f"{type(layer.module).__name__} at '{layer.path}' comes first; use BGLN-S or "
                f"LAFTR, or ExactFSD, NTK, EWC or KFAC")


def check_graph(config: Mapping[str, Any], error: UnsupportedModuleError) -> None:
    """Raise unless an evaluator takes BGLN-D with ``config`` on a model that is no chain.

    Args:
        config: the estimator's configuration.
        error: why the model is not a chain (:func:`fsd.trace`'s refusal), raised as it is
            where no graph evaluator applies: Algorithm 2 and the variants walk chains.
    """
    if config["moments"] not in ("exact", "corrected"):
        raise error
    if config.get("reference") == "layerwise":  # layer-wise statistics are a chain's
        raise UnsupportedModuleError(
            f"{error}. {support.describe(support.BGLN_D_LAYERWISE)}; use "
            f"reference='propagated' on this graph") from None


def recorded(meta: Mapping[str, Any], config: Mapping[str, Any]) -> Evaluator:
    """The evaluator a fitted summary records, checked against its configuration.

    Summaries written before evaluators had names record the walk in two flags
    (``"graph"``, ``"convolutional"``); they are read here, and only here.
    """
    name = meta.get("evaluator")
    source = "meta 'evaluator'"
    if name is None:
        name = "exact-graph" if meta.get("graph") else \
            "algorithm2-conv" if meta.get("convolutional") else \
            _CHAIN_NAMES.get(config["moments"], config["moments"])
        source = "the walk read from the summary's flags (written before evaluator names)"
    if not isinstance(name, str) or name not in _EVALUATORS:
        raise SummaryFormatError(f"{source}: unknown evaluator {name!r} (known: "
                                 f"{', '.join(sorted(_EVALUATORS))}; an evaluator of your "
                                 f"own is registered by importing its module)")
    allowed = {"exact": ("exact", "exact-graph"),
               "corrected": ("corrected", "corrected-conv", "corrected-graph")}.get(
        config["moments"], (_CHAIN_NAMES.get(config["moments"], config["moments"]),
                            _conv_name(config["moments"])))
    if name not in allowed:
        raise SummaryFormatError(f"{source}: {name!r} does not evaluate moments="
                                 f"{config['moments']!r}")
    return _EVALUATORS[name]


# ----- the evaluators ----------------------------------------------------------------------
def _form(covariance: Covariance) -> tuple:
    """Summaries whose input covariances can be concatenated share this key."""
    if isinstance(covariance, tuple):
        return ("lowrank", covariance[0].shape[-1])
    return ("full" if covariance.dim() == 3 else "diag",)


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


def _chain_output_size(layers: list[TracedLayer], params0: Mapping[str, Tensor]) -> int:
    last = [layer for layer in layers if is_affine(layer.rule)][-1]
    return affine_rule(last).affine_matrix(last.module, params0, last.path)[0].shape[-2]


class _ChainEvaluator(Evaluator):
    """Shared parts of the flat-chain evaluators, and their stacking.

    ``reference_side(layers, params0, mean, covariance, gate_means, layer_moments)``: what
    :meth:`prepare` computes from θ0 and the statistics, once.
    """

    reference_side: Callable[..., Any]

    def check(self, walk: Walk, summary: MomentSummary) -> None:
        """Refuse a chain that is not flat: convolutions, pools and images take the conv walks.

        (At ``fit``, :func:`choose` has picked a conv walk for those already; this refuses
        :meth:`fsd.BGLN.distance_by` asking a flat walk for one.)
        """
        super().check(walk, summary)
        if not check_moment_support(walk, summary.input_shape, exact=self.name == "exact"):
            conv = sorted(name for name in _EVALUATORS if name.endswith("-conv"))
            raise UnsupportedModuleError(
                f"the {self.name!r} evaluator walks chains of flat layers (MLPs); this chain "
                f"has convolutions, pools or image inputs (the walks of those: "
                f"{', '.join(conv)})")

    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """The reference side (:attr:`reference_side`), the output rows and θ0."""
        parts = self.shared_parts(walk, summary)
        with torch.no_grad():
            parts["reference"] = self.reference_side(walk, summary.params0, summary.mean,
                                                     summary.covariance, summary.gate_means,
                                                     summary.layer_moments)
        parts["params0"] = summary.params0
        return parts

    def shared_parts(self, layers: list[TracedLayer], summary: MomentSummary
                     ) -> dict[str, Any]:
        """The gate statistics, the output rows and the components' weights."""
        return {"gate_means": summary.gate_means,
                "output_rows": summary.output_rows(_chain_output_size(layers, summary.params0)),
                "weights": summary.weights}

    def stack_key(self, summary: MomentSummary) -> tuple | None:
        """One pass for summaries of this evaluator and covariance form."""
        return (self.name, *_form(summary.covariance))

    def _stack_common(self, parts: Sequence[dict[str, Any]],
                      params0: Sequence[dict[str, Tensor]], weights: Sequence[float],
                      per_summary: bool) -> dict[str, Any]:
        counts = [p["weights"].shape[0] for p in parts]
        if per_summary:
            # one reference network per summary, shared by its components (the classes of a
            # class-wise summary): ΔW is formed once per summary, not once per class
            stacked_params = {name: torch.stack([p[name] for p in params0])
                              for name in params0[0]}
        else:
            stacked_params = {
                name: torch.cat([p[name].expand(c, *p[name].shape)
                                 for p, c in zip(params0, counts, strict=True)])
                for name in params0[0]}
        gate_means = {path: torch.cat([p["gate_means"][path] for p in parts])
                      for path in parts[0]["gate_means"]}
        widest = max(p["output_rows"].shape[0] for p in parts)
        rows = []
        for p, c in zip(parts, counts, strict=True):
            r = p["output_rows"]
            padded = r.new_zeros(widest, r.shape[1])
            padded[: r.shape[0]] = r  # zero rows select nothing
            rows.append(padded.expand(c, *padded.shape))
        stacked_weights = torch.cat([w * p["weights"]
                                     for w, p in zip(weights, parts, strict=True)])
        return {"params0": stacked_params, "gate_means": gate_means,
                "output_rows": torch.cat(rows), "weights": stacked_weights}


class Algorithm2(_ChainEvaluator):
    """Paper Algorithm 2 on a chain of flat layers (:mod:`fsd.moments.algorithm2`)."""

    name = "algorithm2"
    reference_side = staticmethod(reference_moments)

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½‖E[Δz]‖² + ½ tr Cov(Δz), mixed over components."""
        mean_d, trace = delta_moments(walk, parts["params0"], params1, parts["reference"],
                                      parts["gate_means"], parts["output_rows"])
        # a variance (a second moment above) is ≥ 0 for PSD covariances; fsd.load admits
        # eigenvalues down to −(round-off), which can leave a tiny negative one: clamp it
        per_group = 0.5 * mean_d.pow(2).sum(-1) + 0.5 * trace.clamp_min(0)
        return (parts["weights"] * per_group).sum()

    def stack(self, parts: Sequence[dict[str, Any]], params0: Sequence[dict[str, Tensor]],
              weights: Sequence[float]) -> dict[str, Any]:
        """Components concatenated; θ0 once per summary where all have as many components."""
        counts = {p["weights"].shape[0] for p in parts}
        stacked = self._stack_common(parts, params0, weights, per_summary=len(counts) == 1)
        stacked["reference"] = [
            (torch.cat([p["reference"][j][0] for p in parts]),
             _cat_covariance([p["reference"][j][1] for p in parts]),
             torch.cat([p["reference"][j][2] for p in parts]))
            for j in range(len(parts[0]["reference"]))]
        return stacked


class ExactMoments(_ChainEvaluator):
    """Exact moments on a chain of flat layers (:mod:`fsd.moments.exact`, the adjoint)."""

    name = "exact"
    reference_side = staticmethod(reference_blocks)

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½ E‖Δz‖² by the adjoint recursion, mixed over components."""
        per_group = 0.5 * delta_second_moment_adjoint(
            walk, parts["params0"], params1, parts["reference"], parts["gate_means"],
            parts["output_rows"]).clamp_min(0)
        return (parts["weights"] * per_group).sum()

    def stack(self, parts: Sequence[dict[str, Any]], params0: Sequence[dict[str, Tensor]],
              weights: Sequence[float]) -> dict[str, Any]:
        """Components concatenated, θ0 repeated per component, factors zero-padded."""
        stacked = self._stack_common(parts, params0, weights, per_summary=False)
        # per affine layer a dict of blocks (fsd.moments.exact.reference_blocks)
        stacked["reference"] = [
            {name: (_cat_padded if name in ("factor", "p0") else torch.cat)(
                [p["reference"][j][name] for p in parts])
             for name in parts[0]["reference"][j]}
            for j in range(len(parts[0]["reference"]))]
        return stacked


class _ConvEvaluator(Evaluator):
    """An evaluator of chains with convolutions and pools: the steps, statistics and rows."""

    statistics = frozenset({"routing"})

    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """The steps, the reference side and the output rows (from a probe's output size)."""
        probe = torch.zeros((1, *summary.input_shape), dtype=summary.mean.dtype,
                            device=summary.mean.device)
        with torch.no_grad():
            z0, _ = propagate_linearized(walk, summary.params0, None, probe)
            steps = algorithm2_conv.moment_steps(walk)
            statistics = {**summary.gate_means, **summary.routing}
            reference = self._reference(steps, summary, statistics)
        return {"output_rows": summary.output_rows(z0[0].numel()), "weights": summary.weights,
                "steps": steps, "statistics": statistics, "reference": reference,
                "params0": summary.params0, "input_shape": summary.input_shape}

    @abstractmethod
    def _reference(self, steps: list, summary: MomentSummary,
                   statistics: dict[str, Tensor]) -> dict[str, Any]:
        """What the walk keeps from θ0 and the statistics."""


class ConvAlgorithm2(_ConvEvaluator):
    """Algorithm 2 on a chain of convolutions, pools and flat layers (``algorithm2_conv``)."""

    name = "algorithm2-conv"

    def _reference(self, steps: list, summary: MomentSummary,
                   statistics: dict[str, Tensor]) -> dict[str, Any]:
        return algorithm2_conv.reference_side(steps, summary.params0, summary.mean,
                                              summary.covariance, statistics,
                                              summary.input_shape)

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½‖E[Δz]‖² + ½ tr Cov(Δz) through the convolutional steps."""
        mean_d, trace = algorithm2_conv.delta_side(
            parts["steps"], parts["params0"], params1, parts["reference"], parts["statistics"],
            parts["output_rows"], parts["input_shape"])
        per_group = 0.5 * mean_d.pow(2).sum(-1) + 0.5 * trace.clamp_min(0)
        return (parts["weights"] * per_group).sum()


class GraphExactMoments(Evaluator):
    """Exact moments on any traced graph of flat layers (:mod:`fsd.moments.exact_graph`)."""

    name = "exact-graph"
    walks = "graph"

    def check(self, walk: Walk, summary: MomentSummary) -> None:
        """Refuse inputs that are not flat, then build the plan, which refuses the rest."""
        _check_flat_inputs(tuple(summary.input_shape))
        self.prepare(walk, summary)

    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """The graph's plan (:func:`fsd.moments.exact_graph.graph_plan`) and the input moments."""
        plan = graph_plan(walk, summary.params0, int(summary.input_shape[0]),
                          summary.mean.dtype)
        return {"plan": plan, "params0": summary.params0, "mean": summary.mean,
                "covariance": summary.covariance, "gate_means": summary.gate_means,
                "output_rows": summary.output_rows(plan.output_size, contiguous=False),
                "weights": summary.weights}

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½ E‖Δz‖² over the graph, mixed over components."""
        per_group = 0.5 * graph_second_moment(
            parts["plan"], walk, parts["params0"], params1, parts["mean"], parts["covariance"],
            parts["gate_means"], parts["output_rows"]).clamp_min(0)
        return (parts["weights"] * per_group).sum()


class CorrectedGraph(Evaluator):
    """The corrected recursion on traced graphs: residual MLPs and CNNs.

    :mod:`fsd.moments.corrected_graph`: the mean-gate network's rows by autograd, the
    injections sized by factor images plus diagonally carried parts.
    """

    name = "corrected-graph"
    walks = "graph"
    statistics = frozenset({"routing"})

    def check(self, walk: Walk, summary: MomentSummary) -> None:
        """Read the graph (refusing what it cannot walk) and check the routing statistics."""
        steps = corrected_graph.read_graph(walk, tuple(summary.input_shape),
                                           summary.mean.dtype)
        pools = [node.layer.path for node in steps.nodes
                 if node.kind == "pool" and node.layer is not None]
        missing = [p for p in pools if p not in summary.routing]
        if missing:
            raise ValueError(f"the statistics hold no max-pool routing for {missing} "
                             f"(a collector made with gates=False?)")

    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """The graph's steps, the reference side (θ0 and the statistics) and the output rows."""
        steps = corrected_graph.read_graph(walk, tuple(summary.input_shape),
                                           summary.mean.dtype)
        statistics = {**summary.gate_means, **summary.routing}
        with torch.no_grad():
            reference = corrected_graph.reference(
                steps, summary.params0, summary.mean, summary.covariance, statistics,
                tuple(summary.input_shape), summary.config.get("injection_rank"))
        return {"steps": steps, "statistics": statistics, "reference": reference,
                "params0": summary.params0, "weights": summary.weights,
                "output_rows": summary.output_rows(corrected_graph.output_size(steps))}

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½ E‖PΔz‖², mixed over components."""
        value = corrected_graph.second_moment(
            parts["steps"], parts["params0"], params1, parts["reference"], parts["statistics"],
            parts["output_rows"])
        assert isinstance(value, Tensor)
        return (parts["weights"] * 0.5 * value.clamp_min(0)).sum()


class Corrected(_ChainEvaluator):
    """The corrected recursion on chains of flat layers (:mod:`fsd.moments.corrected`).

    Algorithm 2's rows plus the gates' variance injected at every gate and carried to the
    outputs. A subclass with :attr:`gate_variance` ``False`` is the mean-gate network alone
    (an ablation, ``fsd_experiments.ablations``).
    """

    name = "corrected"
    #: add the gates' injected variance (``False``: the mean-gate network alone)
    gate_variance: ClassVar[bool] = True

    def stack_key(self, summary: MomentSummary) -> tuple | None:
        """One pass per covariance form and injection rank for one-component summaries.

        Class-wise summaries go one by one: stacked, every class would carry its own copy of
        ΔW (the hand-written pass takes one ΔW per component).
        """
        if summary.weights.shape[0] > 1:
            return None
        return (self.name, *_form(summary.covariance), summary.config.get("injection_rank"))

    def stack(self, parts: Sequence[dict[str, Any]], params0: Sequence[dict[str, Tensor]],
              weights: Sequence[float]) -> dict[str, Any]:
        """Components concatenated, θ0's matrices repeated per component, factors zero-padded.

        Each summary's θ0 differs, so ΔW is one matrix per component and the recursion runs
        once for all of them (:func:`fsd.moments.corrected.corrected_second_moment`).
        """
        stacked = self._stack_common(parts, params0, weights, per_summary=False)
        counts = [p["weights"].shape[0] for p in parts]

        def joined(name: str, blocks: list[Tensor]) -> Tensor:
            if name in ("w0h", "w0", "w0sq"):  # θ0's matrices (one per summary): per component
                return torch.cat([b.expand(c, *b.shape)
                                  for b, c in zip(blocks, counts, strict=True)])
            if name in ("factor", "f0", "signal_factor"):  # factors (…, q): zero columns
                return _cat_padded(blocks)
            return torch.cat(blocks)

        stacked["reference"] = [
            {name: joined(name, [p["reference"][j][name] for p in parts])
             for name in parts[0]["reference"][j]}
            for j in range(len(parts[0]["reference"]))]
        return stacked

    def prepare(self, walk: Walk, summary: MomentSummary) -> dict[str, Any]:
        """The corrected reference side, the output rows and θ0."""
        parts = self.shared_parts(walk, summary)
        with torch.no_grad():
            parts["reference"] = corrected.corrected_reference(
                walk, summary.params0, summary.mean, summary.covariance,
                summary.gate_means, summary.config.get("injection_rank"))
        parts.update(params0=summary.params0, mean=summary.mean,
                     covariance=summary.covariance)
        return parts

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½ E‖PΔz‖², mixed over components."""
        value = corrected.corrected_second_moment(
            walk, parts["params0"], params1, parts["reference"], parts["gate_means"],
            parts["output_rows"], gate_variance=self.gate_variance)
        assert isinstance(value, Tensor)
        return (parts["weights"] * 0.5 * value.clamp_min(0)).sum()


class ConvCorrected(_ConvEvaluator):
    """The corrected recursion on chains with convolutions and pools (``corrected_conv``).

    A subclass with :attr:`gate_variance` ``False`` is the mean-gate network alone (an
    ablation, ``fsd_experiments.ablations``).
    """

    name = "corrected-conv"
    #: add the injections at gates and max-pools (``False``: the mean-gate network alone)
    gate_variance: ClassVar[bool] = True

    def check(self, walk: Walk, summary: MomentSummary) -> None:
        """The routing check, and refuse a parameter-free layer whose rule has no squared map."""
        super().check(walk, summary)
        if self.gate_variance:
            corrected_conv.check_squared(walk)

    def _reference(self, steps: list, summary: MomentSummary,
                   statistics: dict[str, Tensor]) -> dict[str, Any]:
        return corrected_conv.conv_reference(
            steps, summary.params0, summary.mean, summary.covariance, statistics,
            summary.input_shape, summary.config.get("injection_rank"),
            injections=self.gate_variance)

    def distance(self, walk: Walk, parts: dict[str, Any], params1: Mapping[str, Tensor]
                 ) -> Tensor:
        """½ E‖PΔz‖², mixed over components."""
        value = corrected_conv.conv_second_moment(
            parts["steps"], parts["params0"], params1, parts["reference"], parts["statistics"],
            parts["output_rows"], gate_variance=self.gate_variance)
        assert isinstance(value, Tensor)
        return (parts["weights"] * 0.5 * value.clamp_min(0)).sum()


for _evaluator in (Algorithm2(), ExactMoments(), ConvAlgorithm2(), GraphExactMoments(),
                   CorrectedGraph(), Corrected(), ConvCorrected()):
    register(_evaluator)


def as_walk(evaluator: Evaluator, layers: list[TracedLayer] | None, model: nn.Module) -> Walk:
    """What ``evaluator`` walks: the chain, or the model for a graph evaluator."""
    return model if evaluator.walks == "graph" else layers
