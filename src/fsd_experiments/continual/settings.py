"""The settings of an ``fsd cl`` run: its hyper-parameters and what it runs where."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from fsd.metrics import check_metric

from ..benchmarks import CNN_MODELS, MODELS, check_validation
from ..presets import CL_METHODS, CNN_METHODS, PRESETS, RESIDUAL_METHODS, default_hyperparameters

OPTIMIZER_MODES: tuple[str, ...] = ("shared", "per-task")
PENALTY_MODES: tuple[str, ...] = ("mean", "sum")
PENALTY_OUTPUTS: tuple[str, ...] = ("head", "all")
#: when a summary's statistics are recorded: in the task's last training epoch (the paper's),
#: or in one pass over its training inputs after training, in evaluation mode
STATISTICS_MODES: tuple[str, ...] = ("last-epoch", "after")


@dataclass(frozen=True)
class Hyperparameters:
    """The training and summary settings of one run (defaults: :meth:`paper`).

    The fields, in this order, are the ``hyperparameters`` of results.json and of the
    checkpoints; see :func:`fsd_experiments.presets.default_hyperparameters` for their
    meaning and the paper's values. ``validation`` (``None`` or a fraction in (0, 1)) holds
    out that fraction of each task's training examples and reports accuracies on them in
    place of the test set (:func:`fsd_experiments.benchmarks.make_tasks`): the split the
    grid of ``fsd cl tune`` chooses λ on.
    """

    epochs: int
    first_epochs: int | None
    fsd_scale: float
    batch_size: int
    lr: float
    model: str
    width: int
    depth: int
    momentum: float | None
    coreset_size: int
    num_samples: int
    fisher_samples: int
    train_subset: int | None
    test_subset: int | None
    tasks: int | None
    optimizer: str
    penalty: str
    rank: int | None
    metric: str | None
    penalty_outputs: str
    validation: float | None
    injection_rank: int | None = None
    statistics: str = "last-epoch"

    @classmethod
    def paper(cls, benchmark: str, method: str) -> Hyperparameters:
        """The paper's settings for (benchmark, method)."""
        return cls(**default_hyperparameters(benchmark, method))

    @classmethod
    def from_dict(cls, values: Mapping[str, Any]) -> Hyperparameters:
        """From a complete mapping of the fields (``ValueError`` on unknown or missing ones)."""
        names = {f.name for f in fields(cls)}
        unknown, missing = set(values) - names, names - set(values)
        if unknown or missing:
            raise ValueError(f"hyper-parameters: unknown {sorted(unknown)}, "
                             f"missing {sorted(missing)}")
        return cls(**values)

    def with_overrides(self, **overrides: Any) -> Hyperparameters:
        """A copy with the given fields replaced (``None`` keeps the current value)."""
        unknown = set(overrides) - {f.name for f in fields(self)}
        if unknown:
            raise ValueError(f"unknown hyper-parameters {sorted(unknown)}")
        return replace(self, **{k: v for k, v in overrides.items() if v is not None})

    def epochs_of_task(self, task: int) -> int:
        """Epochs on task ``task`` (0-based): ``first_epochs`` on the first, else ``epochs``."""
        return self.first_epochs if task == 0 and self.first_epochs is not None else self.epochs

    def to_dict(self) -> dict[str, Any]:
        """The fields as a dictionary, in declaration order."""
        return asdict(self)

    def check(self, benchmark: str, method: str) -> None:
        """Raise ``ValueError`` for settings that do not apply to (benchmark, method)."""
        check_validation(self.validation)
        if self.optimizer not in OPTIMIZER_MODES:
            raise ValueError(f"optimizer must be one of {OPTIMIZER_MODES}, "
                             f"got {self.optimizer!r}")
        if self.penalty not in PENALTY_MODES:
            raise ValueError(f"penalty must be one of {PENALTY_MODES}, got {self.penalty!r}")
        if self.penalty_outputs not in PENALTY_OUTPUTS:
            raise ValueError(f"penalty_outputs must be one of {PENALTY_OUTPUTS}, "
                             f"got {self.penalty_outputs!r}")
        paper = default_hyperparameters(benchmark, method)
        if self.model not in MODELS:
            raise ValueError(f"model must be one of {MODELS}, got {self.model!r}")
        if self.model == "resnet" and method not in RESIDUAL_METHODS:
            raise ValueError(f"{method} does not run on the residual CNN; the methods that do: "
                             f"{', '.join(RESIDUAL_METHODS)}")
        if self.model in CNN_MODELS and method not in CNN_METHODS:
            raise ValueError(f"{method} does not run on the CNN; the methods that do: "
                             f"{', '.join(CNN_METHODS)}")
        if self.model in CNN_MODELS and self.width != paper["width"]:
            raise ValueError("width applies to the MLP (--model mlp), not the CNN")
        if self.metric is not None and self.metric != paper["metric"]:
            takes = [m for m in CL_METHODS if PRESETS[m].metric_applies]
            if method not in takes:
                raise ValueError(f"metric applies to the Monte Carlo and NTK methods "
                                 f"{sorted(takes)}, not {method!r}")
            check_metric(self.metric)
        if self.rank is not None:
            preset = PRESETS[method]
            if preset.moments != "full" or preset.estimator is None:
                raise ValueError(f"rank applies to BGLN/LAFTR methods with full input moments, "
                                 f"not {method!r}")
            if self.rank < 1:
                raise ValueError(f"rank must be positive, got {self.rank}")
        if self.injection_rank is not None:
            if PRESETS[method].options.get("moments") != "corrected":
                raise ValueError(f"injection rank applies to the corrected BGLN-D methods "
                                 f"(bgln-d-corrected…), not {method!r}")
            if self.injection_rank < 1:
                raise ValueError(f"injection rank must be positive, got {self.injection_rank}")
        if self.statistics not in STATISTICS_MODES:
            raise ValueError(f"statistics must be one of {STATISTICS_MODES}, "
                             f"got {self.statistics!r}")
        if self.statistics != paper["statistics"]:
            preset = PRESETS[method]
            if preset.estimator is None or not (preset.moments or preset.gates):
                raise ValueError(f"statistics applies to the methods that record input "
                                 f"moments or gate statistics (BGLN, LAFTR), not {method!r}")
            if self.momentum != paper["momentum"]:
                raise ValueError("momentum weighs the last epoch's batches as the network "
                                 "moves; statistics 'after' averages one pass at the final "
                                 "parameters: leave momentum at its default")


