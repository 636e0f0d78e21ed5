"""``fsd fidelity``: how close each estimator is to the true FSD, and to its gradient.

Three studies on the first two tasks of a benchmark (paper §5.1, the estimator-comparison
figure and the appendix "Comparing FSD Estimators"):

- **pairs**: a reference θ_i trained on task 1, and a family θ_j = θ_i fine-tuned on task 2
  over a grid of learning rates × iteration counts. For every pair the true FSD
  (:class:`fsd.ExactFSD` over the *full* task-1 training set, Euclidean on logits) is set
  against every estimator's estimate from the same stored information: one coreset shared by
  the coreset methods, one set of moments / gate frequencies shared by the moment methods.
  Reported: Spearman, Kendall, Pearson, median relative error, median ratio estimate/true,
  and the cosine between ∇_θj of the estimate and ∇_θj of the true FSD.
- **depth**: the same with ReLU MLPs of depth 1..6 (correlation with the truth vs depth).
- **minimize**: training task 2 with each estimator as the regularizer, logging the true
  FSD from θ1 and task-2 test accuracy over iterations.
"""

from __future__ import annotations

from .cli import add_cli
from .depth import depth_plot, depth_study, format_depth
from .minimize import format_minimization, minimization_plot, minimization_study
from .pairs import fidelity_metrics, format_summary, pair_study, scatter_plot, summarize_pairs
from .study import FidelityConfig, run_fidelity
from .suite import (
    ALL_ESTIMATORS,
    BENCHMARKS,
    DEPTH_ESTIMATORS,
    FITTABLE,
    MINIMIZE_ESTIMATORS,
    MOMENT_VARIANTS,
    SAMPLED,
    STUDIES,
    Suite,
    accuracy,
    fit_suite,
    make_family,
    train_reference,
    train_steps,
)

__all__ = [
    "ALL_ESTIMATORS", "BENCHMARKS", "DEPTH_ESTIMATORS", "FITTABLE", "MINIMIZE_ESTIMATORS",
    "MOMENT_VARIANTS", "SAMPLED", "STUDIES", "FidelityConfig", "Suite", "accuracy", "add_cli",
    "depth_plot", "depth_study", "fidelity_metrics", "fit_suite", "format_depth",
    "format_minimization", "format_summary", "make_family", "minimization_plot",
    "minimization_study", "pair_study", "run_fidelity", "scatter_plot", "summarize_pairs",
    "train_reference", "train_steps",
]
