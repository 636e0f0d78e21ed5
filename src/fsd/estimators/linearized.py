"""LAFTR and BGLN: FSD estimators built on linearizing the activations (paper §3).

Both store θ0 plus a summary of the inputs — a coreset, or the data's mean and covariance —
and evaluate the network linearized around the reference at every nonlinearity:

- :class:`LAFTR` uses the reference network's true gates 1{s0 > 0} (a smooth activation's
  slope φ'(s0)) at every input.
- :class:`BGLN` replaces each gate by an independent Bernoulli(μ), μ the unit's firing
  frequency on the data (a smooth activation by a random secant/slope pair with the data's
  moments, :mod:`fsd.model.rules`). BGLN-S draws inputs and gates (one gate draw per sample);
  BGLN-D (``deterministic=True``) propagates means and covariances (paper Algorithm 2).

A chain of rule-tagged layers (:func:`fsd.trace`) is walked by :mod:`fsd.moments.algorithm2`. Any
other graph torch.fx traces (residual additions, concatenations, LayerNorm, attention) is
walked node by node by :mod:`fsd.model.linearize`: LAFTR linearizes every operation; BGLN-S gates
the activations (:func:`fsd.model.linearize.graph_gates`, statistics recorded at fit on
:func:`fsd.model.tracing.runnable`) and linearizes every other operation as LAFTR does. BGLN-D
propagates moments along a chain and refuses other graphs at ``fit``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..covariance import Covariance, low_rank_plus_diagonal, sample, sampling_factor
from ..metrics import check_metric, pointwise_distance
from ..model import support
from ..model.autodiff import one_line
from ..model.hooks import forward_hooks
from ..model.linearize import graph_gates, linearized_outputs, linearized_pass, true_gates
from ..model.plan import read as read_plan
from ..model.plan import trace
from ..model.rules import (
    SMOOTH_MOMENTS,
    GateFn,
    TracedLayer,
    UnsupportedModuleError,
    check_running_statistics,
    fired_pairs,
    is_gate,
)
from ..model.signature import layer_signature, model_state, parameter_signature
from ..model.tracing import runnable, unwrap
from ..moments import evaluators
from ..statistics.collector import StatisticsCollector, graph_pools
from ..statistics.coreset import Reservoir
from ..validation import (
    SummaryFormatError,
    positive_int,
    require,
    require_gate_moments,
    require_nonnegative,
    require_probabilities,
    require_psd,
    require_shape,
)
from .base import Estimator
from .batches import Data, iter_batches

INPUTS = ("coreset", "gaussian")
COVARIANCES = ("full", "diag", "lowrank")
#: BGLN-D's moment recursions (``moments=``): Algorithm 2, exact moments, the corrected recursion
MOMENTS = ("paper", "exact", "corrected")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _check_common(inputs: str, covariance: str, rank: int, num_samples: int,
                  coreset_size: int | None) -> None:
    _check_choice("inputs", inputs, INPUTS)
    _check_choice("covariance", covariance, COVARIANCES)
    positive_int("rank", rank)
    positive_int("num_samples", num_samples)
    positive_int("coreset_size", coreset_size, allow_none=True)


class _LinearizedEstimator(Estimator):
    """Shared fitting and evaluation of LAFTR and BGLN."""

    bernoulli: ClassVar[bool] = False
    reads_statistics: ClassVar[bool] = True

    _walked_by: evaluators.Evaluator | None = None  # distance_by's evaluator, while it runs

    def _signature(self, model: nn.Module) -> Any:
        layers = self._chain(model)
        if layers is not None:
            return layer_signature(layers)
        # a graph walked node by node (fsd.model.linearize) is checked by its parameters; BGLN-S's
        # also by its activations (type, hyper-parameters), whose statistics the summary
        # stores by path
        signature: list = parameter_signature(model)
        if self.bernoulli:
            signature += layer_signature(graph_gates(model))
        if self._deterministic:  # BGLN-D's graph walk routes max-pools by stored statistics
            signature += layer_signature(graph_pools(model))
        return signature

    def _chain(self, model: nn.Module) -> list[TracedLayer] | None:
        """The model's chain of layers; ``None`` for a graph walked by :mod:`fsd.model.linearize`.

        LAFTR and BGLN-S take any graph torch.fx traces; BGLN-D re-raises the chain's error.
        """
        if not self._fitted_by_graph_walk():
            try:
                return trace(model)
            except UnsupportedModuleError as error:
                if self._deterministic:  # raises unless an evaluator walks graphs
                    evaluators.check_graph(self.config, error)
        hooks = forward_hooks(model)
        if hooks:
            raise UnsupportedModuleError(
                f"the model has a {hooks[0]}: {self._name} evaluates the traced graph and "
                f"would ignore what the hook changes; remove it or "
                f"{support.advice(self._walker, support.Feature.HOOK)}") from None
        if self.bernoulli:
            graph_gates(model)  # refuses a forward fx cannot trace
        return None

    def _fitted_by_graph_walk(self) -> bool:
        """Whether this summary was fitted by the graph walk: its signature lists parameters.

        A chain's signature is one entry (a dict) per layer. A model read as a graph when the
        summary was fitted (e.g. one whose ``x.contiguous()`` earlier versions did not drop)
        is walked as a graph again, as its summary and signature were made.
        """
        signature = self._meta.get("signature")
        return bool(signature) and not isinstance(signature[0], dict)

    @property
    def _name(self) -> str:
        if not self.bernoulli:
            return "LAFTR"
        return "BGLN-D" if self._deterministic else "BGLN-S"

    @property
    def _walker(self) -> support.Walker:
        """This estimator's row of the support table (:mod:`fsd.model.support`)."""
        return support.walker_of(type(self), self.config)

    @property
    def _classwise(self) -> bool | int:
        return self.config.get("classwise", False)

    @property
    def _deterministic(self) -> bool:
        return self.config.get("deterministic", False)

    def statistics_collector(self, model: nn.Module, *, momentum: float | None = None
                             ) -> StatisticsCollector | None:
        """A collector recording what ``fit(..., statistics=...)`` needs, or ``None``.

        Attach it to the model during the last epoch of training (``with
        collector.record(labels=y)`` around each forward; labels for class-wise summaries),
        then pass it to :meth:`fit` instead of a second pass over the data. Coreset LAFTR
        needs no statistics (``None``).

        Args:
            model: the network being trained (the reference at fit time).
            momentum: gate frequencies as an exponential moving average with this momentum
                (``None``: the plain average over the recorded examples).
        """
        gaussian = self.config["inputs"] == "gaussian"
        if not (gaussian or self.bernoulli):
            return None
        # low rank is computed from the full covariance at the end of the pass
        moments = "diag" if self.config["covariance"] == "diag" else "full"
        return StatisticsCollector(
            model, moments=moments if gaussian else None, gates=self.bernoulli,
            momentum=momentum, layer_moments=self.config.get("reference") == "layerwise")

    @property
    def needs_labels(self) -> bool:
        """Whether fit and the collector need class labels (class-wise summaries)."""
        return self._classwise is not False

    # ----- fit --------------------------------------------------------------------------
    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        check_running_statistics(model)  # a graph's walk would fail on it, cryptically
        layers = self._chain(model)
        gaussian = self.config["inputs"] == "gaussian"
        needs_stats = gaussian or self.bernoulli
        own: StatisticsCollector | None = None  # a collector made here, for this data
        if statistics is not None and not needs_stats:
            raise ValueError(f"{type(self).__name__} with inputs={self.config['inputs']!r} "
                             f"keeps inputs, not statistics: pass data instead of statistics=")
        if statistics is not None and data is None and not gaussian:
            raise ValueError(f"{type(self).__name__} with inputs={self.config['inputs']!r} "
                             f"keeps a coreset of the training inputs: pass the task's data "
                             f"as well as statistics= (the statistics give the gates)")
        if statistics is not None and data is not None and gaussian:
            raise ValueError("data and statistics= were both given: this summary takes its "
                             "statistics from one of them; pass data or statistics=")
        runner = model
        if needs_stats and statistics is None:
            if self.bernoulli or self.config.get("reference") == "layerwise":
                runner = runnable(model)  # function calls in forward become hookable modules
            own = self.statistics_collector(runner)
        collector = statistics if own is None else own
        reservoir = None if gaussian else Reservoir(
            self.config["coreset_size"], torch.Generator().manual_seed(self.config["seed"]))
        if own is not None or reservoir is not None:
            labelled = self._classwise is not False
            try:
                for x, y in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                         desc=f"{type(self).__name__}: statistics"):
                    if own is not None:
                        with torch.no_grad(), own.record(labels=y if labelled else None):
                            runner(x)
                    if reservoir is not None:
                        reservoir.add(x, y)
            finally:
                if own is not None:
                    own.remove()
        groups: list[list[int]] = []
        if needs_stats:
            if not isinstance(collector, StatisticsCollector):
                raise TypeError(f"statistics= must be a fsd.StatisticsCollector, got "
                                f"{type(collector).__name__}")
            groups = self._store_statistics(collector, gaussian, dtype, device, layers)
        if self.bernoulli:
            # a chain's gate layers, or the activations of a graph (BGLN-S)
            gates = graph_gates(model) if layers is None else \
                [layer for layer in layers if layer.rule.collects == "gates"]
            ungated = [] if layers is not None else read_plan(unwrap(model)).ungated
            if ungated:
                warnings.warn(
                    f"{self._name} samples Bernoulli gates at ReLU-like and smooth activations "
                    f"only; these have no gate rule and are linearized at the reference "
                    f"instead, as LAFTR does: {', '.join(ungated)}; write a ReLU as nn.ReLU, "
                    f"F.relu or x.clamp(min=0), or register a rule with fsd.register_rule",
                    stacklevel=3)
            stored = self._gate_means()
            missing = [layer.path for layer in gates if layer.path not in stored]
            if missing:
                raise ValueError(f"the statistics hold no gate frequencies for the gate layers at "
                                 f"{missing} (a collector made with gates=False?)")
        if reservoir is not None:
            xs, ys = reservoir.tensors()
            self._state["coreset.x"] = xs
            if self._classwise is not False:
                if ys is None:
                    raise ValueError("class-conditional coreset summaries need (x, y) batches")
                lookup = {c: g for g, members in enumerate(groups) for c in members}
                unknown = sorted(set(ys.tolist()) - set(lookup))
                if unknown:
                    raise ValueError(f"coreset labels {unknown} were not in the statistics")
                self._state["coreset.group"] = torch.tensor(
                    [lookup[c] for c in ys.tolist()], dtype=torch.long, device=device)
            self._meta["input_shape"] = list(xs.shape[1:])
        if statistics is not None:  # recorded elsewhere: their widths must be this model's
            try:
                self._check_units(model, layers)
            except SummaryFormatError as error:
                raise ValueError(f"statistics= do not fit this model (recorded on another "
                                 f"one?): {error}") from None
        if self._deterministic:  # BGLN-D: the evaluator is chosen once, here
            evaluator = evaluators.choose(layers, self.config, tuple(self._meta["input_shape"]))
            self._meta["evaluator"] = evaluator.name
            # what fsd versions before evaluator names read to choose the walk
            if evaluator.name == "algorithm2-conv":
                self._meta["convolutional"] = True
            elif evaluator.name == "exact-graph":
                self._meta["graph"] = True
            evaluator.check(evaluators.as_walk(evaluator, layers, model),
                            self._moment_summary(self.reference_state()))
        elif layers is None:  # LAFTR or BGLN-S on a graph: a walk that fails fails here
            self._check_walk(model)

    def _check_walk(self, model: nn.Module) -> None:
        """Walk the graph once on one input, as ``distance`` does, or refuse in one line.

        An operation that neither forward mode nor two reverse-mode products differentiate
        (:func:`fsd.model.autodiff.jvp`) would fail every ``distance``; it fails ``fit`` instead.
        """
        x = self._state.get("coreset.x")
        if x is None:
            mean = self._state["input.mean"]
            x = torch.zeros((1, *self._meta["input_shape"]), dtype=mean.dtype,
                            device=mean.device)
        try:
            with torch.no_grad():
                linearized_outputs(model, self.reference_state(), x[:1],
                                   true_gates if self.bernoulli else None)
        except Exception as error:  # of any kind: distance() would raise it on every call
            if isinstance(error, UnsupportedModuleError):  # its message says what takes it
                raise ValueError(f"{self._name} cannot linearize this model's graph: "
                                 f"{one_line(error)}") from None
            raise ValueError(f"{self._name} cannot linearize this model's graph "
                             f"({one_line(error)}); "
                             f"{support.advice(self._walker, support.Feature.NOT_DIFFERENTIABLE)}"
                             ) from None

    def _store_statistics(self, collector: StatisticsCollector, gaussian: bool,
                          dtype: torch.dtype, device: torch.device,
                          layers: list[TracedLayer] | None) -> list[list[int]]:
        stats = collector.finalize(self._classwise)
        self._state["weights"] = stats.weights.to(device=device, dtype=dtype)
        self._meta["groups"] = stats.groups
        self._meta["input_shape"] = list(stats.input_shape)
        if gaussian:
            if stats.means is None or stats.covariances is None:
                raise ValueError("the statistics hold no input moments (collector moments=None)")
            covariances = stats.covariances
            form = self.config["covariance"]
            if form != "diag" and covariances.dim() == 2:
                raise ValueError(f"covariance={form!r} needs a collector with moments='full'")
            self._state["input.mean"] = stats.means.to(device=device, dtype=dtype)
            if form == "diag" and covariances.dim() == 3:
                covariances = covariances.diagonal(dim1=-2, dim2=-1)
            if form == "lowrank":
                factor, residual = low_rank_plus_diagonal(covariances, self.config["rank"])
                self._state["input.cov_factor"] = factor.to(device=device, dtype=dtype)
                self._state["input.cov_residual"] = residual.to(device=device, dtype=dtype)
            else:
                self._state["input.cov"] = covariances.to(device=device, dtype=dtype)
        if self.config.get("reference") == "layerwise":
            if not stats.layer_moments:
                raise ValueError("reference='layerwise' needs a collector with "
                                 "layer_moments=True")
            for path, (mean, cov) in stats.layer_moments.items():
                self._state[f"layer.{path}.mean"] = mean.to(device=device, dtype=dtype)
                self._state[f"layer.{path}.cov"] = cov.to(device=device, dtype=dtype)
        if self.bernoulli:
            for path, values in stats.gate_means.items():
                prefix = "gate_moments" if path in stats.smooth_gates else "gate"
                self._state[f"{prefix}.{path}"] = values.to(device=device, dtype=dtype)
        if self._deterministic:  # BGLN-D on a CNN routes each max-pool by these
            for path, values in stats.routing.items():
                self._state[f"routing.{path}"] = values.to(device=device, dtype=dtype)
            if self.config.get("pool_routing") == "fired" and layers is not None:
                # ReLU → MaxPool2d as one draw per window (rules.fired_routing_statistics):
                # the ReLU's gate folded into the pool's sub-stochastic routing
                for relu, pool in fired_pairs(layers):
                    gate = self._state[f"gate.{relu}"]
                    self._state[f"gate.{relu}"] = torch.ones_like(gate)
                    self._state[f"routing.{pool}"] = stats.fired_routing[pool].to(
                        device=device, dtype=dtype)
        return stats.groups

    def _check_summary(self) -> None:
        stored = self._stored
        if "coreset.x" in stored:
            x = stored["coreset.x"]
            if x.dim() < 2 or x.shape[0] == 0:
                raise SummaryFormatError(f"field 'coreset.x': shape {tuple(x.shape)}, expected "
                                         f"(examples, *features)")
            if "coreset.group" in stored:
                require_shape(stored, "coreset.group", [x.shape[0]])
            if isinstance(self._meta.get("input_shape"), list):
                require_shape(stored, "coreset.x", [x.shape[0], *self._meta["input_shape"]])
        if "weights" not in stored:
            if "coreset.x" not in stored:
                raise SummaryFormatError("field 'coreset.x' or 'weights' is missing")
            return
        weights = require_shape(stored, "weights", [None])
        groups = weights.shape[0]
        require_nonnegative(stored, "weights")
        if abs(float(weights.sum()) - 1) > 1e-4:
            raise SummaryFormatError(f"field 'weights': sums to {float(weights.sum()):.6g}, "
                                     f"expected 1")
        if self.config.get("inputs") == "gaussian":
            shape = self._meta.get("input_shape")
            # the mean is the flattened input: its width is fixed by the recorded input shape
            width = math.prod(shape) if isinstance(shape, list) and all(
                isinstance(n, int) for n in shape) else None
            d = require_shape(stored, "input.mean", [groups, width]).shape[1]
            form = self.config["covariance"]
            if form == "lowrank":
                require_shape(stored, "input.cov_factor", [groups, d, None])
                require_shape(stored, "input.cov_residual", [groups, d])
                require_nonnegative(stored, "input.cov_residual")
            elif form == "diag":
                require_shape(stored, "input.cov", [groups, d])
                require_nonnegative(stored, "input.cov")
            else:
                require_shape(stored, "input.cov", [groups, d, d])
                require_psd(stored, "input.cov")
        if self._deterministic:
            evaluators.recorded(self._meta, self.config)  # raises for an unknown or wrong one
        for key in [k for k in stored if k.startswith("layer.") and k.endswith(".mean")]:
            h = require_shape(stored, key, [groups, None]).shape[1]
            cov = key[:-len(".mean")] + ".cov"
            require_shape(stored, cov, [groups, h, h])
            require_psd(stored, cov)
        for key in [k for k in stored if k.startswith("gate.")]:
            # one frequency per unit: (groups, h) after a Linear, (groups, C, H, W) after a conv
            gate = require(stored, key)
            require_shape(stored, key, [groups] + [None] * max(gate.dim() - 1, 1))
            require_probabilities(stored, key)
        for key in [k for k in stored if k.startswith("routing.")]:
            # (groups, C, H', W', k·k): each window's routing frequencies sum to 1
            require_shape(stored, key, [groups, None, None, None, None])
            require_probabilities(stored, key)
            total = stored[key].to(torch.float64).sum(-1)
            # fired routing (pool_routing="fired") sums to the window's firing frequency
            if self.config.get("pool_routing") == "fired":
                if bool((total > 1 + 1e-4).any()):
                    raise SummaryFormatError(f"field {key!r}: a window's routing frequencies "
                                             f"sum to more than 1")
            elif bool(((total - 1).abs() > 1e-4).any()):
                raise SummaryFormatError(f"field {key!r}: a window's routing frequencies do "
                                         f"not sum to 1")
        for key in [k for k in stored if k.startswith("gate_moments.")]:
            gate = require(stored, key)
            require_shape(stored, key, [groups] + [None] * max(gate.dim() - 2, 1)
                          + [SMOOTH_MOMENTS])
            require_gate_moments(stored, key)
        # statistics are keyed by call site (a module path, or a call's graph node name,
        # fsd.model.tracing.call_site_paths), and the signature records every call site's path
        signature = self._meta.get("signature")
        sites = {e.get("path") for e in signature if isinstance(e, dict)} \
            if isinstance(signature, list) else set()
        for key in [k for k in stored if k.startswith(("gate.", "gate_moments.", "routing."))]:
            if key.split(".", 1)[1] not in sites:
                raise SummaryFormatError(f"field {key!r}: the stored architecture has no "
                                         f"layer or call site '{key.split('.', 1)[1]}'")

    # ----- distance ---------------------------------------------------------------------
    def _gate_means(self) -> dict[str, Tensor]:
        """Stored gate statistics by path: firing frequencies, or a smooth gate's moments."""
        return {k.split(".", 1)[1]: v for k, v in self._state.items()
                if k.startswith(("gate.", "gate_moments."))}

    def _routing(self) -> dict[str, Tensor]:
        """Stored max-pool routing frequencies by path (BGLN-D on CNNs)."""
        return {k[len("routing."):]: v for k, v in self._state.items()
                if k.startswith("routing.")}

    def _generator(self, device: torch.device) -> torch.Generator:
        if "generator" not in self._cache:
            self._cache["generator"] = torch.Generator(device=device).manual_seed(
                self.config["seed"])
        return self._cache["generator"]

    def _inputs(self) -> tuple[Tensor, Tensor, Tensor]:
        """Inputs, their mixture component, and their weight in the estimate."""
        if self.config["inputs"] == "coreset":
            x = self._state["coreset.x"]
            n = x.shape[0]
            group = self._state.get("coreset.group")
            if group is None:
                group = torch.zeros(n, dtype=torch.long, device=x.device)
            # weights in θ0's dtype: stored token ids are integers, and 1/n is not
            dtype = next(v.dtype for k, v in self._state.items() if k.startswith("theta0.")
                         and v.is_floating_point())
            return x, group, torch.full((n,), 1.0 / n, dtype=dtype, device=x.device)
        mean, weights = self._state["input.mean"], self._state["weights"]
        generator = self._generator(mean.device)
        cov = self.input_covariance()
        if not isinstance(cov, tuple) and cov.dim() == 3 and "factors" not in self._cache:
            self._cache["factors"] = [sampling_factor(c) for c in cov]
        shape = tuple(self._meta["input_shape"])
        xs, groups, sample_weights = [], [], []
        # stratified over mixture components: unbiased, lower variance than drawing classes
        for g in range(mean.shape[0]):
            n = max(1, round(self.config["num_samples"] * float(weights[g])))
            component = (cov[0][g], cov[1][g]) if isinstance(cov, tuple) else cov[g]
            factor = self._cache["factors"][g] if "factors" in self._cache else None
            x = sample(mean[g], component, n, generator, full_factor=factor)
            xs.append(x.reshape(n, *shape))
            groups.append(torch.full((n,), g, dtype=torch.long, device=mean.device))
            sample_weights.append(weights[g].expand(n) / n)
        return torch.cat(xs), torch.cat(groups), torch.cat(sample_weights)

    def input_covariance(self) -> Covariance:
        """The stored input covariance (Gaussian inputs) in the current placement.

        A full (G, d, d) or diagonal (G, d) tensor, or for ``covariance="lowrank"`` the pair
        ``(factor (G, d, r), residual (G, d))`` (see :mod:`fsd.covariance`).
        """
        if "input.cov_factor" in self._state:
            return self._state["input.cov_factor"], self._state["input.cov_residual"]
        return self._state["input.cov"]

    def _sampled_gates(self, group: Tensor) -> GateFn:
        """BGLN-S's gate callback: (r·s0 + φ(0), g) with (r, g) drawn per sample and unit.

        Args:
            group: each sample's mixture component, whose stored statistics it draws from.
        """
        gate_means = self._gate_means()
        generator = self._generator(group.device)

        def gate(layer: TracedLayer, s0: Tensor) -> tuple[Tensor, Tensor]:
            # one independent draw per sample and unit, from that sample's component
            rule, module = layer.rule, layer.module
            assert is_gate(rule)  # called at gate layers only
            r, g = rule.sample_gates(module, gate_means[layer.path][group], generator)
            return r * s0 + rule.gate_offset(module), g
        return gate

    def _check_units(self, model: nn.Module, layers: list[TracedLayer] | None) -> None:
        """The stored gate statistics against the model's activations, once per placement.

        A summary records its model's parameter shapes but not those of its hidden units, so
        the reference network is run here on one (zero) input, recording the shape at every
        gate: a missing gate statistic, or one of another width (which would broadcast and
        give another distance), raises :class:`SummaryFormatError` before any computation.
        """
        if not self.bernoulli or self._cache.get("units_checked"):
            return
        mean = self._state.get("input.mean", self._state.get("coreset.x"))
        if mean is None or not isinstance(self._meta.get("input_shape"), list):
            return
        probe = torch.zeros((1, *self._meta["input_shape"]), dtype=mean.dtype,
                            device=mean.device)
        units: dict[str, tuple[int, ...]] = {}

        def record(layer: TracedLayer, s0: Tensor) -> tuple[Tensor, Tensor]:
            units[layer.path] = tuple(s0.shape[1:])
            return true_gates(layer, s0)

        with torch.no_grad():
            linearized_pass(model, layers, self.reference_state(), probe, record)
        groups = self._state["weights"].shape[0] if "weights" in self._state else 1
        for path, shape in units.items():
            if f"gate_moments.{path}" in self._state:
                key, expected = f"gate_moments.{path}", (groups, *shape, SMOOTH_MOMENTS)
            else:
                key, expected = f"gate.{path}", (groups, *shape)
            if key not in self._state:
                raise SummaryFormatError(f"field {key!r} is missing: the summary holds no "
                                         f"statistics of the activation at '{path}'")
            if tuple(self._state[key].shape) != expected:
                raise SummaryFormatError(f"field {key!r}: shape {tuple(self._state[key].shape)}"
                                         f", the model's units at '{path}' need {expected}")
        self._cache["units_checked"] = True

    def _distance(self, model: nn.Module) -> Tensor:
        layers = self._chain(model)
        self._check_units(model, layers)
        if self._deterministic:
            other = self._walked_by
            evaluator = self._evaluator if other is None else other
            if evaluator.walks == "chain" and layers is None:
                what = ("the summary records the" if other is None  # a hand-edited summary
                        else "distance_by was given the")
                raise SummaryFormatError(f"{what} {evaluator.name!r} evaluator, which walks "
                                         f"chains; this model is not one")
            walk = evaluators.as_walk(evaluator, layers, model)
            if other is None:
                parts = self.moment_parts(walk, self.reference_state())
            else:  # not cached: the cache holds the recorded evaluator's parts
                summary = self._moment_summary(self.reference_state())
                other.check(walk, summary)
                parts = other.prepare(walk, summary)
            return evaluator.distance(walk, parts, model_state(model))
        x, group, sample_weights = self._inputs()
        gate = self._sampled_gates(group) if self.bernoulli else None
        z0, dz = linearized_pass(model, layers, self.reference_state(), x, gate)
        rho = pointwise_distance(self.config["metric"], self._select(z0).detach(),
                                 self._select(dz))
        return (sample_weights * rho).sum()

    def _layer_moments(self) -> dict[str, tuple[Tensor, Tensor]] | None:
        if self.config.get("reference") != "layerwise":
            return None
        paths = [k[len("layer."):-len(".mean")] for k in self._state
                 if k.startswith("layer.") and k.endswith(".mean")]
        return {p: (self._state[f"layer.{p}.mean"], self._state[f"layer.{p}.cov"]) for p in paths}

    @property
    def _evaluator(self) -> evaluators.Evaluator:
        """BGLN-D's evaluator, as the summary records it (:mod:`fsd.moments.evaluators`)."""
        return evaluators.recorded(self._meta, self.config)

    def _moment_summary(self, params0: dict[str, Tensor]) -> evaluators.MomentSummary:
        return evaluators.MomentSummary(
            params0=params0, mean=self._state["input.mean"],
            covariance=self.input_covariance(), gate_means=self._gate_means(),
            routing=self._routing(), layer_moments=self._layer_moments(),
            weights=self._state["weights"], input_shape=tuple(self._meta["input_shape"]),
            select=self._select, config=self.config)

    def moment_parts(self, walk: list[TracedLayer] | nn.Module, params0: dict[str, Tensor]
                     ) -> dict[str, Any]:
        """What BGLN-D needs besides θ: fixed after fit, so computed once and cached.

        Args:
            walk: the traced model (:func:`fsd.trace`), or the model itself where the
                summary's evaluator walks graphs (``"exact-graph"``).
            params0: θ0 with its buffers, :meth:`reference_state` (the parts are cached per
                placement and serve every later ``distance``: pass that).

        Returns:
            The evaluator's prepared parts (:meth:`fsd.moments.evaluators.Evaluator.prepare`): for
            the chain evaluators ``{"reference", "gate_means", "output_rows", "weights",
            "params0"}`` — the reference-side moments, the gate statistics by path, the rows
            selecting the fitted outputs, the mixture weights and θ0.
            :class:`fsd.SummarySet` stacks these to batch several summaries.
        """
        if "moment_parts" not in self._cache:
            self._cache["moment_parts"] = self._evaluator.prepare(
                walk, self._moment_summary(params0))
        return self._cache["moment_parts"]


