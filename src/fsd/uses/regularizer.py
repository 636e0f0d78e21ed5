"""A continual-learning penalty for a user's own training loop.

:class:`ContinualRegularizer` keeps one fitted summary per finished task and returns the
paper's penalty (eq. 3) for the current parameters::

    reg = fsd.ContinualRegularizer(lambda: fsd.BGLN(deterministic=True, moments="corrected"),
                                   strength=1.0)
    for task in tasks:
        for x, y in task.loader:
            loss = criterion(model(x), y) + reg.penalty(model)
            ...
        reg.end_task(model, task.loader)      # fit this task's summary at θ_t
    reg.save("regularizer.fsd")               # every summary, one file, no pickled code
"""

from __future__ import annotations

import numbers
import os
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from ..estimators.base import Estimator, check_loadable, from_payload, model_dtype_device
from ..estimators.batches import Data
from ..estimators.files import atomic_torch_save, check_format_version, read_weights_only
from ..estimators.summary_set import SummarySet
from ..model.calls import Output
from ..precision import compute_dtype
from ..validation import SummaryFormatError, regularizer_checksum

FORMAT = "fsd-continual-regularizer"
#: 1: settings and summaries; 2: a checksum over the settings and the task list as well
FORMAT_VERSION = 2
#: the first format version whose files always carry the checksum over the task list
CHECKSUM_SINCE = 2
_ENTRIES = {"format", "version", "strength", "reduction", "summaries", "checksum"}
REDUCTIONS = ("sum", "mean")
#: The largest strength λ accepted. λ·D stays finite in float32 for every distance D below
#: 3.4e38 / 1e12 = 3.4e26 — outputs some 1e13 away from the reference's, a diverged network
#: — while the largest λ this project uses is 30 on the true FSD's scale, and EWC, which
#: reads about 0.003 of the true FSD (docs/fidelity.md), needs some 300 times more: a λ
#: above 1e12 is a typo or an overflowed computation, not a weight.
MAX_STRENGTH = 1e12


def check_strength(strength: Any) -> float:
    """``strength`` as a float: a real number (not a bool or a string) in [0, 1e12].

    Raises ``ValueError`` naming the value (``MAX_STRENGTH`` says why the bound).
    """
    real = isinstance(strength, numbers.Real) and not isinstance(strength, bool)
    # an int beyond float's range (10**400) is out of bounds before float() overflows on it
    if (not real or (isinstance(strength, int) and abs(strength) > MAX_STRENGTH)
            or not 0 <= float(strength) <= MAX_STRENGTH):
        shown = repr(strength)
        shown = shown if len(shown) <= 40 else f"{shown[:12]}… ({len(shown)} characters)"
        raise ValueError(f"strength must be a finite non-negative number at most "
                         f"{MAX_STRENGTH:g}, got {shown} ({type(strength).__name__})")
    return float(strength)


