"""fsd — compact, differentiable estimates of function space distance (LAFTR / BGLN).

Every estimator follows one interface::

    est = fsd.BGLN(deterministic=True).fit(reference_model, data)
    d = est.distance(model)          # differentiable 0-dim tensor
    est.save("summary.pt"); est2 = fsd.load("summary.pt")
"""

from . import moment_variants as _moment_variants  # noqa: F401  (fsd.load reads BGLNVariant)
from .calibration import Calibration, calibrate
from .estimator import Estimator, NotFittedError, from_payload, iter_batches, load
from .ewc import EWC
from .exact import ExactFSD
from .kfac import KFAC
from .linearized import BGLN, LAFTR
from .metrics import METRICS, pointwise_distance
from .ntk import NTK
from .plan import trace
from .regularizer import ContinualRegularizer
from .rules import (
    AffineRule,
    FixedRule,
    GateRule,
    MaxPoolRule,
    Rule,
    SmoothGateRule,
    UnsupportedModuleError,
    register_rule,
)
from .signature import ArchitectureMismatchError
from .statistics import GateAccumulator, MomentAccumulator, Statistics, StatisticsCollector
from .summary_set import SummarySet, combine
from .validation import SummaryFormatError

__version__ = "0.1.0"

__all__ = [
    "BGLN", "EWC", "KFAC", "LAFTR", "METRICS", "NTK", "AffineRule", "ArchitectureMismatchError",
    "Calibration", "ContinualRegularizer", "Estimator", "ExactFSD", "FixedRule",
    "GateAccumulator", "GateRule", "MaxPoolRule", "MomentAccumulator", "NotFittedError", "Rule",
    "SmoothGateRule", "Statistics", "StatisticsCollector", "SummaryFormatError", "SummarySet",
    "UnsupportedModuleError", "calibrate", "combine", "from_payload", "iter_batches", "load",
    "pointwise_distance", "register_rule", "trace",
]