class LAFTR(_LinearizedEstimator):
    """Linearized activations with the reference network's true gates (paper §3.1).

    Exact for networks without nonlinearities (given all data as the coreset).

    Args:
        inputs: ``"coreset"`` — a stored random subset of the data; ``"gaussian"`` —
            samples from a Gaussian with the stored data mean and covariance.
        covariance: ``"full"``, ``"diag"`` or ``"lowrank"`` (Gaussian inputs only).
        rank: eigenpairs kept by ``covariance="lowrank"`` (plus a diagonal residual).
        coreset_size: inputs kept by ``"coreset"`` (default 40, the paper's coreset for
            MNIST-sized tasks); ``None`` keeps all the data.
        num_samples: Gaussian samples per ``distance`` call.
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"``.
        seed: seeds coreset selection and sampling.
    """

    def __init__(self, inputs: str = "coreset", covariance: str = "full", rank: int = 64,
                 coreset_size: int | None = 40, num_samples: int = 128,
                 metric: str = "euclidean", seed: int = 0) -> None:
        _check_common(inputs, covariance, rank, num_samples, coreset_size)
        super().__init__(inputs=inputs, covariance=covariance, rank=int(rank),
                         coreset_size=coreset_size,
                         num_samples=int(num_samples), metric=check_metric(metric), seed=seed)


