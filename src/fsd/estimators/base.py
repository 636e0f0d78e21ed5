"""The estimator interface shared by every FSD estimator, and safe save/load of summaries.

An estimator is configured by keyword arguments, ``fit`` on a reference model and data
(snapshotting θ0 and collecting its statistics), then ``distance(model)`` estimates the FSD
between the snapshot and the model's current parameters, differentiably.

Summaries are saved with ``torch.save`` as plain tensors plus JSON strings and read back
with ``torch.load(weights_only=True)``, so loading a file runs no pickled code.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import numbers
import os
import warnings
from typing import Any, Callable, ClassVar, Iterator, Sequence

import torch
from torch import Tensor, nn

from ..model import support
from ..model.calls import (
    Output,
    bind,
    check_call_meta,
    check_forward_kwargs,
    check_output,
    is_integer_input,
    select_output,
)
from ..model.signature import check_signature, normalize, parameter_signature
from ..model.tracing import unwrap
from ..precision import float32_view
from ..statistics import distributed
from ..validation import (
    SummaryFormatError,
    check_common,
    checksum_damage,
    out_of_range,
    parameter_shapes,
    payload_checksums,
    require_in_range,
)
from .batches import Data, FloatInputs, MappedBatches, as_batches, iter_batches
from .files import atomic_torch_save, check_format_version, read_weights_only
from .model_state import check_distance, check_parameters, refuse_meta

FORMAT = "fsd-summary"
#: 1: summaries of fsd before the checksums, and those written with them until version 2;
#: 2: the checksums are always written, so a version-2 file without them was edited
FORMAT_VERSION = 2
#: the first format version whose files always carry checksums
CHECKSUMS_SINCE = 2
# what to_payload writes; "checksums" is absent from files written before it was added
_PAYLOAD_ENTRIES = {"format", "version", "estimator", "config", "meta", "tensors", "checksums"}

ESTIMATORS: dict[str, type["Estimator"]] = {}

class NotFittedError(RuntimeError):
    """``distance`` or ``save`` was called before ``fit``."""


def model_dtype_device(model: nn.Module) -> tuple[torch.dtype, torch.device]:
    """The dtype and device of the model's first floating-point parameter."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype, p.device
    raise ValueError("the model has no floating-point parameters")


@contextlib.contextmanager
def evaluation_mode(model: nn.Module) -> Iterator[None]:
    """Temporarily put every submodule in eval mode (Dropout off), restoring flags after.

    Autocast is off inside too: a penalty computed in a mixed-precision training step runs
    in the model's own dtype, as it was fitted (under a bfloat16 autocast an unmoved model
    read 1e-6 instead of 0, and NTK's θ0 outputs no longer matched the fitted ones).
    """
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    autocast = contextlib.ExitStack()
    for device_type in ("cpu", "cuda"):
        if torch.is_autocast_enabled(device_type):
            autocast.enter_context(torch.autocast(device_type, enabled=False))
    try:
        with autocast:
            yield
    finally:
        for m, training in flags:
            m.training = training


def _refuse_tied_parameters(model: nn.Module, estimator: str) -> None:
    """One line at fit for a model holding one parameter under two names (tied weights)."""
    first: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            raise ValueError(f"the model ties parameters ({name!r} is {first[id(p)]!r}); "
                             f"{estimator} reads each layer's own parameters: use ExactFSD or "
                             f"NTK, which take tied weights, or untie them")
        first[id(p)] = name


def _output_index(outputs: Any, device: torch.device) -> Tensor:
    """``fit``'s ``outputs=`` as a tensor of distinct non-negative integer indices."""
    scalar = isinstance(outputs, Tensor) and outputs.dim() == 0
    if isinstance(outputs, numbers.Integral) or scalar:
        raise ValueError(f"outputs must be a list of output indices or a slice, got "
                         f"{outputs!r} (outputs=[{int(outputs)}] selects one output)")
    listed = outputs.tolist() if isinstance(outputs, Tensor) else list(outputs)
    integers = all(isinstance(i, numbers.Integral) and not isinstance(i, bool) for i in listed)
    if not listed or not integers or any(i < 0 for i in listed):
        raise ValueError(f"outputs must be a non-empty list of non-negative integer output "
                         f"indices or a slice, got {listed}")
    if len(set(listed)) != len(listed):
        raise ValueError(f"outputs repeats an index ({listed}): that output would count twice")
    return torch.tensor([int(i) for i in listed], dtype=torch.long, device=device)


class UnmeasurableOutputError(ValueError):
    """The model's outputs at θ0 are none the estimators can measure (fit's one-line error)."""

