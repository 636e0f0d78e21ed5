"""The statistics parametric summaries are built from: streamed moments, gates, coresets."""

from . import collector, coreset, distributed
from .collector import GateAccumulator, MomentAccumulator, Statistics, StatisticsCollector

__all__ = ["GateAccumulator", "MomentAccumulator", "Statistics", "StatisticsCollector",
           "collector", "coreset", "distributed"]