class BGLN(_LinearizedEstimator):
    """Bernoulli-gated linear network (paper §3.2–3.5): BGLN-S and BGLN-D.

    ReLU-family activations get Bernoulli gates; smooth ones (GELU, SiLU, Tanh, Sigmoid, ELU,
    Softplus) a random secant/slope pair with the moments measured at fit (:mod:`fsd.model.rules`).

    BGLN-S takes any model LAFTR takes: a chain of layers with rules, or any graph torch.fx
    traces (residual additions, ``torch.cat``, LayerNorm, attention, …), where it gates the
    activations — modules with a gate rule and ``F.relu``/``F.gelu``/``torch.tanh``/… calls,
    whose statistics ``fit`` stores by module path or graph node name — and linearizes every
    other operation like LAFTR (:mod:`fsd.model.linearize`). An activation or max-pool module called
    at several places has statistics per call, keyed by the call's graph node name
    (:func:`fsd.model.tracing.call_site_paths`). BGLN-D with ``moments="paper"`` or
    ``"corrected"`` walks chains, CNNs included; with ``moments="exact"`` MLP chains and graphs
    of flat layers — residual additions, concatenations — (:mod:`fsd.moments.exact_graph`).

    Args:
        deterministic: ``False`` — BGLN-S, Monte Carlo over inputs and gates;
            ``True`` — BGLN-D, moment propagation (Euclidean metric, Gaussian inputs; on
            convolutional networks Algorithm 2 or the corrected recursion,
            :mod:`fsd.moments.algorithm2_conv`, :mod:`fsd.moments.corrected_conv`).
        inputs: ``"gaussian"`` (stored mean/covariance) or ``"coreset"`` (stored inputs with
            Bernoulli gates; BGLN-S only).
        covariance: ``"lowrank"`` (the default: top-``rank`` eigenpairs plus a diagonal
            residual, memory d·(rank + 1); within 0.15 % of ``"full"`` on MNIST at rank 32
            in a sixth of the bytes, ``benchmarks/defaults.py``), ``"full"`` (d², the
            paper's) or ``"diag"`` (the paper's "Var" variant).
        rank: eigenpairs kept by ``covariance="lowrank"`` (default 32).
        moments: BGLN-D only. ``"paper"`` — Algorithm 2 (drops Cov(a0, Δa) and the gates'
            variance; under optimisation its estimate collapses, see the user guide);
            ``"exact"`` — joint raw second moments of (a0, Δa) propagated exactly, equal to
            the expectation of BGLN-S (:mod:`fsd.moments.exact`; MLPs, the reference);
            ``"corrected"`` — the mean-gate network plus the gates' variance injected at
            every gate and max-pool, carried diagonally (:mod:`fsd.moments.corrected`; MLPs
            and CNNs): within 0.1 % of exact moments on MLPs at a fraction of their cost,
            the recommended deterministic form.
        reference: BGLN-D only. ``"propagated"`` — reference-side moments pushed through the
            gated network from the input moments; ``"layerwise"`` — the reference network's
            real input mean and covariance stored at every affine layer at ``fit``.
        classwise: ``False``; ``True`` — one mixture component per class (moments and gate
            frequencies per class, mixed by class frequency; the paper's CW variant); an int
            k — sorted class labels grouped into k contiguous clusters.
        coreset_size: inputs kept by ``"coreset"`` (default 40, the paper's coreset for
            MNIST-sized tasks); ``None`` keeps all the data.
        num_samples: Gaussian samples per ``distance`` call (BGLN-S).
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"`` (BGLN-D: euclidean only).
        seed: seeds coreset selection and sampling.
    """

    bernoulli = True

    def distance_by(self, model: nn.Module, evaluator: str) -> Tensor:
        """:meth:`distance` from the same stored statistics, walked by another evaluator.

        BGLN-D only. The summary's θ0, input moments and gate statistics, turned into a
        distance by ``evaluator`` (one of :func:`fsd.moments.evaluators.names`, e.g.
        ``"exact"``, ``"algorithm2"``, ``"corrected"``) instead of the evaluator it records:
        how much of an estimate is the walk's and not the statistics', e.g. at a network
        trained against one walk (``fsd cl gap --evaluators``). The walk's fixed parts are
        prepared anew at every call (not cached).

        Raises:
            ValueError: a BGLN-S summary, or an unknown evaluator name.
            UnsupportedModuleError: the evaluator cannot walk this model.
        """
        if not self._deterministic:
            raise ValueError("distance_by walks BGLN-D's moments; this summary is BGLN-S "
                             "(deterministic=False)")
        self._walked_by = evaluators.get(evaluator)
        try:
            return self.distance(model)
        finally:
            self._walked_by = None

    def __init__(self, deterministic: bool = False, inputs: str = "gaussian",
                 covariance: str = "lowrank", rank: int = 32, moments: str = "paper",
                 reference: str = "propagated", classwise: bool | int = False,
                 coreset_size: int | None = 40, num_samples: int = 128,
                 metric: str = "euclidean", seed: int = 0) -> None:
        _check_common(inputs, covariance, rank, num_samples, coreset_size)
        check_metric(metric)
        if deterministic and metric != "euclidean":
            raise ValueError(f"BGLN-D (deterministic=True) computes the Euclidean metric only; "
                             f"got metric={metric!r}. Use deterministic=False for it.")
        _check_choice("moments", moments, MOMENTS)
        _check_choice("reference", reference, ("propagated", "layerwise"))
        if moments == "corrected" and reference != "propagated":
            raise ValueError("moments='corrected' pushes the reference side's moments through "
                             "the network itself; reference='layerwise' applies to "
                             "moments='paper' or 'exact'")
        if not deterministic and (moments != "paper" or reference != "propagated"):
            raise ValueError("moments= and reference= choose how BGLN-D (deterministic=True) "
                             "propagates moments; BGLN-S samples and already has the exact "
                             "expectation of moments='exact'")
        if deterministic and inputs != "gaussian":
            raise ValueError("BGLN-D (deterministic=True) propagates input moments: use "
                             "inputs='gaussian'")
        if not isinstance(classwise, bool) and (not isinstance(classwise, int) or classwise < 1):
            raise ValueError(f"classwise must be True, False or a positive int, got {classwise!r}")
        super().__init__(deterministic=bool(deterministic), inputs=inputs, covariance=covariance,
                         rank=int(rank), moments=moments, reference=reference,
                         classwise=classwise, coreset_size=coreset_size,
                         num_samples=int(num_samples), metric=metric, seed=seed)