class Estimator:
    """Base class of all FSD estimators.

    Subclasses implement ``_fit`` and ``_distance`` and declare their JSON-able
    configuration in ``__init__`` via ``self.config``.
    """

    name: ClassVar[str] = "estimator"
    #: whether :meth:`distance` is a sum of one term per layer (:meth:`layer_terms`)
    splits_by_layer: ClassVar[bool] = False
    #: whether :meth:`fit` takes ``statistics=`` (a :class:`fsd.StatisticsCollector`)
    reads_statistics: ClassVar[bool] = False
    #: whether the estimator measures a model with tied parameters (one tensor under two
    #: names); those reading each layer's own parameters by name do not
    takes_tied_parameters: ClassVar[bool] = False

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if not cls.__name__.startswith("_"):  # a base class is not a summary's estimator
            ESTIMATORS[cls.__name__] = cls

    def __init__(self, **config: Any) -> None:
        self.config: dict[str, Any] = normalize(config)
        # _stored: the summary as fitted/loaded (saved, counted by nbytes); _state: the view
        # used for computing, converted to the calling model's dtype/device when they differ
        self._stored: dict[str, Tensor] = {}
        self._state: dict[str, Tensor] = self._stored
        self._meta: dict[str, Any] = {}
        self._cache: dict[str, Any] = {}

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.config.items())
        return f"{type(self).__name__}({args})"

    # ----- public API -------------------------------------------------------------------
    def fit(
        self,
        model: nn.Module,
        data: Data | None = None,
        *,
        outputs: Sequence[int] | slice | None = None,
        statistics: Any = None,
        progress: bool = False,
        batch_to_input: Callable[[Any], Any] | None = None,
        output: Output = None,
        forward_kwargs: dict[str, Any] | None = None,
    ) -> "Estimator":
        """Snapshot θ0 = the model's current parameters and collect the summary's statistics.

        Args:
            model: the reference network. Its dtype and device are used throughout.
            data: batches of ``x`` or ``(x, y, ...)`` (a ``DataLoader``, a list), a
                ``TensorDataset``, or one batch (a tensor or an ``(x, y)`` tuple); see
                :data:`fsd.estimators.batches.Data`. Labels are needed only for class-conditional
                summaries.
            outputs: restrict the distance to these output units (e.g. one task's head).
            statistics: a :class:`fsd.StatisticsCollector` that recorded the data already
                (e.g. during the last training epoch); used by moment/gate based estimators.
            progress: show a progress bar over the data.
            batch_to_input: turns each batch into ``x`` or ``(x, y)`` first (dict batches,
                batches with extra fields).
            output: which output of the forward to measure: ``None`` for a forward that
                returns a tensor, a key for one that returns a dict (``"logits"``), an index
                for a tuple. ``outputs`` then picks units of that tensor.
            forward_kwargs: keyword arguments for every forward call besides ``x``, e.g.
                ``{"task": 3}`` for ``forward(x, task)``; JSON-serialisable. Both are stored
                in the summary and used by :meth:`distance` (:mod:`fsd.model.calls`).

        Returns:
            ``self``.

        Inputs keep their dtype when the model takes it (integer token ids for an
        ``nn.Embedding``); integer inputs to a model that needs floats are cast to its
        dtype. Estimators that fit a Gaussian to the inputs (``inputs="gaussian"``: BGLN,
        LAFTR's option) refuse integer inputs.

        Raises:
            ValueError: in one line, before any statistic is collected: a parameter or
                buffer that is NaN, infinite or on the ``meta`` device (the first is named),
                empty data, data the model cannot run on, bad ``outputs``, outputs that are
                not (N, K) or not finite on the first example, a softmax metric over one
                output. After fitting, a summary ``fsd.load`` would refuse: e.g. a float32
                value beyond 1.8e19 (an EWC Fisher or a K-FAC factor of inputs near 1e10,
                which scale with x²), naming the input feature and the remedy.

        A fit that raises leaves the estimator as it was: a summary fitted before stays.
            fsd.statistics.distributed.DistributedFitError: under torch.distributed, on every rank
                alike, when one rank fails those checks or the ranks' θ0 differ.

        A float16 or bfloat16 model is fitted in float32 (:mod:`fsd.precision`).
        """
        model = unwrap(model)  # torch.compile / DDP wrappers: the user's model inside
        if statistics is not None and not self.reads_statistics:
            raise ValueError(f"{type(self).__name__} computes its summary from data; "
                             f"statistics= (a fsd.StatisticsCollector) is for LAFTR and BGLN")
        # a fit that fails leaves the summary fitted before it as it was
        previous = (self._stored, self._state, self._meta, self._cache)
        try:
            # a float16/bfloat16 model is fitted on float32 casts: its sums would overflow
            with float32_view(model, differentiable=False):
                try:
                    data, dtype, device = self._prepare(model, data, outputs, batch_to_input,
                                                        output, forward_kwargs)
                except Exception as error:
                    # under torch.distributed every rank raises this rank's error alike;
                    # alone, the error itself
                    distributed.agree_to_fit(error, None)
                    raise
                distributed.agree_to_fit(None, model)  # every rank has data and the same θ0
                with evaluation_mode(model):
                    self._fit(self.bind(model), data, statistics=statistics, dtype=dtype,
                              device=device, progress=progress)
            self._meta["fitted"] = True
            # what save writes, load reads: fsd.load's own checks, on the new summary
            self._refuse_unloadable(data, dtype, device)
        except BaseException:
            self._stored, self._state, self._meta, self._cache = previous
            raise
        return self

    def _refuse_unloadable(self, data: Data | None, dtype: torch.dtype,
                           device: torch.device) -> None:
        """Raise ``ValueError`` (one line) unless ``fsd.load`` would accept this summary.

        A value beyond :func:`~fsd.validation.magnitude_limit` (a float32 EWC Fisher or
        K-FAC factor of inputs near 1e10, which scale with x²) is named with its cause:
        the input feature that large, found by reading the data again when it can be.
        """
        name = type(self).__name__
        found = out_of_range(self._stored)
        if found is not None:
            raise ValueError(f"{name}.fit: the summary's field {found.key!r} reaches "
                             f"{found.largest:.3g}, beyond {found.limit:.3g} where its square "
                             f"overflows {found.dtype}, and fsd.load would refuse it; "
                             f"{_range_remedy(found.key, data, dtype, device)}")
        try:
            _rebuild(type(self), json.dumps(self.config), json.dumps(self._meta), self._stored,
                     origin="the fitted summary", damage=None)
        except SummaryFormatError as error:
            raise ValueError(f"{name}.fit: fsd.load would refuse this summary ({error})"
                             ) from None

    def _prepare(self, model: nn.Module, data: Data | None,
                 outputs: Sequence[int] | slice | None,
                 batch_to_input: Callable[[Any], Any] | None,
                 output: Output = None, forward_kwargs: dict[str, Any] | None = None,
                 ) -> tuple[Data | None, torch.dtype, torch.device]:
        """``fit``'s checks and θ0's snapshot: the data to read, the dtype and the device."""
        check_parameters(model)
        if not self.takes_tied_parameters:
            _refuse_tied_parameters(model, type(self).__name__)
        dtype, device = model_dtype_device(model)
        output, forward_kwargs = check_output(output), check_forward_kwargs(forward_kwargs)
        if (output is not None or forward_kwargs) and "forward" in model.__dict__:
            raise ValueError(f"{type(model).__name__}.forward is replaced on the instance: "
                             f"output= and forward_kwargs= call the class's forward; wrap the "
                             f"model in a module instead")
        self._stored, self._meta, self._cache = {}, {}, {}
        self._state = self._stored
        # stored only when given, so summaries of plain models are written as before
        if output is not None:
            self._meta["output"] = output
        if forward_kwargs:
            self._meta["forward_kwargs"] = forward_kwargs
        for name, p in model.named_parameters():
            self._state[f"theta0.{name}"] = p.detach().clone()
        for name, b in model.named_buffers():
            self._state[f"buffer0.{name}"] = b.detach().clone()
        if isinstance(outputs, slice):
            if outputs.step is not None and outputs.step <= 0:
                raise ValueError(f"an outputs slice needs a positive step, got {outputs}")
            self._meta["output_slice"] = [outputs.start, outputs.stop, outputs.step]
        elif outputs is not None:
            self._state["outputs"] = _output_index(outputs, device)
        try:
            self._meta["signature"] = self._full_signature(self.bind(model))
        except Exception as error:
            # a forward that needs forward_kwargs, or returns no tensor, fails in a tracer
            # too: say what to pass instead
            if data is not None:
                try:
                    self._check_runs_on(model, as_batches(data, batch_to_input), dtype, device)
                except ValueError as run_error:
                    if "forward_kwargs" in str(run_error) or "output=" in str(run_error) \
                            or isinstance(run_error, UnmeasurableOutputError):
                        raise run_error from None
            raise error
        if data is not None:
            data = self._check_runs_on(model, as_batches(data, batch_to_input), dtype, device)
        return data, dtype, device

    def bind(self, model: nn.Module) -> nn.Module:
        """``model`` as this summary calls it: with its ``output`` and ``forward_kwargs``.

        ``model`` itself when ``fit`` got neither; otherwise a view sharing the model's
        parameters under the same names whose ``forward(x)`` is
        ``model.forward(x, **forward_kwargs)[output]`` (:func:`fsd.model.calls.bind`).
        """
        return bind(model, self._meta.get("output"), self._meta.get("forward_kwargs"))

    def _full_signature(self, model: nn.Module) -> Any:
        """:meth:`_signature`, plus every parameter it does not name.

        A traced signature names the parameters of the layers the forward runs; parameters
        the forward does not use (another task's head) are stored in θ0 all the same, and
        are listed here so that ``fsd.load`` accepts what ``save`` wrote.
        """
        signature = normalize(self._signature(model))
        named = parameter_shapes(signature)
        unused = [[name, list(p.shape)] for name, p in model.named_parameters()
                  if name not in named]
        return signature + unused if unused else signature

    def distance(self, model: nn.Module) -> Tensor:
        """Estimated FSD between the fitted reference θ0 and ``model``'s current parameters.

        Returns a 0-dim tensor, differentiable w.r.t. the model's parameters. A float16 or
        bfloat16 model is measured through float32 casts of its parameters (as at ``fit``),
        so its distance is float32: the one its float32 copy gets (:mod:`fsd.precision`).
        """
        self.require_fitted()
        model = unwrap(model)
        refuse_meta(model)
        self.check_architecture(model)
        with float32_view(model, differentiable=True):
            dtype, device = model_dtype_device(model)
            self.place(dtype, device)
            with evaluation_mode(model):
                value = self._distance(self.bind(model))
        return check_distance(value, model)  # not finite: names a NaN or inf parameter

    def layer_terms(self, model: nn.Module) -> dict[str, Tensor]:
        """:meth:`distance` split into one term per layer, by module path; they sum to it.

        Set against the FSD when only that layer moves, a term shows which layers lose the
        FSD (for :class:`fsd.KFAC` on a convolution, KFC drops the terms between output
        locations; for :class:`fsd.EWC`, the diagonal drops those between parameters).
        Differentiable, like :meth:`distance`.

        Raises:
            NotImplementedError: the estimator's distance is not such a sum
                (``splits_by_layer`` is false).
        """
        if not self.splits_by_layer:
            split = sorted(name for name, cls in ESTIMATORS.items() if cls.splits_by_layer)
            raise NotImplementedError(f"{type(self).__name__}'s distance is not a sum over "
                                      f"layers; these estimators split by layer: "
                                      f"{', '.join(split)}")
        self.require_fitted()
        model = unwrap(model)
        refuse_meta(model)
        self.check_architecture(model)
        with float32_view(model, differentiable=True):  # as distance() does
            self.place(*model_dtype_device(model))
            with evaluation_mode(model):
                terms = self._layer_terms(self.bind(model))
        if terms:
            check_distance(torch.stack([t.detach() for t in terms.values()]), model)
        return terms

    def statistics_collector(self, model: nn.Module, *, momentum: float | None = None
                             ) -> Any:
        """A :class:`fsd.StatisticsCollector` recording what :meth:`fit` reads, or ``None``.

        Moment- and gate-based estimators (LAFTR with Gaussian inputs, BGLN) return one;
        estimators that need the data itself (ExactFSD, NTK, EWC, coresets) return ``None``.
        """
        return None

    @property
    def needs_labels(self) -> bool:
        """Whether :meth:`fit` needs ``(x, y)`` batches (class-wise summaries)."""
        return False

    def output_units(self) -> list[int] | slice | None:
        """The ``outputs`` given to :meth:`fit` (``None``: every output unit)."""
        self.require_fitted()
        if "output_slice" in self._meta:
            return slice(*self._meta["output_slice"])
        index = self._stored.get("outputs")
        return None if index is None else [int(i) for i in index.tolist()]

    def reference_state_dict(self) -> dict[str, Tensor]:
        """θ0 (and the buffers) as a ``state_dict``, to rebuild the reference network.

        Use it as ``model.load_state_dict(estimator.reference_state_dict())``.
        """
        self.require_fitted()
        out = {}
        for key, value in self._stored.items():
            for prefix in ("theta0.", "buffer0."):
                if key.startswith(prefix):
                    out[key[len(prefix):]] = value.detach().clone()
        return out

    @property
    def nbytes(self) -> int:
        """Bytes held by the summary: the θ0 copy plus the stored statistics/data."""
        return sum(t.numel() * t.element_size() for t in self._stored.values())

    def save(self, path: str | os.PathLike) -> None:
        """Write the summary to ``path`` atomically (temporary file, then rename).

        Temporary files that earlier saves to the same ``path`` left when killed before their
        rename, and that are more than an hour old, are removed.

        Raises:
            IsADirectoryError: ``path`` is a directory.
            OSError: one line naming ``path`` and the reason: a FIFO, a device or a socket;
                a folder that is missing or cannot be written; a failed write (``No space
                left on device``). A file already at ``path`` is left as it was.
            SummaryFormatError: the summary would not load (it was changed in memory).
        """
        payload = self.to_payload()
        # what save writes, load reads: a summary changed in memory since fit is refused
        # here, the file at path left as it was
        check_loadable(payload, f"cannot save to {os.fspath(path)}")
        atomic_torch_save(payload, path)

    def to_payload(self) -> dict[str, Any]:
        """The summary as plain tensors and JSON strings (what :meth:`save` writes).

        :func:`from_payload` rebuilds it; containers that keep several summaries in one file
        (e.g. :class:`fsd.ContinualRegularizer`) store these dictionaries.
        """
        self.require_fitted()
        payload = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "estimator": type(self).__name__,
            "config": json.dumps(self.config),
            "meta": json.dumps(self._meta),
            "tensors": {k: v.detach().cpu() for k, v in self._stored.items()},
        }
        # sha256 of every part, verified by from_payload: a flipped bit in a tensor loads
        # as a plausible summary that gives another distance, which no other check sees
        payload["checksums"] = payload_checksums(payload["estimator"], payload["config"],
                                                 payload["meta"], payload["tensors"])
        return payload

    def _check_runs_on(self, model: nn.Module, data: Data, dtype: torch.dtype,
                       device: torch.device) -> Data:
        """Run the model on one example of the first batch; return ``data`` unchanged.

        Data the model cannot take, or ``outputs`` beyond its outputs, fail here with a
        message instead of deep inside the estimator. A one-shot iterator is returned
        re-chained, with the batch taken put back in front.
        """
        if isinstance(data, Tensor):
            x, _ = next(iter_batches([data], dtype=dtype, device=device))
        else:
            # the first batch with an example: data whose batches are all empty fails here,
            # before any statistic is collected (under torch.distributed, on every rank)
            iterator = iter(data)
            taken: list[Any] = []
            for batch in iterator:
                taken.append(batch)
                x, _ = next(iter_batches([batch], dtype=dtype, device=device))
                if x.shape[0] > 0:
                    break
            else:
                raise ValueError("data is empty: fit needs at least one example" if taken
                                 else "no data: the data iterable is empty")
            if iterator is data:  # a generator: put the batches taken back in front
                data = itertools.chain(taken, iterator)
        kwargs = self._meta.get("forward_kwargs", {})
        errors = (RuntimeError, ValueError, TypeError, IndexError)
        integer = is_integer_input(x)
        # a Gaussian over the inputs needs floats: such estimators take integer inputs only
        # as floats (pixel bytes), as every estimator did before integer inputs were kept
        gaussian = self.config.get("inputs") == "gaussian"
        result: Any = None
        first: BaseException | None = None
        if not (integer and gaussian):
            try:
                result = self._run_once(model, x[:1], kwargs)
            except errors as error:
                if not integer:
                    raise self._cannot_run(x, kwargs, error) from None
                first = error
        if integer and (gaussian or first is not None):
            # integer inputs to a model that needs floats: cast to the model's dtype
            try:
                result = self._run_once(model, x[:1].to(dtype), kwargs)
            except errors as error:
                if first is None:  # gaussian: does the model take the integers themselves?
                    try:
                        self._run_once(model, x[:1], kwargs)
                    except errors:
                        raise self._cannot_run(x, kwargs, error) from None
                    use = support.advice(support.walker_of(type(self), self.config),
                                         support.Feature.DISCRETE_INPUTS)
                    raise ValueError(
                        f"{type(self).__name__} with inputs='gaussian' fits a Gaussian to "
                        f"the inputs, and these are discrete ({x.dtype}, e.g. token ids): "
                        f"{use}") from None
                raise self._cannot_run(x, kwargs, first) from None
            data = MappedBatches(data, FloatInputs(dtype))
        z = select_output(result, self._meta.get("output"),
                          f"{type(model).__name__}.forward")
        self._check_reference_output(z)
        return data

    def _check_reference_output(self, z: Tensor) -> None:
        """The model's output for one example: (1, K) outputs, finite, enough for the metric.

        Every estimator measures one row of K outputs per example, and the metrics reduce
        over the last dimension: a (N,) output would be reduced over the batch, a (N, T, C)
        one over C only, each a silently wrong distance, so both are refused here.
        """
        if z.dim() != 2:
            fix = ("for one output per example return out.unsqueeze(-1)" if z.dim() == 1 else
                   "flatten the rest into the outputs (out.flatten(1)) or into the batch"
                   if z.dim() > 2 else "return the outputs, not a reduced value")
            raise UnmeasurableOutputError(
                f"the model's output for one example has shape {tuple(z.shape)}; fsd measures "
                f"(N, K) outputs, K per example: {fix}")
        selected = self._select(z)  # raises for an outputs index beyond the model's outputs
        if not bool(torch.isfinite(z).all()):
            raise UnmeasurableOutputError(
                "the model's output on the first example is NaN or infinite at the reference "
                "parameters: a distance from it would be NaN")
        metric = self.config.get("metric")
        if metric in ("kl", "softmax_euclidean") and selected.shape[-1] == 1:
            raise UnmeasurableOutputError(
                f"metric={metric!r} compares softmax probabilities, and a softmax over one output "
                f"is always 1: use metric='euclidean' for a single output (a binary classifier's "
                f"logit)")
        if metric in ("kl", "softmax_euclidean") and any(
                rows.shape[-1] > 1 and bool((rows >= 0).all())
                and bool(((rows.sum(-1) - 1).abs() < 1e-4).all()) for rows in (z, selected)):
            # a softmax of probabilities flattens every change ~K-fold: silently too small
            raise UnmeasurableOutputError(
                f"metric={metric!r} applies a softmax to the outputs, and these are already "
                f"probabilities (non-negative, summing to 1: a final nn.Softmax?): measure the "
                f"logits or log-probabilities (nn.LogSoftmax), or use metric='euclidean'")

    @staticmethod
    def _run_once(model: nn.Module, x: Tensor, kwargs: dict[str, Any]) -> Any:
        with torch.no_grad(), evaluation_mode(model):
            return model(x, **kwargs)

    @staticmethod
    def _cannot_run(x: Tensor, kwargs: dict[str, Any], error: BaseException) -> ValueError:
        reason = str(error).strip().splitlines()[0] if str(error).strip() else \
            type(error).__name__
        if kwargs:
            hint = f"; called with forward_kwargs={kwargs!r}"
        elif isinstance(error, TypeError) and "argument" in reason:
            hint = (f"; pass forward_kwargs= to fit for arguments that are the same for every "
                    f"example (a task id); for a second input per example, "
                    f"{support.SEVERAL_INPUTS}")
        else:
            hint = ""
        return ValueError(f"the model cannot run on the data: its first batch has shape "
                          f"{tuple(x.shape)} ({reason}){hint}")

    def require_fitted(self) -> None:
        """Raise :class:`NotFittedError` unless the estimator was fitted (or loaded)."""
        if not self._meta.get("fitted"):
            raise NotFittedError(f"{type(self).__name__} is not fitted: call fit(model, data)")

    def check_architecture(self, model: nn.Module) -> None:
        """Raise :class:`~fsd.ArchitectureMismatchError` unless ``model`` fits the summary.

        The model must have the architecture the summary was fitted on; ``distance`` checks
        this on every call.
        """
        check_signature(self._meta["signature"], self._full_signature(self.bind(unwrap(model))))

    def place(self, dtype: torch.dtype, device: torch.device) -> None:
        """Compute in ``dtype`` on ``device`` from now on (``distance`` follows the model).

        The computations use a converted view of the stored summary, made once per placement;
        the stored summary itself is never cast in place, so a float64 summary used with a
        float32 model loses nothing.
        """
        placement = [str(dtype), str(device)]
        if self._cache.get("placement") == placement:
            return
        floats = [v for v in self._stored.values() if v.is_floating_point()]
        native = not floats or (floats[0].dtype == dtype and floats[0].device == device)
        if native:
            self._state = self._stored
        else:
            # a float64 summary's values may overflow float32 once squared: refuse them here
            require_in_range(self._stored, dtype)
            self._state = {k: v.to(device=device, dtype=dtype) if v.is_floating_point()
                           else v.to(device) for k, v in self._stored.items()}
        self._cache.clear()
        self._cache["placement"] = placement

    def reference_parameters(self) -> dict[str, Tensor]:
        """θ0 by parameter name, in the current placement (see :meth:`place`).

        The tensors are the summary's own: read them, do not modify them in place.
        """
        return {k[len("theta0."):]: v for k, v in self._state.items() if k.startswith("theta0.")}

    # ----- helpers for subclasses -------------------------------------------------------
    def _signature(self, model: nn.Module) -> Any:
        return parameter_signature(model)

    def _fit(self, model: nn.Module, data: Data | None, *, statistics: Any,
             dtype: torch.dtype, device: torch.device, progress: bool) -> None:
        raise NotImplementedError

    def _distance(self, model: nn.Module) -> Tensor:
        raise NotImplementedError

    def _layer_terms(self, model: nn.Module) -> dict[str, Tensor]:
        raise NotImplementedError  # estimators with splits_by_layer override it

    def _warn_moved_buffers(self, model: nn.Module, walker: support.Walker) -> None:
        """Warn when floating buffers moved for an estimator that measures parameters only."""
        moved = [name for name, b in model.named_buffers()
                 if b.is_floating_point() and f"buffer0.{name}" in self._state
                 and not torch.equal(b, self._state[f"buffer0.{name}"])]
        if moved:
            warnings.warn(f"{type(self).__name__} measures parameter movement only; the buffers "
                          f"{moved[:3]} (e.g. BatchNorm running statistics) moved too and are "
                          f"not counted; to include them, "
                          f"{support.advice(walker, support.Feature.MOVED_BUFFERS)}",
                          stacklevel=4)

    def _check_summary(self) -> None:
        """Check the stored fields this estimator reads (raise SummaryFormatError)."""

    def reference_state(self) -> dict[str, Tensor]:
        """θ0's parameters and buffers by name, as ``torch.func.functional_call`` wants them.

        The walkers read BatchNorm's running statistics from here as well. The tensors are
        the summary's own: read them, do not modify them in place.
        """
        out = self.reference_parameters()
        out.update({k[len("buffer0."):]: v for k, v in self._state.items()
                    if k.startswith("buffer0.")})
        return out

    def _select(self, z: Tensor) -> Tensor:
        """Restrict outputs (n, k) to the units given as ``outputs`` at fit time."""
        if "output_slice" in self._meta:
            z = z[..., slice(*self._meta["output_slice"])]
            if z.shape[-1] == 0:
                raise ValueError("outputs slice selects no output unit of this model")
            return z
        index = self._state.get("outputs")
        if index is not None and int(index.max()) >= z.shape[-1]:
            raise ValueError(f"outputs index {int(index.max())} out of range for a model with "
                             f"{z.shape[-1]} outputs")
        return z if index is None else z.index_select(-1, index)


