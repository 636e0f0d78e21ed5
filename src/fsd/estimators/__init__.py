"""The FSD estimators (one :class:`~fsd.estimators.base.Estimator` interface) and summary sets."""
