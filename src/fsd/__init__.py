"""fsd — compact, differentiable estimates of function space distance (LAFTR / BGLN).

Every estimator follows one interface::

    est = fsd.BGLN(deterministic=True).fit(reference_model, data)
    d = est.distance(model)          # differentiable 0-dim tensor
    est.save("summary.pt"); est2 = fsd.load("summary.pt")
"""

import importlib
import sys
import warnings
from types import ModuleType

from .estimators.base import Estimator, NotFittedError, from_payload, load
from .estimators.batches import iter_batches
from .estimators.ewc import EWC
from .estimators.exact_fsd import ExactFSD
from .estimators.kfac import KFAC
from .estimators.linearized import BGLN, LAFTR
from .estimators.ntk import NTK
from .estimators.summary_set import SummarySet, combine
from .metrics import METRICS, pointwise_distance
from .model.plan import trace
from .model.rules import (
    AffineRule,
    FixedRule,
    GateRule,
    MaxPoolRule,
    Rule,
    SmoothGateRule,
    UnsupportedModuleError,
    register_rule,
)
from .model.signature import ArchitectureMismatchError
from .statistics import GateAccumulator, MomentAccumulator, Statistics, StatisticsCollector
from .uses.calibration import Calibration, calibrate
from .uses.regularizer import ContinualRegularizer
from .validation import SummaryFormatError

__version__ = "0.1.0"

# Module paths before the sub-packages (0.1.0). Each stays for one release as an alias that
# warns and hands every name on to the module that holds it now.
_OLD_PATHS = {
    "fsd.plan": "fsd.model.plan",
    "fsd.graph": "fsd.model.tracing",
    "fsd.rules": "fsd.model.rules",
    "fsd.linearize": "fsd.model.linearize",
    "fsd.calls": "fsd.model.calls",
    "fsd.signature": "fsd.model.signature",
    "fsd.hooks": "fsd.model.hooks",
    "fsd.autodiff": "fsd.model.autodiff",
    "fsd.support": "fsd.model.support",
    "fsd.interpreter": "fsd.moments.algorithm2",
    "fsd.conv_moments": "fsd.moments.algorithm2_conv",
    "fsd.exact_moments": "fsd.moments.exact",
    "fsd.graph_moments": "fsd.moments.exact_graph",
    "fsd.corrected_moments": "fsd.moments.corrected",
    "fsd.evaluators": "fsd.moments.evaluators",
    "fsd.coreset": "fsd.statistics.coreset",
    "fsd.distributed": "fsd.statistics.distributed",
    "fsd.estimator": "fsd.estimators.base",
    "fsd.linearized": "fsd.estimators.linearized",
    "fsd.exact": "fsd.estimators.exact_fsd",
    "fsd.ntk": "fsd.estimators.ntk",
    "fsd.ewc": "fsd.estimators.ewc",
    "fsd.kfac": "fsd.estimators.kfac",
    "fsd.summary_set": "fsd.estimators.summary_set",
    "fsd.regularizer": "fsd.uses.regularizer",
    "fsd.calibration": "fsd.uses.calibration",
    "fsd.influence": "fsd.uses.influence",
}
# names that left their module: old path -> {name: the module that holds it now}
_OLD_NAMES = {
    "fsd.interpreter": {
        "model_state": "fsd.model.signature", "layer_signature": "fsd.model.signature",
        "true_gates": "fsd.model.linearize", "propagate_linearized": "fsd.model.linearize",
        "trace": "fsd.model.plan", "TracedLayer": "fsd.model.rules", "GateFn": "fsd.model.rules"},
    "fsd.graph": {name: "fsd.model.plan" for name in (
        "chain", "traced_graph", "gate_nodes", "GateNode", "ChainStep")},
}


class _OldPath(ModuleType):
    """An old module path: each name is looked up where it lives now, with a warning."""

    def __getattr__(self, name: str) -> object:
        if name.startswith("__"):
            raise AttributeError(name)
        home = _OLD_NAMES.get(self.__name__, {}).get(name, _OLD_PATHS[self.__name__])
        warnings.warn(f"{self.__name__}.{name} moved to {home}.{name}", DeprecationWarning,
                      stacklevel=2)
        return getattr(importlib.import_module(home), name)


for _old in _OLD_PATHS:
    sys.modules[_old] = globals()[_old.removeprefix("fsd.")] = _OldPath(_old)

__all__ = [
    "BGLN", "EWC", "KFAC", "LAFTR", "METRICS", "NTK", "AffineRule", "ArchitectureMismatchError",
    "Calibration", "ContinualRegularizer", "Estimator", "ExactFSD", "FixedRule",
    "GateAccumulator", "GateRule", "MaxPoolRule", "MomentAccumulator", "NotFittedError", "Rule",
    "SmoothGateRule", "Statistics", "StatisticsCollector", "SummaryFormatError", "SummarySet",
    "UnsupportedModuleError", "calibrate", "combine", "from_payload", "iter_batches", "load",
    "pointwise_distance", "register_rule", "trace",
]