def load(path: str | os.PathLike, map_location: str | torch.device | None = None) -> Estimator:
    """Load a summary written by :meth:`Estimator.save`. Runs no pickled code.

    Every stored tensor, the configuration and the metadata are checked against the sha256
    checksums written with them, and the tensors against the estimator's configuration and
    architecture (:mod:`fsd.validation`); a damaged or inconsistent file raises
    :class:`~fsd.validation.SummaryFormatError` naming the field. Files written by fsd
    versions before checksums (format version 1, no ``checksums`` entry) still load: their
    bytes are not checksummed, only checked for consistency; a version-2 file without
    checksums is refused. A FIFO, a device or a socket is refused before it is opened.
    """
    payload = read_weights_only(path, "summary", map_location)
    return from_payload(payload, origin=os.fspath(path))


def from_payload(payload: Any, origin: str = "summary") -> Estimator:
    """Rebuild an estimator from :meth:`Estimator.to_payload`'s dictionary, checking it.

    Raises :class:`~fsd.validation.SummaryFormatError` naming ``origin`` (a file name, or
    where in a container the summary sat) and the field that is wrong; for a format
    version this fsd does not know (a later one: upgrade fsd); and for a payload whose
    version is written with checksums and that has none.
    """
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise SummaryFormatError(f"{origin} is not an fsd summary file")
    version = check_format_version(payload.get("version"), origin, "summary", FORMAT_VERSION)
    name = payload.get("estimator")
    cls = ESTIMATORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise SummaryFormatError(f"unknown estimator {name!r} in {origin} (an estimator class "
                                 f"defined outside fsd is known once its module is imported, "
                                 f"e.g. fsd_experiments.ablations for BGLNVariant)")
    # an entry of another name (a damaged "checksums" key among them) would otherwise pass
    # the file off as one written before checksums
    unexpected = sorted(map(repr, set(payload) - _PAYLOAD_ENTRIES))
    if unexpected:
        raise SummaryFormatError(f"{origin}: not a valid {name} summary: unexpected entries "
                                 f"{', '.join(unexpected)}")
    # None for version-1 files written before checksums
    damage = checksum_damage(payload, required=version >= CHECKSUMS_SINCE)
    return _rebuild(cls, payload.get("config"), payload.get("meta"), payload.get("tensors"),
                    origin=origin, damage=damage)


