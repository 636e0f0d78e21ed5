"""Streaming, mergeable statistics that parametric summaries are built from.

- :class:`MomentAccumulator`: mean and (full or diagonal) covariance of flattened inputs,
  accumulated in float64 with Chan et al.'s pairwise update, so batches and shards merge exactly.
- :class:`GateAccumulator`: Bernoulli means μ = fraction of examples for which each unit's
  pre-activation is > 0 (per unit; for conv, per channel × position) — or, for a smooth activation,
  the means of its gate pair's moments (:meth:`fsd.model.rules.GateRule.gate_statistics`) — as a
  running mean or an exponential moving average.
- :class:`StatisticsCollector`: hooks a model so both are collected while it runs — during
  :meth:`fsd.BGLN.fit` or during the last epoch of training, as the paper does — optionally
  per class.
"""

from __future__ import annotations

import contextlib
import warnings
from dataclasses import dataclass, field
from typing import Iterator, Sequence

import numpy as np
import torch
from torch import Tensor, nn

from ..model.hooks import recording_hook
from ..model.linearize import graph_gates
from ..model.plan import read, trace
from ..model.rules import RULES, TracedLayer, UnsupportedModuleError, is_gate, is_pool
from ..model.tracing import unwrap
from . import distributed


class MomentAccumulator:
    """Running mean and covariance of vectors, in float64.

    Args:
        diagonal: keep only per-feature variances (memory d instead of d²).
    """

    def __init__(self, diagonal: bool = False) -> None:
        self.diagonal = diagonal
        self.count = 0
        self.mean: Tensor | None = None
        self._m2: Tensor | None = None  # Σ (x − mean)(x − mean)ᵀ, or its diagonal

    def update(self, x: Tensor) -> None:
        """Add a batch of vectors, shape (n, d)."""
        if x.shape[0] == 0:
            return
        x = x.detach().to(torch.float64)
        n = x.shape[0]
        mean = x.mean(0)
        centered = x - mean
        m2 = centered.pow(2).sum(0) if self.diagonal else centered.T @ centered
        self._merge(n, mean, m2)

    def merge(self, other: "MomentAccumulator") -> "MomentAccumulator":
        """Fold another accumulator's data into this one (exact); returns ``self``."""
        if other.diagonal != self.diagonal:
            raise ValueError("cannot merge diagonal and full moment accumulators")
        if other.count and other.mean is not None and other._m2 is not None:
            self._merge(other.count, other.mean, other._m2)
        return self

    def _merge(self, n: int, mean: Tensor, m2: Tensor) -> None:
        # count == 0 exactly when mean and _m2 are None
        if self.count == 0 or self.mean is None or self._m2 is None:
            self.count, self.mean, self._m2 = n, mean.clone(), m2.clone()
            return
        if mean.shape != self.mean.shape:
            raise ValueError(f"feature size changed: {tuple(self.mean.shape)} vs "
                             f"{tuple(mean.shape)}")
        total = self.count + n
        delta = (mean - self.mean).to(self.mean.device)
        correction = delta.pow(2) if self.diagonal else torch.outer(delta, delta)
        # in place (the first merge cloned _m2): a fresh d×d buffer per batch cost page faults;
        # the same additions in the same order, so the same bits
        self._m2.add_(m2.to(self._m2.device)).add_(correction.mul_(self.count * n / total))
        self.mean = self.mean + delta * (n / total)
        self.count = total

    def covariance(self) -> Tensor:
        """Population covariance (divides by n).

        It is the second moment of the empirical distribution, which is what FSD over the
        data is an expectation under.
        """
        if self.count == 0 or self._m2 is None:
            raise ValueError("no data was accumulated")
        return self._m2 / self.count


