"""The estimator interface shared by every FSD estimator, and safe save/load of summaries.

An estimator is configured by keyword arguments, ``fit`` on a reference model and data
(snapshotting θ0 and collecting its statistics), then ``distance(model)`` estimates the FSD
between the snapshot and the model's current parameters, differentiably.

Summaries are saved with ``torch.save`` as plain tensors plus JSON strings and read back
with ``torch.load(weights_only=True)``, so loading a file runs no pickled code.
"""

from __future__ import annotations

import contextlib
import glob
import itertools
import json
import numbers
import os
import stat
import tempfile
import time
import warnings
from collections.abc import Sized
from typing import Any, Callable, ClassVar, Iterable, Iterator, Sequence

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

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
    parameter_shapes,
    payload_checksums,
    require_in_range,
)

FORMAT = "fsd-summary"
FORMAT_VERSION = 1
# what to_payload writes; "checksums" is absent from files written before it was added
_PAYLOAD_ENTRIES = {"format", "version", "estimator", "config", "meta", "tensors", "checksums"}

ESTIMATORS: dict[str, type["Estimator"]] = {}

Data = Iterable[Any] | Tensor
"""What ``fit`` accepts: an iterable of batches (``x`` or ``(x, y, ...)``), e.g. a
``DataLoader``; a map-style ``Dataset`` such as ``TensorDataset`` (read in batches of 1024);
one tensor, or one ``(x, y)`` / ``(x, y, task)`` tuple, holding a single batch. Batches of
another form (dicts, objects) are read through ``fit(..., batch_to_input=fn)``."""


class _MappedBatches:
    """``fn`` applied to every batch of a (re-iterable) data source."""

    def __init__(self, data: Iterable[Any], fn: Callable[[Any], Any]) -> None:
        self.data, self.fn = data, fn

    def __iter__(self) -> Iterator[Any]:
        return map(self.fn, self.data)

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]


def as_batches(data: Any, batch_to_input: Callable[[Any], Any] | None = None) -> Any:
    """``data`` in the form the estimators iterate: batches of ``x`` or ``(x, y, ...)``.

    Args:
        data: any form :data:`Data` describes.
        batch_to_input: applied to every batch first, returning ``x`` or ``(x, y)`` (e.g.
            ``lambda b: (b["pixel_values"], b["labels"])`` for dict batches).
    """
    if isinstance(data, Tensor):
        data = [data]
    elif (isinstance(data, tuple) and 2 <= len(data) <= 3
          and all(isinstance(t, Tensor) and t.dim() >= 1 for t in data)
          and len({t.shape[0] for t in data}) == 1):
        data = [data]  # one (x, y) or (x, y, task) batch, not a sequence of batches
    elif (isinstance(data, list) and 2 <= len(data) <= 3
          and all(isinstance(t, Tensor) and t.dim() >= 1 for t in data)
          and len({t.shape[0] for t in data}) == 1):
        # a DataLoader's batch is a list: [x, y] of a 1-D regression would read as two
        # batches of inputs, the targets among them
        shapes = [tuple(t.shape[1:]) for t in data]
        if len(set(shapes)) > 1:  # not batches of one model's inputs: an (x, y) batch
            raise ValueError(f"data is a list of tensors with examples of shapes {shapes}: "
                             f"one (x, y) batch (a DataLoader's batch is a list) is passed as a "
                             f"tuple (tuple(batch)) or [(x, y)]")
        warnings.warn(f"data is a list of {len(data)} tensors of the same batch size, read as "
                      f"{len(data)} batches of inputs; for one (x, y) batch pass a tuple "
                      f"(tuple(batch)) or [(x, y)]", stacklevel=3)
    elif isinstance(data, torch.utils.data.Dataset) and not isinstance(
            data, torch.utils.data.IterableDataset):
        data = torch.utils.data.DataLoader(data, batch_size=1024)
    if batch_to_input is not None:
        data = _MappedBatches(data, batch_to_input)
    return data