def _rebuild(cls: type[Estimator], config: Any, meta: Any, tensors: Any, *, origin: str,
             damage: str | None) -> Estimator:
    """An estimator of ``cls`` from a payload's parts, through every check ``fsd.load`` runs.

    ``fit`` and ``save`` call it too, on the JSON a file would hold: a summary that passes
    here is one ``fsd.load`` reads. ``damage`` (what disagrees with the checksums) follows
    the consistency checks' message, or is the message when they pass.
    """
    name = cls.__name__
    try:
        estimator = cls(**json.loads(config))
        estimator._stored = dict(tensors)
        estimator._state = estimator._stored
        estimator._meta = json.loads(meta)
        # the consistency checks run first: their message says what is wrong with the field
        check_common(estimator._stored, estimator._meta)
        check_call_meta(estimator._meta)
        estimator._check_summary()
    except (KeyError, TypeError, ValueError, json.JSONDecodeError) as error:
        # SummaryFormatError is a ValueError: one message naming the file and the field
        detail = str(error) if isinstance(error, SummaryFormatError) else \
            f"{type(error).__name__}: {error}"
        also = "" if damage is None else f" ({damage})"
        raise SummaryFormatError(f"{origin}: not a valid {name} summary: {detail}{also}"
                                 ) from None
    except Exception:
        if damage is None:
            raise
        # damaged bytes can break a check in ways no consistent file does
        raise SummaryFormatError(f"{origin}: not a valid {name} summary: {damage}") from None
    if damage is not None:
        raise SummaryFormatError(f"{origin}: not a valid {name} summary: {damage}")
    return estimator