class GateAccumulator:
    """Fraction of examples for which each unit's pre-activation is positive.

    Args:
        momentum: ``None`` for the exact running mean over every example seen; a float in
            [0, 1) for an exponential moving average μ ← momentum·μ + (1 − momentum)·μ_batch
            (momentum = weight kept on the past).
    """

    def __init__(self, momentum: float | None = None) -> None:
        if momentum is not None and not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1) or None, got {momentum}")
        self.momentum = momentum
        self.count = 0
        self._value: Tensor | None = None  # running mean or EMA, float64

    def update(self, preactivation: Tensor) -> None:
        """Add a batch of pre-activations, shape (n, *units)."""
        self.add((preactivation.detach() > 0).to(torch.float64))

    def add(self, values: Tensor) -> None:
        """Add per-example values to average, shape (n, …) (e.g. a smooth gate's moments)."""
        n = values.shape[0]
        if n == 0:
            return
        batch = values.detach().to(torch.float64).mean(0)
        if self._value is None:
            self._value = batch
        elif self.momentum is None:
            self._value = self._value + (batch - self._value) * (n / (self.count + n))
        else:
            self._value = self.momentum * self._value + (1.0 - self.momentum) * batch
        self.count += n

    def merge(self, other: "GateAccumulator") -> "GateAccumulator":
        """Fold another accumulator in, weighting by example counts; returns ``self``."""
        # count == 0 exactly when _value is None
        if other.count == 0 or other._value is None:
            return self
        if self.count == 0 or self._value is None:
            self._value, self.count = other._value.clone(), other.count
            return self
        total = self.count + other.count
        self._value = self._value + (other._value.to(self._value.device) - self._value) * (
            other.count / total)
        self.count = total
        return self

    @property
    def value(self) -> Tensor:
        """The averages: Bernoulli means μ, float64, shape (*units) (or what :meth:`add` got)."""
        if self._value is None:
            raise ValueError("no pre-activations were accumulated")
        return self._value


@dataclass
class Statistics:
    """Finished statistics of a mixture with G components (G = 1 unless class-conditional).

    Attributes:
        weights: mixing weights (G,), the components' shares of the data.
        means: input means (G, d) of flattened inputs, or ``None``.
        covariances: (G, d, d), or variances (G, d) for a diagonal model, or ``None``.
        gate_means: per gate path, Bernoulli means (G, *units) — or for the paths in
            ``smooth_gates`` the moments E[r], E[g], E[r²], E[rg], E[g²] (G, *units, 5) —
            or empty.
        groups: for each component, the class labels it pools (empty when not class-wise).
        input_shape: shape of one input example.
        layer_moments: per affine layer after the first, the (means (G, o), covariances
            (G, o, o)) of the reference network's real inputs to it (``layer_moments=True``).
        smooth_gates: the gate paths whose ``gate_means`` are a smooth gate's moments.
        routing: per MaxPool2d path, how often each position of each window was its argmax,
            (G, C, H', W', k·k) (:func:`fsd.model.rules.routing_statistics`; with gates).
        fired_routing: per MaxPool2d path, how often each position was the argmax with a
            positive maximum (:func:`fsd.model.rules.fired_routing_statistics`), same shape.
    """

    weights: Tensor
    means: Tensor | None
    covariances: Tensor | None
    gate_means: dict[str, Tensor]
    groups: list[list[int]]
    input_shape: tuple[int, ...]
    layer_moments: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)
    smooth_gates: list[str] = field(default_factory=list)
    routing: dict[str, Tensor] = field(default_factory=dict)
    fired_routing: dict[str, Tensor] = field(default_factory=dict)


def group_classes(classes: Sequence[int], classwise: bool | int) -> list[list[int]]:
    """Partition sorted class labels into mixture components.

    ``True``: one component per class. An int k: the sorted labels split into k contiguous,
    near-equal chunks (k ≥ number of classes gives one per class). ``False``: all pooled.
    """
    classes = sorted(int(c) for c in classes)
    if classwise is False:
        return [classes]
    if classwise is True:
        return [[c] for c in classes]
    k = int(classwise)
    if k < 1:
        raise ValueError(f"classwise must be True, False or a positive int, got {classwise}")
    return [list(map(int, chunk)) for chunk in np.array_split(classes, min(k, len(classes)))]


_POOLED = -1  # key for examples recorded without labels


