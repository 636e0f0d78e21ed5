"""Influence functions as proximal Bregman response functions (PBRF), paper §5.3.

Definitions (N = number of training points, θ0 = trained parameters, λ = damping):

- Losses. Regression: squared error L(f, y) = ½‖f − y‖². Classification: cross-entropy
  L(f, y) = −log softmax(f)_y on logits f.
- PBRF of a training point (x, y) (Bae et al. 2022)::

      θ₋ = argmin_θ  −(1/N)·L(f(x, θ), y) + D(θ, θ0) + (λ/2)‖θ − θ0‖²

  D is the Bregman divergence of the loss on outputs, averaged over the training set. For
  squared error it is (1/N) Σ_i ½‖f(x_i, θ) − f(x_i, θ0)‖², the Euclidean FSD; for
  cross-entropy it is (1/N) Σ_i KL(softmax f(x_i, θ0) ‖ softmax f(x_i, θ)), the soft-target
  training error minus its value at θ0 (FSD with metric ``"kl"``).
- Self-influence score of (x, y): L(f(x, θ₋), y) − L(f(x, θ0), y) — how much the point's own
  loss rises once it is (approximately) removed. Large score = influential / atypical point.

Distance terms D, one per method (all solved with the *same* optimizer and number of steps):

- ``exact`` (the oracle): D evaluated on stochastic minibatches of the training set (default
  batch 128), i.e. (1/B) Σ_{i∈batch} ρ(f(x_i, θ0), f(x_i, θ)) with ρ = ½‖·‖² or KL.
- ``ewc``: D replaced by ½ Δθᵀ diag(F) Δθ, :class:`fsd.EWC` with ``fisher="true"`` (the
  Gauss-Newton diagonal: metric ``"euclidean"`` for regression, ``"kl"`` for classification).
- ``bgln-d``: D replaced by :class:`fsd.BGLN` ``(deterministic=True)`` fitted on the training
  set; no training data is touched while optimizing. BGLN-D only computes the Euclidean metric
  on outputs (logits), so for classification it stands in for the KL term.

The PBRF is minimized by plain SGD (no momentum) from θ0 with learning rate ``pbrf_lr``, the
PBRFs of ``points_per_solve`` points side by side (:class:`PBRF`: vmap over stacked copies of
θ, the same arithmetic as one solve after another); the UCI
experiment uses the base network's (validation-chosen) learning rate and 20 epochs' worth of
steps (20·⌈N/128⌉), as in the paper's appendix; the MNIST experiment uses 0.003 for 100 steps
(larger rates make SGD diverge on BGLN-D's Euclidean-on-logits term).

``cg`` is the classical influence estimate (Koh & Liang 2017) of removing the point, on its own
loss: I(x, y) = (1/N) g_xᵀ (G + λI)⁻¹ g_x, with g_x = ∇_θ L(f(x, θ0), y) and
G = (1/N) Σ_i J_iᵀ H_i J_i the Gauss-Newton matrix of the training loss (= the Hessian of D at
θ0; H = I for squared error, diag(p) − ppᵀ for cross-entropy). (G + λI)⁻¹ g_x is found by
conjugate gradient with Gauss-Newton-vector products from ``torch.func`` (``jvp`` then ``vjp``),
several right-hand sides at once. This is the first-order (linearized) solution of the PBRF.

The studies that use this machinery (UCI regressions, mislabeled MNIST) live in
:mod:`fsd_experiments.influence`.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.func import functional_call, grad, jvp, vjp, vmap
from tqdm.auto import tqdm

from ..estimators.base import Estimator
from ..estimators.batches import as_batches
from ..estimators.ewc import EWC
from ..estimators.linearized import BGLN
from ..metrics import pointwise_distance

#: Methods that solve a PBRF with their distance term.
PBRF_METHODS: tuple[str, ...] = ("exact", "ewc", "bgln-d")
LOSSES: tuple[str, ...] = ("squared", "cross_entropy")


# --------------------------------------------------------------------------------------------
# Losses
# --------------------------------------------------------------------------------------------


def _check_loss(loss: str) -> str:
    if loss not in LOSSES:
        raise ValueError(f"unknown loss {loss!r}; expected one of {', '.join(LOSSES)}")
    return loss


def pointwise_loss(loss: str, f: Tensor, y: Tensor) -> Tensor:
    """Per-example loss, shape (n,): ½‖f − y‖² (``"squared"``) or −log softmax(f)_y."""
    if loss == "squared":
        return 0.5 * (f - y.to(f.dtype).reshape(f.shape)).pow(2).sum(-1)
    if loss == "cross_entropy":
        return nn.functional.cross_entropy(f, y.long().reshape(-1), reduction="none")
    raise ValueError(f"unknown loss {loss!r}; expected one of {', '.join(LOSSES)}")


def bregman_metric(loss: str) -> str:
    """The :mod:`fsd.metrics` metric that is the Bregman divergence of ``loss`` on outputs."""
    return {"squared": "euclidean", "cross_entropy": "kl"}[_check_loss(loss)]



# --------------------------------------------------------------------------------------------
# Distance terms D(θ, θ0)
# --------------------------------------------------------------------------------------------


class ExactTerm:
    """Bregman term on stochastic minibatches of the training set (the PBRF oracle).

    ``f(x_i, θ0)`` is computed once; each call evaluates the next minibatch of an endless
    shuffled stream. ``batch_size=None`` uses the full training set every call (deterministic).

    Args:
        model: the reference network at θ0.
        x: training inputs (N, ...).
        metric: ``"euclidean"`` (squared error) or ``"kl"`` (cross-entropy).
        batch_size: minibatch size, or ``None`` for full batch.
        seed: seed of the minibatch stream; :meth:`reset` restarts it, so every removal sees
            the same sequence of minibatches.
    """

    def __init__(self, model: nn.Module, x: Tensor, metric: str = "euclidean",
                 batch_size: int | None = 128, seed: int = 0) -> None:
        self.x, self.metric, self.batch_size, self.seed = x, metric, batch_size, seed
        with torch.no_grad():
            self.f0 = torch.cat([model(c) for c in torch.split(x, 4096)])
        self.reset()

    def reset(self) -> None:
        """Restart the minibatch stream (called at the start of each PBRF solve)."""
        self.generator = torch.Generator().manual_seed(self.seed)
        self._order: list[Tensor] = []

    def _next_index(self, batch_size: int) -> Tensor:
        if not self._order:
            perm = torch.randperm(self.x.shape[0], generator=self.generator)
            self._order = list(torch.split(perm, batch_size))
        return self._order.pop(0)

    def __call__(self, model: nn.Module) -> Tensor:
        """D on the next minibatch (or the full training set) at ``model``'s parameters."""
        if self.batch_size is None:
            x, f0 = self.x, self.f0
        else:
            index = self._next_index(self.batch_size)
            x, f0 = self.x[index], self.f0[index]
        return pointwise_distance(self.metric, f0, model(x) - f0).mean()