class _FloatInputs:
    """Casts a batch's inputs to ``dtype`` (integer inputs of a model that needs floats)."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype

    def __call__(self, batch: Any) -> Any:
        if isinstance(batch, (tuple, list)) and batch and not isinstance(batch[0], (tuple, list)):
            return (torch.as_tensor(batch[0]).to(self.dtype), *batch[1:])
        if isinstance(batch, Tensor):
            return batch.to(self.dtype)
        return batch  # iter_batches names what is wrong with it


class NotFittedError(RuntimeError):
    """``distance`` or ``save`` was called before ``fit``."""


def iter_batches(
    data: Data | None,
    *,
    dtype: torch.dtype,
    device: torch.device,
    progress: bool = False,
    desc: str | None = None,
) -> Iterator[tuple[Tensor, Tensor | None]]:
    """Yield ``(x, y)`` batches moved to ``device``, validating them on the way.

    Floating-point inputs are cast to ``dtype``; integer and boolean ones (token ids for an
    ``nn.Embedding``) keep their dtype. ``y`` is ``None`` for unlabelled batches. Raises
    ``ValueError`` for empty data, inputs without a batch dimension, or NaN/infinite inputs
    (naming the batch).
    """
    if data is None:
        raise ValueError("no data given: fit needs data (or statistics=... for moment methods)")
    batches = [data] if isinstance(data, Tensor) else data
    try:
        total = len(batches) if isinstance(batches, Sized) else None
    except TypeError:  # a mapped generator (batch_to_input=) has a __len__ that cannot answer
        total = None
    seen = 0
    for index, batch in enumerate(tqdm(batches, disable=not progress, desc=desc, total=total,
                                       leave=False)):
        if isinstance(batch, dict):
            raise ValueError(f"batch {index} is a dict (keys {sorted(map(str, batch))}): fit "
                             f"reads x or (x, y) batches; pass batch_to_input=, e.g. "
                             f"fit(model, loader, batch_to_input=lambda b: (b['x'], b['y']))")
        if not isinstance(batch, (Tensor, tuple, list)):
            raise ValueError(f"batch {index} is a {type(batch).__name__}: fit reads tensors x "
                             f"or (x, y) tuples; convert others with batch_to_input=")
        if isinstance(batch, (tuple, list)):
            if not batch:
                raise ValueError(f"batch {index} is empty")
            x, y = batch[0], (batch[1] if len(batch) > 1 else None)
        else:
            x, y = batch, None
        if isinstance(x, (tuple, list)):
            raise ValueError(f"batch {index}'s input is a {type(x).__name__} of {len(x)}: the "
                             f"estimators measure models of one input tensor; "
                             f"{support.SEVERAL_INPUTS}")
        x = torch.as_tensor(x)
        if x.dim() < 2:
            raise ValueError(f"batch {index} has shape {tuple(x.shape)}: expected "
                             f"(batch, *features). Data is an iterable of batches; one "
                             f"labelled batch is passed as [(x, y)]")
        # discrete inputs stay discrete: a cast would turn token ids into floats no Embedding
        # takes (fit casts them for a model that needs floats, _check_runs_on)
        # detached: inputs computed by a network (a frozen encoder's features) would tie the
        # stored summary, and every penalty's backward, to that network's graph
        x = x.detach().to(device=device, dtype=None if is_integer_input(x) else dtype)
        if not torch.isfinite(x).all():
            raise ValueError(f"batch {index} contains NaN or infinite inputs")

        if y is not None:
            y = torch.as_tensor(y).detach().to(device)
            if y.dim() == 0:
                raise ValueError(f"batch {index}'s label is a scalar: data is an iterable of "
                                 f"batches, not of (x, y) examples; batch them (a DataLoader, "
                                 f"or one (x, y) tuple of tensors)")
            if y.shape[0] != x.shape[0]:
                raise ValueError(f"batch {index}: {y.shape[0]} labels for {x.shape[0]} inputs")
        seen += x.shape[0]
        yield x, y
    if seen == 0:
        raise ValueError("data is empty: fit needs at least one example")


def check_parameters(model: nn.Module) -> None:
    """Refuse a model whose parameters or buffers hold no values or non-finite ones.

    θ0 is the model's current parameters: a NaN or infinite one (a diverged training run)
    would be stored, make every distance NaN and the saved summary unloadable, and a model
    on the ``meta`` device has no values at all. Raises ``ValueError`` naming the first.
    """
    named = [(f"parameter '{n}'", t) for n, t in model.named_parameters()]
    named += [(f"buffer '{n}'", t) for n, t in model.named_buffers()]
    for name, tensor in named:
        if tensor.is_meta:
            raise ValueError(f"{name} is on the meta device and holds no values: fit needs "
                             f"the reference network's weights (e.g. model.to_empty("
                             f"device='cpu'), then load_state_dict)")
    for name, tensor in named:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"{name} has NaN or infinite values: fit takes θ0 from the "
                             f"model's parameters, which must be finite (a diverged training "
                             f"run? a smaller learning rate or gradient clipping)")


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


# Age after which a temporary file of :func:`atomic_torch_save` is a killed write's leftover.
# A write takes seconds; an hour leaves room for a slow disk without keeping litter for good.
_STALE_TEMPORARY_SECONDS = 3600.0


def _temporary_prefix(path: str) -> str:
    """The prefix of the temporary files that saving to ``path`` creates beside it."""
    # the target's name is part of it, so only leftovers of saves to the same file are
    # removed; cut so that prefix, random part and suffix stay within a file name's 255 bytes
    return f".fsd-{os.path.basename(path)[:200]}."


def _remove_stale_temporaries(path: str | os.PathLike,
                             older_than: float = _STALE_TEMPORARY_SECONDS) -> list[str]:
    """Delete leftovers of earlier saves to ``path`` killed before their rename; return them.

    Only the temporary files that :func:`atomic_torch_save` names after this target
    (``.fsd-<name>.<random>.tmp`` beside it) and whose last change is more than
    ``older_than`` seconds old are removed: a younger one may be another process's save in
    progress.
    """
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    pattern = glob.escape(_temporary_prefix(path)) + "*.tmp"
    removed = []
    now = time.time()
    for candidate in glob.glob(os.path.join(glob.escape(directory), pattern)):
        try:
            info = os.lstat(candidate)
            if stat.S_ISREG(info.st_mode) and now - info.st_mtime > older_than:
                os.remove(candidate)
                removed.append(candidate)
        except OSError:  # gone meanwhile, or not ours to remove: leave it
            continue
    return removed


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to a temporary file in the same folder, then rename it to ``path``.

    A crash never leaves a half-written file at ``path``. A process killed before the rename
    leaves its temporary file (``.fsd-<name>.<random>.tmp``) behind; the next save to the
    same ``path`` removes those older than an hour.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: The folder of ``path`` is missing or cannot be written; the message names
            ``path``, not the temporary file.
    """
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory: give the summary a file name")
    directory = os.path.dirname(os.path.abspath(path))
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=_temporary_prefix(path), suffix=".tmp")
    except OSError as error:  # mkstemp's message would name a temporary file the user never saw
        reason = "does not exist" if isinstance(error, FileNotFoundError) else \
            f"cannot be written ({error.strerror})"
        raise type(error)(f"cannot save to {path}: its folder {directory} {reason}") from None
    os.close(fd)
    try:
        torch.save(obj, tmp)
        # mkstemp makes the file private (0600); give it the mode open() would have
        os.chmod(tmp, 0o666 & ~_umask())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    _remove_stale_temporaries(path)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask




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
                :data:`fsd.estimators.base.Data`. Labels are needed only for class-conditional
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
                output.

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
        except BaseException:
            self._stored, self._state, self._meta, self._cache = previous
            raise
        self._meta["fitted"] = True
        return self

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
        self.check_architecture(model)
        with float32_view(model, differentiable=True):
            dtype, device = model_dtype_device(model)
            self.place(dtype, device)
            with evaluation_mode(model):
                return self._distance(self.bind(model))

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
        self.check_architecture(model)
        with float32_view(model, differentiable=True):  # as distance() does
            self.place(*model_dtype_device(model))
            with evaluation_mode(model):
                return self._layer_terms(self.bind(model))

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
        rename, and that are more than an hour old, are removed. Raises ``IsADirectoryError``
        if ``path`` is a directory and an ``OSError`` naming ``path`` if its folder is missing
        or cannot be written.
        """
        atomic_torch_save(self.to_payload(), path)

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
            data = _MappedBatches(data, _FloatInputs(dtype))
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
    versions before checksums (no ``checksums`` entry) still load: their bytes are not
    checksummed, only checked for consistency.
    """
    try:
        payload = torch.load(os.fspath(path), map_location=map_location, weights_only=True)
    except (FileNotFoundError, IsADirectoryError, PermissionError):
        raise
    except Exception as error:  # truncated, empty, random bytes, a pickle of anything else
        # torch's own message suggests weights_only=False, which would run pickled code
        raise SummaryFormatError(f"{os.fspath(path)} is not an fsd summary file (unreadable: "
                                 f"{type(error).__name__})") from None
    return from_payload(payload, origin=os.fspath(path))