class ContinualRegularizer:
    """λ times the weighted sum of the FSD to every finished task's reference network.

    Args:
        estimator: builds a fresh, unfitted estimator for each task (e.g.
            ``lambda: fsd.BGLN(deterministic=True, moments="corrected")``). Not needed to
            evaluate loaded summaries, only to fit new ones.
        strength: λ, the penalty's weight.
        reduction: ``"sum"`` — Σ_t D_t, the paper's eq. 3 — or ``"mean"`` — (1/T) Σ_t D_t,
            as the authors' code weights the tasks.

    Summaries of the same kind are evaluated together (:func:`fsd.combine`: BGLN-D
    summaries in one batched pass). Each distance runs in the model's dtype and device, so
    the regularizer follows the model when it moves.
    """

    def __init__(self, estimator: Callable[[], Estimator] | None = None, *,
                 strength: float = 1.0, reduction: str = "sum") -> None:
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, "
                             f"got {reduction!r}")
        strength = check_strength(strength)
        self.estimator = estimator
        self.strength = strength
        self.reduction = reduction
        self.summaries: list[Estimator] = []
        self._penalty: SummarySet | None = None
        self._penalty_key: tuple = ()

    def __len__(self) -> int:
        return len(self.summaries)

    @property
    def nbytes(self) -> int:
        """Bytes held by all summaries."""
        return sum(s.nbytes for s in self.summaries)

    def _new_estimator(self) -> Estimator:
        if self.estimator is None:
            raise ValueError("this regularizer has no estimator factory: pass "
                             "ContinualRegularizer(estimator=...) (or to load) to fit new tasks")
        made = self.estimator()
        if not isinstance(made, Estimator):
            raise TypeError(f"the estimator factory returned {type(made).__name__}, "
                            f"not an fsd Estimator")
        # one object for every task would refit the earlier tasks' summaries in place
        if any(made is s for s in self.summaries):
            raise ValueError("the estimator factory returned an estimator this regularizer "
                             "already holds: it must build a new one on every call, e.g. "
                             "ContinualRegularizer(lambda: fsd.BGLN()), not lambda: est")
        return made

    def statistics_collector(self, model: nn.Module, *, momentum: float | None = None
                             ) -> Any:
        """A collector to record the current task's statistics during its last epoch.

        ``None`` when the estimator needs the data itself (pass it to :meth:`end_task`).
        Record with ``with collector.record(labels=y if reg.needs_labels else None)`` around
        the forward pass, then call ``end_task(model, statistics=collector)`` and
        ``collector.remove()``.
        """
        return self._new_estimator().statistics_collector(model, momentum=momentum)

    @property
    def needs_labels(self) -> bool:
        """Whether the estimator's summaries are class-wise (record and fit with labels)."""
        return self._new_estimator().needs_labels

    def end_task(self, model: nn.Module, data: Data | None = None, *,
                 outputs: Sequence[int] | slice | None = None, statistics: Any = None,
                 progress: bool = False,
                 batch_to_input: Callable[[Any], Any] | None = None,
                 output: Output = None,
                 forward_kwargs: dict[str, Any] | None = None) -> Estimator:
        """Fit the finished task's summary at the model's current parameters and keep it.

        Args:
            model: the network at the end of the task (θ_t).
            data: the task's training data (any form :meth:`fsd.Estimator.fit` reads), or
                ``None`` with ``statistics``.
            outputs: the output units this task's summary covers (e.g. its head).
            statistics: a collector from :meth:`statistics_collector` that recorded the task.
            progress: show a progress bar over the data.
            batch_to_input: turns each batch into ``x`` or ``(x, y)`` (see
                :meth:`fsd.Estimator.fit`).
            output: which output of this task's forward to measure (a dict key, a tuple
                index, ``None`` for a tensor).
            forward_kwargs: this task's extra forward arguments, e.g. ``{"task": t}`` for a
                multi-head ``forward(x, task)``. Both are stored in the task's summary, and
                :meth:`penalty` calls the model for each summary as it was fitted.

        Returns:
            The new summary.
        """
        summary = self._new_estimator().fit(model, data, outputs=outputs,
                                            statistics=statistics, progress=progress,
                                            batch_to_input=batch_to_input, output=output,
                                            forward_kwargs=forward_kwargs)
        self.summaries.append(summary)
        self._penalty = None
        return summary

    @classmethod
    def from_summaries(cls, summaries: Sequence[Estimator], *, strength: float = 1.0,
                       reduction: str = "sum",
                       estimator: Callable[[], Estimator] | None = None
                       ) -> ContinualRegularizer:
        """A regularizer holding already fitted ``summaries`` (e.g. read back from files)."""
        regularizer = cls(estimator, strength=strength, reduction=reduction)
        for i, summary in enumerate(summaries):
            summary.require_fitted()
            # a summary that would not load would make the saved file lose every task
            check_loadable(summary.to_payload(), f"summary {i}")
        regularizer.summaries = list(summaries)
        return regularizer

    @staticmethod
    def reduction_weights(count: int, reduction: str) -> list[float]:
        """The weights of ``count`` summaries: ``"sum"`` 1 each, ``"mean"`` 1/count each."""
        if reduction not in REDUCTIONS:
            raise ValueError(f"reduction must be one of {', '.join(REDUCTIONS)}, "
                             f"got {reduction!r}")
        return [1.0 / max(count, 1) if reduction == "mean" else 1.0] * count

    def weights(self) -> list[float]:
        """Each summary's weight inside the penalty (before ``strength``)."""
        return self.reduction_weights(len(self.summaries), self.reduction)

    def penalty(self, model: nn.Module) -> Tensor:
        """λ · Σ_t w_t D_t(model): a differentiable 0-dim tensor, 0 before the first task.

        Float32 for a float16 or bfloat16 model, as :meth:`fsd.Estimator.distance` is.
        """
        if not self.summaries or self.strength == 0:
            dtype, device = model_dtype_device(model)
            return torch.zeros((), dtype=compute_dtype(dtype), device=device)
        # the batched set is cached for the summaries and weights it was built from; a
        # summary added, removed or swapped, or another reduction, builds it again
        key = (tuple(id(s) for s in self.summaries), tuple(self.weights()))
        if self._penalty is None or self._penalty_key != key:
            self._penalty, self._penalty_key = SummarySet(self.summaries, self.weights()), key
        return self.strength * self._penalty.distance(model)

    def save(self, path: str | os.PathLike) -> None:
        """Write every summary and the settings to one file (atomically; no pickled code).

        The file carries a checksum over the settings and the task list besides each
        summary's own, so a task dropped, duplicated or reordered by hand is refused at load.

        Raises:
            SummaryFormatError: a summary would not load (one changed in memory since it was
                fitted), naming its task; nothing is written.
            OSError: as :meth:`fsd.Estimator.save`, one line naming ``path``; a file already
                there is left as it was.
        """
        origin = os.fspath(path)
        summaries = []
        for i, summary in enumerate(self.summaries):
            payload = summary.to_payload()
            check_loadable(payload, f"cannot save to {origin} (task {i})")
            summaries.append(payload)
        file: dict[str, Any] = {"format": FORMAT, "version": FORMAT_VERSION,
                                "strength": self.strength, "reduction": self.reduction,
                                "summaries": summaries}
        file["checksum"] = regularizer_checksum(file)
        atomic_torch_save(file, path)

    @classmethod
    def load(cls, path: str | os.PathLike, estimator: Callable[[], Estimator] | None = None,
             map_location: str | torch.device | None = None) -> ContinualRegularizer:
        """Read a regularizer written by :meth:`save`; ``estimator`` fits later tasks.

        Each summary is checked as :func:`fsd.load` checks one, and the settings and task
        list against the file's checksum. Files of format version 1 (written before that
        checksum) load without it; a version-2 file without it, or of a later version, is
        refused. Raises :class:`~fsd.validation.SummaryFormatError` in one line naming the
        file (and the task); a FIFO or a device is refused before it is opened.
        """
        origin = os.fspath(path)
        payload = read_weights_only(origin, "regularizer", map_location)
        if not isinstance(payload, dict) or payload.get("format") != FORMAT:
            raise SummaryFormatError(f"{origin} is not an fsd regularizer file")
        version = check_format_version(payload.get("version"), origin, "regularizer",
                                       FORMAT_VERSION)
        unexpected = sorted(map(repr, set(payload) - _ENTRIES))
        if unexpected:  # a damaged "checksum" key would pass the file off as a version-1 one
            raise SummaryFormatError(f"{origin}: unexpected entries {', '.join(unexpected)}")
        damage = _checksum_damage(payload, required=version >= CHECKSUM_SINCE)
        also = "" if damage is None else f" ({damage})"
        try:
            regularizer = cls(estimator, strength=payload["strength"],
                              reduction=payload["reduction"])
        except (KeyError, TypeError, ValueError) as error:
            raise SummaryFormatError(f"{origin}: bad settings ({error}){also}") from None
        summaries = payload.get("summaries")
        if not isinstance(summaries, list):
            raise SummaryFormatError(f"{origin}: field 'summaries' is missing{also}")
        for i, summary in enumerate(summaries):
            # private classes (``_LinearizedEstimator``) are building blocks, not estimators
            name = summary.get("estimator") if isinstance(summary, dict) else None
            if isinstance(name, str) and name.startswith("_"):
                raise SummaryFormatError(f"{origin} (task {i}): unknown estimator {name!r}")
        regularizer.summaries = [from_payload(p, origin=f"{origin} (task {i})")
                                 for i, p in enumerate(summaries)]
        if damage is not None:  # every part is consistent, but not the file that was saved
            raise SummaryFormatError(f"{origin}: {damage}")
        return regularizer


def _checksum_damage(payload: dict[str, Any], *, required: bool) -> str | None:
    """What in a regularizer file disagrees with its ``checksum`` entry, or ``None``.

    ``None`` for a file without one unless ``required`` (a version-1 file predates it).
    """
    if "checksum" not in payload:
        return ("the checksum over the settings and the task list is missing, and a "
                "regularizer file of this format version is always saved with it: the file "
                "was edited or damaged") if required else None
    try:
        expected = regularizer_checksum(payload)
    except (TypeError, ValueError):  # settings that are no JSON: bytes changed
        expected = None
    if payload["checksum"] != expected:
        return ("checksum mismatch over the settings and the task list (a task dropped, "
                "duplicated or reordered, or a setting changed): the file was damaged or "
                "changed after it was saved")
    return None
