"""What the estimators are used for: a continual-learning penalty, calibration, influence."""