class EstimatorTerm:
    """D(θ, θ0) given by a fitted :class:`fsd.Estimator` (``ewc``, ``bgln-d``): no data used."""

    def __init__(self, estimator: Estimator) -> None:
        self.estimator = estimator

    def reset(self) -> None:
        """Nothing to restart: the estimate is deterministic."""

    def __call__(self, model: nn.Module) -> Tensor:
        """The estimator's distance from θ0 to ``model``."""
        return self.estimator.distance(model)


def _batches(x: Tensor, y: Tensor, size: int = 1024) -> list[tuple[Tensor, Tensor]]:
    # fit's data: labelled chunks of the training set, in order
    return list(zip(torch.split(x, size), torch.split(y, size), strict=True))


def training_tensors(x: Any, y: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """The training set as two tensors (inputs, targets).

    ``x`` is a tensor with its targets ``y``, or — with ``y=None`` — any form
    :meth:`fsd.Estimator.fit` reads with labels: a ``DataLoader`` or list of ``(x, y)``
    batches, a ``TensorDataset``, one ``(x, y)`` pair. The influence functions take either.
    """
    if isinstance(x, Tensor):
        if y is None:
            raise ValueError("targets are missing: pass (x, y) tensors, or y=None with a "
                             "DataLoader / TensorDataset / list of (x, y) batches as x")
        return x, y
    if y is not None:
        raise ValueError("give targets either with the inputs' tensor or inside the data, "
                         "not both")
    xs, ys = [], []
    for batch in as_batches(x):
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise ValueError("influence needs labelled data: (x, y) batches")
        xs.append(torch.as_tensor(batch[0]))
        ys.append(torch.as_tensor(batch[1]))
    if not xs:
        raise ValueError("no data: the data iterable is empty")
    return torch.cat(xs), torch.cat(ys)


def make_term(method: str, model: nn.Module, x: Any, y: Tensor | None, loss: str, *,
              batch_size: int | None = 128, seed: int = 0, bgln_covariance: str = "full",
              bgln_rank: int = 64, bgln_moments: str = "paper", bgln_groups: Tensor | None = None,
              ewc_data: int | None = None, ewc_fisher: str = "true", progress: bool = False
              ) -> ExactTerm | EstimatorTerm:
    """Build the distance term of a PBRF method fitted at the model's current θ0.

    Args:
        method: ``"exact"``, ``"ewc"`` or ``"bgln-d"``.
        model: the trained network at θ0.
        x: the training inputs (D is an average over the training set).
        y: the training targets.
        loss: ``"squared"`` or ``"cross_entropy"`` (selects the Bregman metric).
        batch_size: minibatch size of ``exact`` (``None``: full batch).
        seed: seed of ``exact``'s minibatch stream and of EWC's subset and sampling.
        bgln_covariance: input covariance form of BGLN-D (``"lowrank"`` for
            high-dimensional inputs such as MNIST).
        bgln_rank: the rank of ``bgln_covariance="lowrank"``.
        bgln_moments: BGLN-D's propagation, ``"paper"`` (Algorithm 2) or ``"exact"`` (joint
            moments, = E[BGLN-S]; see :class:`fsd.BGLN`).
        bgln_groups: one integer group label per training point (e.g. k-means clusters of
            the inputs): BGLN-D is then fitted as a mixture with moments and gate frequencies
            per group (the paper's class-conditional variant with groups for classes);
            ``None``: one Gaussian.
        ewc_data: fit EWC's Fisher on this many random training points (``None``: all); the
            exact Fisher needs one gradient per example and class, costly for classifiers.
        ewc_fisher: EWC's diagonal, ``"true"`` (the exact Gauss-Newton / Fisher diagonal, the
            strongest EWC), ``"sampled"`` (one output drawn from the model per example: the
            paper's construction, random vectors whose covariance is G) or ``"empirical"``.
        progress: show progress bars while fitting.
    """
    x, y = training_tensors(x, y)
    metric = bregman_metric(loss)
    if method == "exact":
        return ExactTerm(model, x, metric, batch_size, seed)
    data = _batches(x, y)
    if method == "ewc":
        if ewc_data is not None and ewc_data < x.shape[0]:
            keep = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(seed))
            data = _batches(x[keep[:ewc_data]], y[keep[:ewc_data]])
        return EstimatorTerm(EWC(fisher=ewc_fisher, metric=metric, seed=seed).fit(
            model, data, progress=progress))
    if method == "bgln-d":
        # BGLN-D computes the Euclidean metric on outputs only (logits for classifiers)
        if bgln_groups is not None:
            if bgln_groups.shape[0] != x.shape[0]:
                raise ValueError(f"bgln_groups has {bgln_groups.shape[0]} labels for "
                                 f"{x.shape[0]} training points")
            data = _batches(x, bgln_groups)
        estimator = BGLN(deterministic=True, covariance=bgln_covariance, rank=bgln_rank,
                         moments=bgln_moments, classwise=bgln_groups is not None)
        return EstimatorTerm(estimator.fit(model, data, progress=progress))
    raise ValueError(f"unknown PBRF method {method!r}; expected one of {', '.join(PBRF_METHODS)}")


