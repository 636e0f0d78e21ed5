"""fsd — compact, differentiable estimates of function space distance (LAFTR / BGLN).

Every estimator follows one interface::

    est = fsd.BGLN(deterministic=True).fit(reference_model, data)
    d = est.distance(model)          # differentiable 0-dim tensor
    est.save("summary.pt"); est2 = fsd.load("summary.pt")
"""

import warnings
from types import ModuleType

from . import corrected_moments, graph, moment_variants, plan
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


def _moved_names(module: ModuleType, names: dict[str, object], home: str) -> None:
    """Keep ``module.<name>`` for names that moved to ``home``, with a DeprecationWarning.

    Set from here, the package's top, so the old module imports nothing of the new one.
    """

    def __getattr__(name: str) -> object:
        if name in names:
            warnings.warn(f"{module.__name__}.{name} moved to {home}.{name}",
                          DeprecationWarning, stacklevel=2)
            return names[name]
        raise AttributeError(f"module {module.__name__!r} has no attribute {name!r}")

    module.__getattr__ = __getattr__  # type: ignore[method-assign]  # PEP 562


# moved in 0.1.0; the old paths stay for one release (importing fsd.moment_variants also
# registers BGLNVariant, so fsd.load reads its summaries)
_moved_names(graph, {n: getattr(plan, n) for n in (
    "chain", "traced_graph", "gate_nodes", "GateNode", "ChainStep")}, "fsd.plan")
_moved_names(corrected_moments, {"BGLNVariant": moment_variants.BGLNVariant},
             "fsd.moment_variants")

__all__ = [
    "BGLN", "EWC", "KFAC", "LAFTR", "METRICS", "NTK", "AffineRule", "ArchitectureMismatchError",
    "Calibration", "ContinualRegularizer", "Estimator", "ExactFSD", "FixedRule",
    "GateAccumulator", "GateRule", "MaxPoolRule", "MomentAccumulator", "NotFittedError", "Rule",
    "SmoothGateRule", "Statistics", "StatisticsCollector", "SummaryFormatError", "SummarySet",
    "UnsupportedModuleError", "calibrate", "combine", "from_payload", "iter_batches", "load",
    "pointwise_distance", "register_rule", "trace",
]
