"""How fsd reads a model: the plan of its operations, the rule of each layer type, the walks.

:mod:`~fsd.model.plan` reads a model once; :mod:`~fsd.model.rules` holds one rule per layer
type; :mod:`~fsd.model.linearize` is LAFTR's linearized pass; :mod:`~fsd.model.tracing` the
torch.fx mechanics; :mod:`~fsd.model.support` which estimators take which model.
"""
