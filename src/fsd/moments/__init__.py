"""BGLN-D: the moments of the Bernoulli-gated linear network, and the evaluators over them.

Each walk (:mod:`~fsd.moments.algorithm2`, :mod:`~fsd.moments.algorithm2_conv`,
:mod:`~fsd.moments.exact`, :mod:`~fsd.moments.exact_graph`, :mod:`~fsd.moments.corrected`) is
wrapped by one :class:`~fsd.moments.evaluators.Evaluator`; a summary records the one it uses.
"""
