"""The statistics parametric summaries are built from: streamed moments, gates, coresets."""

from .collector import GateAccumulator, MomentAccumulator, Statistics, StatisticsCollector

__all__ = ["GateAccumulator", "MomentAccumulator", "Statistics", "StatisticsCollector"]