# --------------------------------------------------------------------------------------------
# PBRF
# --------------------------------------------------------------------------------------------


class _Objective(nn.Module):
    """The PBRF objective of one point as a module around the working network.

    So ``functional_call`` can evaluate it, distance term included, at any parameters.
    """

    def __init__(self, solver: "PBRF") -> None:
        super().__init__()
        self.model = solver.work
        self._solver = [solver]  # a list: not registered as a submodule

    def forward(self, x: Tensor, y: Tensor, reference_output: Tensor | None) -> Tensor:
        solver = self._solver[0]
        output = self.model(x)
        removed = pointwise_loss(solver.loss, output, y).sum() / solver.n_train
        proximity = sum((p - p0).pow(2).sum()
                        for p, p0 in zip(self.model.parameters(), solver.theta0, strict=True))
        value = -removed + solver.term(self.model) + 0.5 * solver.damping * proximity
        if reference_output is not None:
            value = value + pointwise_distance(bregman_metric(solver.loss), reference_output,
                                               output - reference_output).sum() / solver.n_train
        return value


class PBRF:
    """Solves the PBRFs of training points by SGD from θ0 and scores self-influence.

    The PBRFs of several points are independent problems; :meth:`solve` runs a batch of them
    side by side (``torch.func.vmap`` over stacked copies of θ), which is the same arithmetic
    as solving them one at a time — every solve restarts the distance term (the ``exact``
    minibatch stream), so step t of every point sees the same minibatch either way — but
    one kernel per operation instead of one per point and operation.

    Args:
        model: the trained network (θ0 is its current parameters; it is not modified).
        term: the distance term D (e.g. from :func:`make_term`), a callable ``term(model)``
            built from operations that ``torch.func.vmap`` supports (every term of
            :func:`make_term` does).
        n_train: N, the training-set size that weights the removed point's loss.
        loss: ``"squared"`` or ``"cross_entropy"``.
        damping: λ of the proximity term (λ/2)‖θ − θ0‖².
        steps: SGD steps per solve.
        lr: SGD learning rate.
        point_term: add the removed point's own exact Bregman term (1/N)·D(f(x, θ), f(x, θ0))
            to D. The exact D contains it (it averages over every training point); a summary
            of the data distribution does not reproduce it for a high-leverage point, and
            without it the PBRF of such a point is unbounded below (−(1/N)L is concave in
            f(x)). Off by default: the paper's PBRF uses the approximate term alone.
    """

    def __init__(self, model: nn.Module, term: Callable[[nn.Module], Tensor], n_train: int, *,
                 loss: str = "squared", damping: float = 1e-3, steps: int = 100,
                 lr: float = 0.01, point_term: bool = False) -> None:
        self.loss, self.term = _check_loss(loss), term
        self.n_train, self.damping, self.steps, self.lr = int(n_train), damping, int(steps), lr
        self.point_term = bool(point_term)
        self.work = copy.deepcopy(model).eval()
        self.names = [name for name, _ in self.work.named_parameters()]
        self.theta0 = [p.detach().clone() for p in self.work.parameters()]
        self._objective_module = _Objective(self)

    def _reference_output(self, x: Tensor) -> Tensor:
        with torch.no_grad():
            return functional_call(self.work, dict(zip(self.names, self.theta0, strict=True)), (x,))

    def objective(self, params: dict[str, Tensor], x: Tensor, y: Tensor,
                  reference_output: Tensor | None = None) -> Tensor:
        """The PBRF objective of one point (x, y) (batch of one) at parameters ``params``.

        ``reference_output`` is f(x, θ0); with ``point_term`` it is computed when not given.
        """
        if self.point_term and reference_output is None:
            reference_output = self._reference_output(x)
        if not self.point_term:
            reference_output = None
        prefixed = {f"model.{name}": value for name, value in params.items()}
        return functional_call(self._objective_module, prefixed, (x, y, reference_output))

    def solve(self, x: Tensor, y: Tensor) -> dict[str, Tensor]:
        """Minimize the PBRFs of the points (x[b], y[b]), b < B, side by side.

        Returns the solutions θ₋ stacked along a leading dimension: ``{name: (B, ...)}``.
        """
        if x.shape[0] != y.shape[0] or x.shape[0] < 1:
            raise ValueError(f"x and y must hold the same number (≥ 1) of points; got "
                             f"{x.shape[0]} and {y.shape[0]}")
        count = x.shape[0]
        params = {name: p0.unsqueeze(0).expand(count, *p0.shape).clone()
                  for name, p0 in zip(self.names, self.theta0, strict=True)}
        reference = self._reference_output(x) if self.point_term else None

        def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor, ri: Tensor | None) -> Tensor:
            return self.objective(p, xi.unsqueeze(0), yi.unsqueeze(0),
                                  None if ri is None else ri.unsqueeze(0))

        # randomness="same": the exact term's minibatch is one draw shared by every point
        step_grads = vmap(grad(one), in_dims=(0, 0, 0, None if reference is None else 0),
                          randomness="same")
        if hasattr(self.term, "reset"):
            self.term.reset()
        for _ in range(self.steps):
            # plain SGD, no optimizer object: the update is all there is
            grads = step_grads(params, x, y, reference)
            params = {name: value - self.lr * grads[name] for name, value in params.items()}
        return {name: value.detach() for name, value in params.items()}

    def losses(self, params: dict[str, Tensor], x: Tensor, y: Tensor) -> Tensor:
        """L(f(x[b], θ_b), y[b]) for stacked parameters ``{name: (B, ...)}``; shape (B,)."""

        def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
            output = functional_call(self.work, p, (xi.unsqueeze(0),))
            return pointwise_loss(self.loss, output, yi.unsqueeze(0)).sum()

        with torch.no_grad():
            return vmap(one)(params, x, y)

    def self_influence(self, x: Tensor, y: Tensor) -> Tensor:
        """L(f(x, θ₋), y) − L(f(x, θ0), y) for each of the points x (B, ...); shape (B,)."""
        with torch.no_grad():
            before = pointwise_loss(self.loss, self._reference_output(x), y)
            before = before.reshape(x.shape[0], -1).sum(1)
        return self.losses(self.solve(x, y), x, y) - before