#: the ``fsd cl`` options that override a hyper-parameter of the same name
OVERRIDABLE: tuple[str, ...] = (
    "epochs", "first_epochs", "model", "lr", "batch_size", "fsd_scale", "width", "momentum",
    "coreset_size", "num_samples", "train_subset", "test_subset", "tasks", "optimizer",
    "penalty", "rank", "metric", "penalty_outputs", "validation", "injection_rank",
    "statistics")


@dataclass(frozen=True)
class RunSettings:
    """One ``fsd cl`` run: what to train, with which settings, where the files go.

    Attributes:
        benchmark: one of :data:`fsd_experiments.benchmarks.CL_BENCHMARKS`.
        method: one of :data:`fsd_experiments.presets.CL_METHODS`.
        seeds: the seeds run one after the other.
        out: the run directory (results, plots, checkpoints).
        hyperparameters: the paper's, with the options given replacing them.
        data_dir: the data directory (``None``: ``$FSD_DATA_DIR`` or the default cache).
        device: the torch device.
        progress: show progress bars.
        plots: draw the PNG plots when the last seed is done.
        threads: torch CPU threads (``None``: torch's default).
    """

    benchmark: str
    method: str
    seeds: tuple[int, ...]
    out: Path
    hyperparameters: Hyperparameters
    data_dir: str | None = None
    device: str = "cpu"
    progress: bool = True
    plots: bool = True
    threads: int | None = None

    @classmethod
    def create(cls, benchmark: str, method: str, seeds: Sequence[int],
               out: str | os.PathLike,
               **options: Any) -> RunSettings:
        """Settings from the paper's hyper-parameters and keyword options.

        Options named like a hyper-parameter override it (``None`` keeps the paper's value);
        the others (``data_dir``, ``device``, ``progress``, ``plots``, ``threads``) are
        fields of the settings. Raises ``ValueError`` for unknown names and settings that do
        not apply (:meth:`Hyperparameters.check`).
        """
        own = {"data_dir", "device", "progress", "plots", "threads"}
        hp = Hyperparameters.paper(benchmark, method).with_overrides(
            **{k: v for k, v in options.items() if k not in own})
        hp.check(benchmark, method)
        return cls(benchmark, method, tuple(int(s) for s in seeds), Path(out), hp,
                   **{k: v for k, v in options.items() if k in own})

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> RunSettings:
        """The settings the ``fsd cl`` options ask for."""
        return cls.create(args.benchmark, args.method, args.seeds, args.out,
                          data_dir=args.data_dir, device=args.device,
                          progress=not args.no_progress, plots=not args.no_plots,
                          threads=args.threads,
                          **{name: getattr(args, name) for name in OVERRIDABLE})
