"""LAFTR and BGLN: FSD estimators built on linearizing the activations (paper §3).

Both store θ0 plus a summary of the inputs — a coreset, or the data's mean and covariance —
and evaluate the network linearized around the reference at every nonlinearity:

- :class:`LAFTR` uses the reference network's true gates 1{s0 > 0} at every input.
- :class:`BGLN` replaces each gate by an independent Bernoulli(μ), μ the unit's firing
  frequency on the data. BGLN-S draws inputs and gates (one gate draw per sample);
  BGLN-D (``deterministic=True``) propagates means and covariances (paper Algorithm 2).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from .estimator import Data, Estimator, Reservoir, iter_batches
from .interpreter import (
    check_moment_support,
    delta_moments,
    layer_signature,
    propagate_linearized,
    reference_moments,
    trace,
    true_gates,
)
from .metrics import check_metric, pointwise_distance
from .statistics import StatisticsCollector

INPUTS = ("coreset", "gaussian")
COVARIANCES = ("full", "diag")


def _check_choice(name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def sampling_factor(covariance: Tensor) -> Tensor:
    """A d × r matrix L with L Lᵀ = covariance, r = numerical rank.

    Data covariances are often singular (MNIST has constant pixels), so Cholesky fails.
    The symmetric eigendecomposition never does: negative round-off eigenvalues are clamped
    to zero and null directions dropped, so mean + L z, z ~ N(0, I_r), samples exactly the
    Gaussian on its support (and costs r instead of d per sample).
    """
    values, vectors = torch.linalg.eigh(covariance.to(torch.float64))
    values = values.clamp_min(0)
    # directions below the stored dtype's resolution are noise, not variance
    tol = values.max() * covariance.shape[-1] * torch.finfo(covariance.dtype).eps
    keep = values > tol
    if not keep.any():
        return covariance.new_zeros(covariance.shape[-1], 1)
    return (vectors[:, keep] * values[keep].sqrt()).to(covariance.dtype)


class _LinearizedEstimator(Estimator):
    """Shared fitting and evaluation of LAFTR and BGLN."""

    bernoulli: ClassVar[bool] = False

    def _signature(self, model: nn.Module) -> Any:
        return layer_signature(trace(model))

    @property
    def _classwise(self) -> bool | int:
        return self.config.get("classwise", False)

    @property
    def _deterministic(self) -> bool:
        return self.config.get("deterministic", False)

    # ----- fit --------------------------------------------------------------------------
    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        layers = trace(model)
        gaussian = self.config["inputs"] == "gaussian"
        needs_stats = gaussian or self.bernoulli
        own = needs_stats and statistics is None
        collector = statistics
        if own:
            collector = StatisticsCollector(
                model, moments=self.config["covariance"] if gaussian else None,
                gates=self.bernoulli)
        reservoir = None if gaussian else Reservoir(
            self.config["coreset_size"], torch.Generator().manual_seed(self.config["seed"]))
        if own or reservoir is not None:
            labelled = self._classwise is not False
            try:
                for x, y in iter_batches(data, dtype=dtype, device=device, progress=progress,
                                         desc=f"{type(self).__name__}: statistics"):
                    if own:
                        with torch.no_grad(), collector.record(labels=y if labelled else None):
                            model(x)
                    if reservoir is not None:
                        reservoir.add(x, y)
            finally:
                if own:
                    collector.remove()
        groups: list[list[int]] = []
        if needs_stats:
            groups = self._store_statistics(collector, gaussian, dtype, device)
        if reservoir is not None:
            xs, ys = reservoir.tensors()
            self._state["coreset.x"] = xs
            if groups:
                if ys is None:
                    raise ValueError("class-conditional coreset summaries need (x, y) batches")
                lookup = {c: g for g, members in enumerate(groups) for c in members}
                unknown = sorted(set(ys.tolist()) - set(lookup))
                if unknown:
                    raise ValueError(f"coreset labels {unknown} were not in the statistics")
                self._state["coreset.group"] = torch.tensor(
                    [lookup[c] for c in ys.tolist()], dtype=torch.long, device=device)
            self._meta["input_shape"] = list(xs.shape[1:])
        if self._deterministic:
            check_moment_support(layers, tuple(self._meta["input_shape"]))

    def _store_statistics(self, collector: StatisticsCollector, gaussian: bool,
                          dtype: torch.dtype, device: torch.device) -> list[list[int]]:
        stats = collector.finalize(self._classwise)
        self._state["weights"] = stats.weights.to(device=device, dtype=dtype)
        self._meta["groups"] = stats.groups
        self._meta["input_shape"] = list(stats.input_shape)
        if gaussian:
            if stats.means is None:
                raise ValueError("the statistics hold no input moments (collector moments=None)")
            covariances = stats.covariances
            if self.config["covariance"] == "diag" and covariances.dim() == 3:
                covariances = covariances.diagonal(dim1=-2, dim2=-1)
            elif self.config["covariance"] == "full" and covariances.dim() == 2:
                raise ValueError("covariance='full' needs a collector with moments='full'")
            self._state["input.mean"] = stats.means.to(device=device, dtype=dtype)
            self._state["input.cov"] = covariances.to(device=device, dtype=dtype)
        if self.bernoulli:
            if not stats.gate_means:
                raise ValueError("the statistics hold no gate frequencies (collector gates=False)")
            for path, mu in stats.gate_means.items():
                self._state[f"gate.{path}"] = mu.to(device=device, dtype=dtype)
        return stats.groups

    # ----- distance ---------------------------------------------------------------------
    def _gate_means(self) -> dict[str, Tensor]:
        return {k[len("gate."):]: v for k, v in self._state.items() if k.startswith("gate.")}

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
            return x, group, x.new_full((n,), 1.0 / n)
        mean, cov, weights = (self._state["input.mean"], self._state["input.cov"],
                              self._state["weights"])
        generator = self._generator(mean.device)
        if "factors" not in self._cache:
            self._cache["factors"] = [c.sqrt() if c.dim() == 1 else sampling_factor(c)
                                      for c in cov]
        shape = tuple(self._meta["input_shape"])
        xs, groups, sample_weights = [], [], []
        # stratified over mixture components: unbiased, lower variance than drawing classes
        for g, factor in enumerate(self._cache["factors"]):
            n = max(1, round(self.config["num_samples"] * float(weights[g])))
            width = factor.shape[0] if factor.dim() == 1 else factor.shape[1]
            z = torch.randn(n, width, generator=generator, device=mean.device, dtype=mean.dtype)
            x = mean[g] + (z * factor if factor.dim() == 1 else z @ factor.T)
            xs.append(x.reshape(n, *shape))
            groups.append(torch.full((n,), g, dtype=torch.long, device=mean.device))
            sample_weights.append(weights[g].expand(n) / n)
        return torch.cat(xs), torch.cat(groups), torch.cat(sample_weights)

    def _distance(self, model: nn.Module) -> Tensor:
        layers = trace(model)
        params0 = self._theta0()
        params1 = dict(model.named_parameters())
        if self._deterministic:
            return self._moment_distance(layers, params0, params1)
        x, group, sample_weights = self._inputs()
        if self.bernoulli:
            gate_means = self._gate_means()
            generator = self._generator(x.device)

            def gate(path: str, s0: Tensor) -> Tensor:
                # one independent draw per sample and unit, from that sample's component
                return torch.bernoulli(gate_means[path][group], generator=generator)
        else:
            gate = true_gates
        z0, dz = propagate_linearized(layers, params0, params1, x, gate)
        reference = self._select(z0)
        rho = pointwise_distance(self.config["metric"], reference, self._select(dz))
        return (sample_weights * rho).sum()

    def _moment_distance(self, layers, params0, params1) -> Tensor:
        gate_means = self._gate_means()
        if "reference_moments" not in self._cache:
            # depends only on θ0 and the stored statistics: computed once
            with torch.no_grad():
                self._cache["reference_moments"] = reference_moments(
                    layers, params0, self._state["input.mean"], self._state["input.cov"],
                    gate_means)
        mean_d, cov_d = delta_moments(layers, params0, params1,
                                      self._cache["reference_moments"], gate_means)
        mean_d = self._select(mean_d)
        cov_d = self._select(self._select(cov_d).transpose(-1, -2))
        per_group = 0.5 * mean_d.pow(2).sum(-1) + 0.5 * cov_d.diagonal(dim1=-2, dim2=-1).sum(-1)
        return (self._state["weights"] * per_group).sum()


class LAFTR(_LinearizedEstimator):
    """Linearized activations with the reference network's true gates (paper §3.1).

    Exact for networks without nonlinearities (given all data as the coreset).

    Args:
        inputs: ``"coreset"`` — a stored random subset of the data; ``"gaussian"`` —
            samples from a Gaussian with the stored data mean and covariance.
        covariance: ``"full"`` or ``"diag"`` (Gaussian inputs only).
        coreset_size: inputs kept by ``"coreset"``; ``None`` keeps all.
        num_samples: Gaussian samples per ``distance`` call.
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"``.
        seed: seeds coreset selection and sampling.
    """

    def __init__(self, inputs: str = "coreset", covariance: str = "full",
                 coreset_size: int | None = None, num_samples: int = 128,
                 metric: str = "euclidean", seed: int = 0) -> None:
        _check_choice("inputs", inputs, INPUTS)
        _check_choice("covariance", covariance, COVARIANCES)
        if num_samples < 1:
            raise ValueError(f"num_samples must be ≥ 1, got {num_samples}")
        super().__init__(inputs=inputs, covariance=covariance, coreset_size=coreset_size,
                         num_samples=int(num_samples), metric=check_metric(metric), seed=seed)


class BGLN(_LinearizedEstimator):
    """Bernoulli-gated linear network (paper §3.2–3.5): BGLN-S and BGLN-D.

    Args:
        deterministic: ``False`` — BGLN-S, Monte Carlo over inputs and gates;
            ``True`` — BGLN-D, moment propagation (Euclidean metric, MLPs, Gaussian inputs).
        inputs: ``"gaussian"`` (stored mean/covariance) or ``"coreset"`` (stored inputs with
            Bernoulli gates; BGLN-S only).
        covariance: ``"full"`` or ``"diag"`` (the paper's "Var" variant).
        classwise: ``False``; ``True`` — one mixture component per class (moments and gate
            frequencies per class, mixed by class frequency; the paper's CW variant); an int
            k — sorted class labels grouped into k contiguous clusters.
        coreset_size: inputs kept by ``"coreset"``; ``None`` keeps all.
        num_samples: Gaussian samples per ``distance`` call (BGLN-S).
        metric: ``"euclidean"``, ``"softmax_euclidean"`` or ``"kl"`` (BGLN-D: euclidean only).
        seed: seeds coreset selection and sampling.
    """

    bernoulli = True

    def __init__(self, deterministic: bool = False, inputs: str = "gaussian",
                 covariance: str = "full", classwise: bool | int = False,
                 coreset_size: int | None = None, num_samples: int = 128,
                 metric: str = "euclidean", seed: int = 0) -> None:
        _check_choice("inputs", inputs, INPUTS)
        _check_choice("covariance", covariance, COVARIANCES)
        check_metric(metric)
        if deterministic and metric != "euclidean":
            raise ValueError(f"BGLN-D (deterministic=True) computes the Euclidean metric only; "
                             f"got metric={metric!r}. Use deterministic=False for it.")
        if deterministic and inputs != "gaussian":
            raise ValueError("BGLN-D (deterministic=True) propagates input moments: use "
                             "inputs='gaussian'")
        if not isinstance(classwise, bool) and (not isinstance(classwise, int) or classwise < 1):
            raise ValueError(f"classwise must be True, False or a positive int, got {classwise!r}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be ≥ 1, got {num_samples}")
        super().__init__(deterministic=bool(deterministic), inputs=inputs, covariance=covariance,
                         classwise=classwise, coreset_size=coreset_size,
                         num_samples=int(num_samples), metric=metric, seed=seed)