def pbrf_scores(model: nn.Module, x_train: Any, y_train: Tensor | None, indices: Sequence[int],
                method: str, *, loss: str = "squared", damping: float = 1e-3, steps: int = 100,
                lr: float = 0.01, batch_size: int | None = 128, seed: int = 0,
                bgln_covariance: str = "full", bgln_rank: int = 64, bgln_moments: str = "paper",
                bgln_groups: Tensor | None = None, ewc_data: int | None = None,
                ewc_fisher: str = "true", point_term: bool = False, points_per_solve: int = 32,
                progress: bool = True) -> np.ndarray:
    """Self-influence scores of the training points ``indices`` under a PBRF method.

    Fits the method's distance term at the model's parameters (θ0), then solves the PBRFs,
    ``points_per_solve`` points side by side (memory grows with it: one copy of θ, its
    gradient and the term's intermediates per point). See :class:`PBRF` and
    :func:`make_term` for the other arguments; the training set is two tensors or, with
    ``y_train=None``, a DataLoader or other labelled data (:func:`training_tensors`).
    """
    x_train, y_train = training_tensors(x_train, y_train)
    if points_per_solve < 1:
        raise ValueError(f"points_per_solve must be ≥ 1, got {points_per_solve}")
    term = make_term(method, model, x_train, y_train, loss, batch_size=batch_size, seed=seed,
                     bgln_covariance=bgln_covariance, bgln_rank=bgln_rank,
                     bgln_moments=bgln_moments, bgln_groups=bgln_groups,
                     ewc_data=ewc_data, ewc_fisher=ewc_fisher)
    solver = PBRF(model, term, x_train.shape[0], loss=loss, damping=damping, steps=steps, lr=lr,
                  point_term=point_term and method != "exact")
    index = torch.as_tensor([int(i) for i in indices], dtype=torch.long)
    scores = []
    with tqdm(total=len(index), desc=f"PBRF {method}", leave=False,
              disable=not progress) as bar:
        for chunk in torch.split(index, points_per_solve):
            chunk = chunk.to(x_train.device)
            scores.append(solver.self_influence(x_train[chunk], y_train[chunk]).cpu())
            bar.update(len(chunk))
    if not scores:
        return np.zeros(0, dtype=np.float64)
    return torch.cat(scores).to(torch.float64).numpy()