def check_loadable(payload: dict[str, Any], origin: str) -> None:
    """Refuse to write ``payload`` (from :meth:`Estimator.to_payload`) unless it would load.

    The checks of :func:`from_payload`, without the checksums ``to_payload`` just computed.
    Raises :class:`~fsd.validation.SummaryFormatError` naming ``origin`` and the field.
    """
    cls = ESTIMATORS[payload["estimator"]]
    _rebuild(cls, payload["config"], payload["meta"], payload["tensors"], origin=origin,
             damage=None)


# A standardised feature beyond this would be a 1000-σ outlier: inputs that large are raw
# (a Unix time, a price, an unscaled sensor) and are named as the cause of a huge summary.
_RAW_INPUT = 1e3
_STANDARDISE = ("standardise the inputs (subtract each feature's mean and divide by its "
                "standard deviation), or fit a float64 model (model.double())")


def _range_remedy(key: str, data: Data | None, dtype: torch.dtype, device: torch.device
                  ) -> str:
    """The cause and the fix of a summary field beyond the magnitude limit, for ``fit``."""
    if key.startswith("theta0."):
        return (f"the parameter {key[len('theta0.'):]!r} is that large: fit a float64 model "
                f"(model.double())")
    largest = _largest_input_feature(data, dtype, device)
    if largest is None:
        return _STANDARDISE
    feature, value = largest
    if value >= _RAW_INPUT:
        return f"feature {feature} of the inputs reaches {value:.3g}: {_STANDARDISE}"
    return (f"the inputs stay within {value:.3g}, so the model's weights or outputs are that "
            f"large: fit a float64 model (model.double())")


def _largest_input_feature(data: Data | None, dtype: torch.dtype, device: torch.device
                           ) -> tuple[str, float] | None:
    """The input feature of largest magnitude and that magnitude, or ``None``.

    ``None`` when the data cannot be read again (a generator ``fit`` consumed, statistics
    only) or holds integer inputs, which no float feature scaling concerns.
    """
    if data is None or isinstance(data, Iterator):
        return None
    peak: Tensor | None = None
    shape: tuple[int, ...] = ()
    try:
        for x, _ in iter_batches(data, dtype=dtype, device=device):
            if not x.is_floating_point():
                return None
            batch = x.detach().abs().flatten(1).amax(0)
            peak = batch if peak is None else torch.maximum(peak, batch)
            shape = tuple(x.shape[1:])
    except Exception:  # the message falls back to the general advice
        return None
    if peak is None or peak.numel() == 0:
        return None
    index = int(peak.argmax())
    value = float(peak[index])
    if len(shape) == 1:
        return str(index), value
    position = []  # the index within one example's shape, as x[:, c, h, w] reads it
    for size in reversed(shape):
        position.append(index % size)
        index //= size
    return str(tuple(reversed(position))), value