class StatisticsCollector:
    """Collect data moments and gate statistics from a model's own forward passes.

    Hooks are installed on construction and only record inside :meth:`record`, so other
    forward passes (evaluation, penalties) are not counted. Typical use, during the last
    training epoch::

        stats = fsd.StatisticsCollector(model)
        for x, y in loader:
            with stats.record(labels=y):
                loss = loss_fn(model(x), y)
            ...
        est = fsd.BGLN(classwise=True).fit(model, statistics=stats)

    Args:
        model: the network: a chain of supported layers (``nn.Sequential`` or a class), or,
            for gate statistics alone (BGLN-S), any graph torch.fx traces — a residual
            network too. Activations must be modules here (a ``F.relu`` call cannot be
            hooked: :meth:`fsd.BGLN.fit` with data runs :func:`fsd.model.tracing.runnable` instead).
            An activation or max-pool module called at several places (torchvision's
            ``self.relu``) records each call under its own call site's path
            (:func:`fsd.model.tracing.call_site_paths`), counting its calls from each forward of
            ``model``.
        moments: collect input moments (``"full"``, ``"diag"``) or not (``None``).
        gates: collect gate statistics (ReLU-family firing frequencies, smooth gates' moments).
        momentum: ``None`` (running mean) or EMA momentum for the gates.
        layer_moments: also collect the mean and covariance of the input to every affine
            layer after the first (for ``BGLN(reference="layerwise")``).
    """

    def __init__(self, model: nn.Module, *, moments: str | None = "full", gates: bool = True,
                 momentum: float | None = None, layer_moments: bool = False) -> None:
        if moments not in ("full", "diag", None):
            raise ValueError(f"moments must be 'full', 'diag' or None, got {moments!r}")
        self.moments = moments
        self.momentum = momentum
        self.input_shape: tuple[int, ...] | None = None
        self._moment_acc: dict[int, MomentAccumulator] = {}
        self._gate_acc: dict[int, dict[str, GateAccumulator]] = {}
        self._layer_acc: dict[int, dict[str, MomentAccumulator]] = {}
        self._counts: dict[int, int] = {}  # examples per key, where nothing else counts them
        self._labels: Tensor | None = None
        self._active = False
        self._handles = []
        self._model = model
        self._warned_batch_norm = False
        # moments alone need no layers (any model: LAFTR with Gaussian inputs)
        layers: list[TracedLayer] = []
        if gates or layer_moments:
            try:
                layers = trace(model)
            except UnsupportedModuleError:
                if layer_moments:  # BGLN-D's layer-wise moments: chains only
                    raise
                # a graph that is not a chain (BGLN-S): its activations wherever they are,
                # one per call site, and its max-pools (BGLN-D's corrected graph walk)
                layers = graph_gates(model) + graph_pools(model)
        # what each layer's rule collects (fsd.model.rules.Rule.collects)
        gate_layers = ([layer for layer in layers if layer.rule.collects == "gates"]
                       if gates else [])
        self.gate_paths = [layer.path for layer in gate_layers]
        self.smooth_gates = [layer.path for layer in gate_layers
                             if is_gate(layer.rule) and layer.rule.smooth]
        # max-pools are BGLN-D's other gate: how each window routes, on the data
        pool_layers = ([layer for layer in layers if layer.rule.collects == "routing"]
                       if gates else [])
        self.pool_paths = [layer.path for layer in pool_layers]
        self._rules = {layer.path: layer.rule for layer in gate_layers + pool_layers}
        if moments is not None:
            self._handles.append(model.register_forward_pre_hook(
                recording_hook(self._input_hook_fn())))
        modules = dict(unwrap(model).named_modules())
        self.layer_paths = ([layer.path for layer in layers
                             if layer.rule.collects == "layer_moments"][1:]
                            if layer_moments else [])
        # a layer is recorded by a hook on its module: a function call has none
        owned = {id(m) for m in modules.values()}
        functional = [layer.path for layer in gate_layers + pool_layers
                      if id(layer.module) not in owned] + \
            [p for p in self.layer_paths if p not in modules]
        if functional:
            raise UnsupportedModuleError(
                f"the layer at '{functional[0]}' is a function call in "
                f"{type(unwrap(model)).__name__}.forward; StatisticsCollector records at "
                f"modules: use the module form (e.g. nn.ReLU()), or fit(model, data), which "
                f"traces the model")
        for path in self.layer_paths:
            self._handles.append(modules[path].register_forward_pre_hook(self._layer_hook(path)))
        # one hook per module; a module called at several places (trace() and graph_gates()
        # admit parameter-free ones) records its k-th call of a forward under the k-th call
        # site's path, in graph order
        sites: dict[int, tuple[nn.Module, list[str]]] = {}
        for layer in gate_layers + pool_layers:
            sites.setdefault(id(layer.module), (layer.module, []))[1].append(layer.path)
        self._calls: dict[int, int] = {}  # calls so far in this forward, per reused module
        for module, paths in sites.values():
            self._handles.append(module.register_forward_pre_hook(self._averaging_hook(
                paths, self._rules[paths[0]].fit_statistics)))
        if any(len(paths) > 1 for _, paths in sites.values()):
            self._handles.append(model.register_forward_pre_hook(
                recording_hook(self._new_forward_fn())))
        if moments is None and not sites:
            # nothing above records an example (BGLN-S with coreset inputs on a model without
            # activations — an LSTM classifier, a linear model): the examples and their
            # classes are still counted, for the mixture weights and the class groups
            self._handles.append(model.register_forward_pre_hook(
                recording_hook(self._count_hook_fn()), with_kwargs=True))

    @contextlib.contextmanager
    def record(self, labels: Tensor | None = None) -> Iterator[None]:
        """Record statistics of forward passes run inside this block.

        Args:
            labels: class labels of the batch (needed for class-conditional summaries).

        Warns (once per collector) when a BatchNorm layer of the model is in training mode:
        it then normalises with each batch's own statistics, so what is recorded describes
        another function than the one the estimators evaluate (:meth:`fsd.Estimator.fit`
        and ``distance`` read the model in eval mode, with the running statistics).
        """
        self._begin(labels, stacklevel=5)  # the warning points at the caller's with-statement
        try:
            yield
        finally:
            self.stop()

    def start(self, labels: Tensor | None = None) -> None:
        """Record the forward passes from now until :meth:`stop`: :meth:`record` unrolled.

        For callbacks that see a forward pass from two hooks (a framework's
        ``before_forward`` and ``after_forward``) rather than around it. A second ``start``
        before ``stop`` only replaces the labels.

        Args:
            labels: class labels of the batch(es) that follow (for class-conditional
                summaries); one start per batch when they change.
        """
        self._begin(labels, stacklevel=4)

    def _begin(self, labels: Tensor | None, stacklevel: int) -> None:
        if not self._warned_batch_norm:
            self._warn_training_batch_norm(stacklevel)
        self._active, self._labels = True, labels

    def stop(self) -> None:
        """Stop recording (what :meth:`start` began); nothing happens if it was not recording."""
        self._active, self._labels = False, None

    @property
    def recording(self) -> bool:
        """Whether forward passes are recorded now (in :meth:`record`, or after :meth:`start`)."""
        return self._active

    def _warn_training_batch_norm(self, stacklevel: int) -> None:
        training = [name or type(m).__name__ for name, m in unwrap(self._model).named_modules()
                    if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training
                    and m.track_running_stats]
        if training:
            self._warned_batch_norm = True
            # a warning, not an error: recording in the last training epoch is the paper's
            # protocol and the batch statistics approach the running ones as training settles
            warnings.warn(f"StatisticsCollector.record: the BatchNorm layer(s) {training[:3]} "
                          f"are in training mode, so the statistics recorded are of "
                          f"batch-normalised passes, not of the model in eval mode that the "
                          f"estimators measure; "
                          f"record under model.eval() (a pass over the data after training) or "
                          f"fit(model, data)", stacklevel=stacklevel)

    def remove(self) -> None:
        """Remove the hooks from the model (statistics are kept)."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> "StatisticsCollector":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _split(self, batch: Tensor) -> Iterator[tuple[int, Tensor]]:
        labels = self._labels
        if labels is None:
            yield _POOLED, batch
            return
        labels = labels.to(batch.device)
        if labels.shape[0] != batch.shape[0]:
            raise ValueError(f"{labels.shape[0]} labels for a batch of {batch.shape[0]}")
        # -1 is the pooled key, and a fractional label would name a class that is not one
        if labels.dim() != 1 or (labels.is_floating_point()
                                 and not bool((labels == labels.round()).all())):
            raise ValueError(f"class labels must be one integer per example, got shape "
                             f"{tuple(labels.shape)} and dtype {labels.dtype}")
        if bool((labels < 0).any()):
            raise ValueError(f"class labels must be non-negative, got {int(labels.min())}")
        for c in torch.unique(labels).tolist():
            yield int(c), batch[labels == c]

    def _input_hook_fn(self):
        # a plain function (a bound method cannot carry the recording mark)
        def hook(module: nn.Module, args: tuple) -> None:
            self._input_hook(module, args)
        return hook

    def _input_hook(self, module: nn.Module, args: tuple) -> None:
        if not self._active:
            return
        x = args[0]
        if x.shape[0] == 0:
            return
        if self.input_shape is None:
            self.input_shape = tuple(x.shape[1:])
        flat = x.detach().reshape(x.shape[0], -1)
        for key, part in self._split(flat):
            acc = self._moment_acc.setdefault(key, MomentAccumulator(self.moments == "diag"))
            acc.update(part)

    def _count_hook_fn(self):
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            if not self._active:
                return
            # the batch: the first tensor argument (a model called with keywords only too)
            x = next((a for a in (*args, *kwargs.values()) if isinstance(a, Tensor)), None)
            if x is None or x.dim() == 0 or x.shape[0] == 0:
                return
            if self.input_shape is None:
                self.input_shape = tuple(x.shape[1:])
            for key, part in self._split(x):
                self._counts[key] = self._counts.get(key, 0) + part.shape[0]
        return hook

    def _new_forward_fn(self):
        # a forward of the model starts: reused modules count their calls from the first
        def hook(module: nn.Module, args: tuple) -> None:
            self._calls.clear()
        return hook

    def _averaging_hook(self, paths: list[str], values):
        """A hook averaging ``values(module, input)`` per example into a path's accumulator.

        ``paths``: the module's call sites in graph order; its k-th call in a forward of the
        model records under ``paths[k]`` (one path: every call).
        """
        def hook(module: nn.Module, args: tuple) -> None:
            if not self._active:
                return
            path = paths[0]
            if len(paths) > 1:
                call = self._calls.get(id(module), 0)
                if call >= len(paths):
                    raise RuntimeError(
                        f"the {type(module).__name__} recorded at {paths} was called more "
                        f"than its {len(paths)} times in one forward of the model (called "
                        f"outside the model's forward inside record()?)")
                self._calls[id(module)] = call + 1
                path = paths[call]
            for key, part in self._split(args[0]):
                per_path = self._gate_acc.setdefault(key, {})
                per_path.setdefault(path, GateAccumulator(self.momentum)).add(
                    values(module, part))
        return recording_hook(hook)

    def _layer_hook(self, path: str):
        def hook(module: nn.Module, args: tuple) -> None:
            if not self._active:
                return
            for key, part in self._split(args[0].detach()):
                per_path = self._layer_acc.setdefault(key, {})
                per_path.setdefault(path, MomentAccumulator()).update(
                    part.reshape(part.shape[0], -1))
        return recording_hook(hook)

    @property
    def count(self) -> int:
        """Number of examples recorded."""
        if self._moment_acc:
            return sum(a.count for a in self._moment_acc.values())
        if self._counts:
            return sum(self._counts.values())
        return sum(next(iter(g.values())).count for g in self._gate_acc.values() if g)

    def _merged_over_ranks(self) -> tuple[dict, dict, dict, dict, tuple[int, ...] | None]:
        """The accumulators and counts, merged in rank order over all ranks when distributed."""
        if distributed.world_size() == 1:
            return (self._moment_acc, self._gate_acc, self._layer_acc, self._counts,
                    self.input_shape)
        moment_acc: dict[int, MomentAccumulator] = {}
        gate_acc: dict[int, dict[str, GateAccumulator]] = {}
        layer_acc: dict[int, dict[str, MomentAccumulator]] = {}
        counts: dict[int, int] = {}
        input_shape = None
        local = (self._moment_acc, self._gate_acc, self._layer_acc, self._counts,
                 self.input_shape)
        for moments, gates, layers, rank_counts, shape in distributed.gather_objects(local):
            input_shape = input_shape or shape
            for key, n in rank_counts.items():
                counts[key] = counts.get(key, 0) + n
            for key, acc in moments.items():
                moment_acc.setdefault(key, MomentAccumulator(acc.diagonal)).merge(acc)
            for key, per_path in gates.items():
                for path, acc in per_path.items():
                    gate_acc.setdefault(key, {}).setdefault(
                        path, GateAccumulator(acc.momentum)).merge(acc)
            for key, per_path in layers.items():
                for path, acc in per_path.items():
                    layer_acc.setdefault(key, {}).setdefault(path, MomentAccumulator()).merge(acc)
        return moment_acc, gate_acc, layer_acc, counts, input_shape

    def finalize(self, classwise: bool | int = False) -> Statistics:
        """Merge what was recorded into the mixture components asked for.

        Under torch.distributed (a process group of more than one rank), every rank's
        records are merged first, so each rank gets the statistics of the union of the
        shards (:mod:`fsd.statistics.distributed`); call it on every rank.
        """
        moment_acc, gate_acc, layer_acc, counted, input_shape = self._merged_over_ranks()
        keys = sorted(set(moment_acc) | set(gate_acc) | set(counted))
        if not keys:
            raise ValueError("no examples were recorded: the data was empty or record() "
                             "was never entered")
        if classwise is not False and _POOLED in keys:
            raise ValueError("class-conditional statistics need labels: give (x, y) batches "
                             "(or record(labels=y))")
        groups = group_classes([] if keys == [_POOLED] else keys, classwise) \
            if keys != [_POOLED] else [[_POOLED]]
        counts, means, covs = [], [], []
        gates: dict[str, list[Tensor]] = {p: [] for p in self.gate_paths + self.pool_paths}
        layers: dict[str, list[tuple[Tensor, Tensor]]] = {p: [] for p in self.layer_paths}
        for group in groups:
            moment = MomentAccumulator(self.moments == "diag") if self.moments else None
            gate = {p: GateAccumulator(self.momentum) for p in gates}
            for key in group:
                if moment is not None and key in moment_acc:
                    moment.merge(moment_acc[key])
                for p in gates:
                    if p in gate_acc.get(key, {}):
                        gate[p].merge(gate_acc[key][p])
            if moment is not None:
                # a NaN or infinite input spreads into every sum (fit with data refuses it per
                # batch; recorded batches are checked here, on their merged moments)
                if moment.mean is not None and not bool(torch.isfinite(moment.mean).all()):
                    raise ValueError("the recorded inputs contain NaN or infinite values")
                counts.append(moment.count)
                means.append(moment.mean)
                covs.append(moment.covariance())
            elif gate:
                counts.append(next(iter(gate.values())).count)
            else:  # no moments, no gates: the examples counted (a model without activations)
                counts.append(sum(counted.get(key, 0) for key in group))
            for p in gates:
                gates[p].append(gate[p].value)
            for p in self.layer_paths:
                merged = MomentAccumulator()
                for key in group:
                    if p in layer_acc.get(key, {}):
                        merged.merge(layer_acc[key][p])
                covariance = merged.covariance()  # raises if no example reached the layer
                assert merged.mean is not None
                layers[p].append((merged.mean, covariance))
        weights = torch.tensor(counts, dtype=torch.float64)
        weights = weights / weights.sum()
        return Statistics(
            weights=weights,
            means=torch.stack(means) if means else None,
            covariances=torch.stack(covs) if covs else None,
            gate_means={p: torch.stack(gates[p]) for p in self.gate_paths},
            groups=[] if groups == [[_POOLED]] else groups,
            input_shape=input_shape or (),
            layer_moments={p: (torch.stack([m for m, _ in v]), torch.stack([c for _, c in v]))
                           for p, v in layers.items()},
            smooth_gates=list(self.smooth_gates),
            routing={p: _pool_half(gates[p], 0) for p in self.pool_paths},
            fired_routing={p: _pool_half(gates[p], 1) for p in self.pool_paths},
        )


def _pool_half(records: list[Tensor], half: int) -> Tensor:
    """A pool's routing (0) or fired routing (1), from its records, which hold both.

    In that order on the last axis (:meth:`fsd.model.rules.MaxPoolRule.fit_statistics`).
    """
    return torch.stack(records).chunk(2, -1)[half].contiguous()


def graph_pools(model: nn.Module) -> list[TracedLayer]:
    """The max-pool module calls of a graph, one per call site, keyed as the walkers key them."""
    pools = []
    for step in read(unwrap(model)).nodes:
        if step.kind == "module" and step.module is not None and step.path is not None:
            rule = RULES.get(type(step.module))
            if is_pool(rule):
                pools.append(TracedLayer(step.path, step.module, rule))
    return pools