# --------------------------------------------------------------------------------------------
# Classical influence: conjugate gradient on Gauss-Newton-vector products
# --------------------------------------------------------------------------------------------


def _flat(tree: dict[str, Tensor]) -> Tensor:
    return torch.cat([t.reshape(-1) for t in tree.values()])


def _unflat(v: Tensor, like: dict[str, Tensor]) -> dict[str, Tensor]:
    out, offset = {}, 0
    for k, t in like.items():
        out[k] = v[offset:offset + t.numel()].view_as(t)
        offset += t.numel()
    return out


class GaussNewton:
    """Products with G = (1/N) Σ_i J_iᵀ H_i J_i, the training loss's Gauss-Newton matrix.

    J_i = ∂f(x_i, θ0)/∂θ; H_i is the loss's Hessian in the outputs (I for squared error,
    diag(p) − ppᵀ for cross-entropy). Each product is a ``jvp`` (J v) then a ``vjp`` (Jᵀ u),
    vectorized over several vectors with ``vmap``.

    Args:
        model: the network at θ0.
        x: training inputs the matrix averages over.
        loss: ``"squared"`` or ``"cross_entropy"``.
        chunk_size: inputs per forward pass (memory only).
    """

    def __init__(self, model: nn.Module, x: Tensor, loss: str = "squared",
                 chunk_size: int = 2048) -> None:
        self.loss = _check_loss(loss)
        self.model = model
        self.params = {k: p.detach() for k, p in model.named_parameters()}
        self.buffers = {k: b.detach() for k, b in model.named_buffers()}
        self.n = x.shape[0]
        self.chunks = torch.split(x, chunk_size)
        self.size = sum(p.numel() for p in self.params.values())

    def _output_hessian(self, z0: Tensor, u: Tensor) -> Tensor:
        if self.loss == "squared":
            return u
        p = z0.softmax(-1)
        return p * u - p * (p * u).sum(-1, keepdim=True)

    def matvec(self, vectors: Tensor) -> Tensor:
        """G V for V of shape (B, P) (flattened parameter vectors); returns (B, P)."""
        total = torch.zeros_like(vectors)
        for x in self.chunks:
            total += self._chunk_matvec(x, vectors)
        return total / self.n

    def _chunk_matvec(self, x: Tensor, vectors: Tensor) -> Tensor:
        """Σ_i J_iᵀ H_i J_i V over the inputs ``x`` of one chunk (not yet divided by N)."""

        def f(p: dict[str, Tensor]) -> Tensor:
            return functional_call(self.model, {**p, **self.buffers}, (x,))

        # torch's annotation of vjp does not tie the tuple's length to has_aux (False here)
        z0, pullback = vjp(f, self.params)  # pyright: ignore[reportAssignmentType]

        def product(v: Tensor) -> Tensor:
            _, jv = jvp(f, (self.params,), (_unflat(v, self.params),))  # pyright: ignore[reportAssignmentType]
            return _flat(pullback(self._output_hessian(z0.detach(), jv))[0])

        return vmap(product)(vectors)

    def dense(self) -> Tensor:
        """The full P × P matrix (small models only; for tests)."""
        return self.matvec(torch.eye(self.size, dtype=next(iter(self.params.values())).dtype))