def from_payload(payload: Any, origin: str = "summary") -> Estimator:
    """Rebuild an estimator from :meth:`Estimator.to_payload`'s dictionary, checking it.

    Raises :class:`~fsd.validation.SummaryFormatError` naming ``origin`` (a file name, or
    where in a container the summary sat) and the field that is wrong.
    """
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise SummaryFormatError(f"{origin} is not an fsd summary file")
    if payload.get("version") != FORMAT_VERSION:
        raise SummaryFormatError(f"{origin}: unsupported fsd summary version "
                                 f"{payload.get('version')}")
    name = payload.get("estimator")
    cls = ESTIMATORS.get(name) if isinstance(name, str) else None
    if cls is None:
        raise SummaryFormatError(f"unknown estimator {name!r} in {origin}")
    # an entry of another name (a damaged "checksums" key among them) would otherwise pass
    # the file off as one written before checksums
    unexpected = sorted(map(repr, set(payload) - _PAYLOAD_ENTRIES))
    if unexpected:
        raise SummaryFormatError(f"{origin}: not a valid {name} summary: unexpected entries "
                                 f"{', '.join(unexpected)}")
    damage = checksum_damage(payload)  # None for files written before checksums
    try:
        estimator = cls(**json.loads(payload["config"]))
        estimator._stored = dict(payload["tensors"])
        estimator._state = estimator._stored
        estimator._meta = json.loads(payload["meta"])
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