def conjugate_gradient(matvec: Callable[[Tensor], Tensor], b: Tensor, damping: float = 0.0,
                       max_iter: int = 100, tol: float = 1e-6, progress: bool = False
                       ) -> tuple[Tensor, dict[str, Any]]:
    """Solve (A + damping·I) X = B column-by-column by conjugate gradient, all columns at once.

    Args:
        matvec: V (k, P) ↦ A V (k, P) for a symmetric positive semi-definite A.
        b: right-hand sides, shape (B, P) (one per row).
        damping: λ ≥ 0 added to the diagonal (must make the system positive definite).
        max_iter: iteration cap.
        tol: stop a row once ‖r‖ ≤ tol·‖b‖.
        progress: show a progress bar over iterations.

    Returns:
        ``(X, info)`` with ``info = {"iterations", "relative_residual" (per row)}``.
    """
    x = torch.zeros_like(b)
    r = b.clone()
    p = r.clone()
    rs = (r * r).sum(1)
    b_norm = b.norm(dim=1).clamp_min(torch.finfo(b.dtype).tiny)
    iterations = 0
    for iterations in tqdm(range(1, max_iter + 1), desc="CG iterations", leave=False,
                           disable=not progress):
        active = rs.sqrt() > tol * b_norm
        if not active.any():
            iterations -= 1
            break
        idx = active.nonzero().squeeze(1)
        # only the unconverged rows pay for a Gauss-Newton product
        ap = matvec(p[idx]) + damping * p[idx]
        alpha = rs[idx] / (p[idx] * ap).sum(1)
        x[idx] += alpha[:, None] * p[idx]
        r[idx] -= alpha[:, None] * ap
        rs_new = (r[idx] * r[idx]).sum(1)
        p[idx] = r[idx] + (rs_new / rs[idx])[:, None] * p[idx]
        rs[idx] = rs_new
    return x, {"iterations": iterations, "relative_residual": (rs.sqrt() / b_norm).tolist()}


def per_example_gradients(model: nn.Module, x: Tensor, y: Tensor, loss: str = "squared"
                          ) -> Tensor:
    """Flattened ∇_θ L(f(x_i, θ), y_i) for each row, shape (n, P)."""
    params = {k: p.detach() for k, p in model.named_parameters()}
    buffers = {k: b.detach() for k, b in model.named_buffers()}

    def one(p: dict[str, Tensor], xi: Tensor, yi: Tensor) -> Tensor:
        z = functional_call(model, {**p, **buffers}, (xi.unsqueeze(0),))
        return pointwise_loss(loss, z, yi.unsqueeze(0)).sum()

    grads = vmap(grad(one), in_dims=(None, 0, 0))(params, x, y)
    return torch.cat([g.reshape(x.shape[0], -1) for g in grads.values()], dim=1)


def cg_scores(model: nn.Module, x_train: Any, y_train: Tensor | None, indices: Sequence[int], *,
              loss: str = "squared", damping: float = 1e-3, max_iter: int = 100,
              tol: float = 1e-6, gn_data: int | None = None, block: int = 64, seed: int = 0,
              progress: bool = True) -> tuple[np.ndarray, dict[str, Any]]:
    """Classical self-influence I = (1/N) g_xᵀ (G + λI)⁻¹ g_x of the points ``indices``.

    Args:
        model: the trained network at θ0.
        x_train: the training inputs, or labelled data (a DataLoader, ...) with
            ``y_train=None`` (:func:`training_tensors`).
        y_train: the training targets.
        indices: the training points to score.
        loss: ``"squared"`` or ``"cross_entropy"``.
        damping: λ.
        max_iter: CG iteration cap.
        tol: CG stops a right-hand side once its relative residual is below this.
        gn_data: average G over this many random training points instead of all N (cheaper;
            ``None`` = all).
        block: right-hand sides solved together (one vectorized product per CG iteration).
        seed: seed of the ``gn_data`` subset.
        progress: show progress bars.

    Returns:
        ``(scores, info)``; info has the CG iteration counts and worst relative residual.
    """
    x_train, y_train = training_tensors(x_train, y_train)
    model = model.eval()
    x_gn = x_train
    if gn_data is not None and gn_data < x_train.shape[0]:
        perm = torch.randperm(x_train.shape[0], generator=torch.Generator().manual_seed(seed))
        x_gn = x_train[perm[:gn_data]]
    gauss_newton = GaussNewton(model, x_gn, loss)
    n = x_train.shape[0]
    index = torch.as_tensor(list(indices), dtype=torch.long)
    scores, iterations, residual = [], [], 0.0
    for chunk in tqdm(list(torch.split(index, block)), desc="CG", leave=False,
                      disable=not progress):
        g = per_example_gradients(model, x_train[chunk], y_train[chunk], loss)
        solution, info = conjugate_gradient(gauss_newton.matvec, g, damping, max_iter, tol,
                                            progress=progress)
        scores.append(((g * solution).sum(1) / n).detach())
        iterations.append(info["iterations"])
        residual = max(residual, max(info["relative_residual"]))
    return (torch.cat(scores).cpu().numpy().astype(np.float64),
            {"cg_iterations": iterations, "max_relative_residual": residual,
             "gauss_newton_points": x_gn.shape[0]})
