"""Which estimator takes which model: one table, and the advice every refusal gives.

An estimator evaluates the model with one of a few *walkers*: the model's own forward
(ExactFSD, NTK, EWC, KFAC), the linearized pass over any graph torch.fx traces (LAFTR and
BGLN-S, :mod:`fsd.model.linearize`), Algorithm 2's walk along a chain of layers with rules
(BGLN-D, CNN chains too, :mod:`fsd.moments.algorithm2`, :mod:`fsd.moments.algorithm2_conv`), or
exact moments on MLP chains and graphs of flat layers (BGLN-D with ``moments="exact"``,
:mod:`fsd.moments.exact`, :mod:`fsd.moments.exact_graph`). A walker that meets a :class:`Feature` of
the model it cannot take refuses in one line: what failed and where, then :func:`advice`, which
names from :data:`WALKERS` every walker that takes that feature. A new estimator is one
:class:`Walker` entry; every refusal names it where it applies.

``tests/test_support.py`` fits every walker the advice names on a model of each feature, so
the table claims no support that does not exist.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Iterable, Mapping

#: what to do with a model of several per-example inputs (user-guide.md's recipe)
SEVERAL_INPUTS = ("join the inputs into one tensor (torch.cat along dim 1) and slice them "
                  "apart in a wrapper's forward (user guide: 'Models with several inputs')")


class Feature(Enum):
    """What a model has that some walker cannot take (the value says it in words)."""

    HOOK = "a forward hook that changes a layer's output"
    UNTRACEABLE = "a forward torch.fx cannot trace as written"
    NO_RULE = "a layer or operation without a rule"
    BRANCH = "a graph that is not a chain (residual additions, concatenations)"
    SHARED_WEIGHTS = "a layer with parameters called at several places"
    UNFLAT = "layers on images or sequences (inputs that are not flat feature vectors)"
    CEIL_POOL = "a MaxPool2d with ceil_mode=True"
    GATE_AFTER_NON_AFFINE = "an activation that does not follow an affine layer"
    NON_AFFINE = "an operation between activations that is not affine (LayerNorm, softmax)"
    DISCRETE_INPUTS = "discrete inputs (token ids)"
    NOT_DIFFERENTIABLE = "an operation neither forward mode nor two reverse-mode products take"
    NO_PER_EXAMPLE_GRADIENTS = "parameters without per-example gradients (no backward)"
    MOVED_BUFFERS = "buffers that move (BatchNorm running statistics)"


_ALL = frozenset(Feature)
_TRACED = frozenset({Feature.NO_RULE, Feature.BRANCH, Feature.SHARED_WEIGHTS, Feature.UNFLAT,
                     Feature.CEIL_POOL, Feature.GATE_AFTER_NON_AFFINE, Feature.NON_AFFINE,
                     Feature.MOVED_BUFFERS})


@dataclass(frozen=True, eq=False)
class Walker:
    """One row of the support table: an estimator configuration and the models it takes.

    Attributes:
        name: how messages name it (``"BGLN-S"``, ``"BGLN-D with moments='exact'"``).
        scope: the models it takes, in words (``"any model"``); walkers with the same scope
            are named together.
        estimator: its class in :mod:`fsd` (``"BGLN"``).
        options: the constructor arguments that select it (``{"deterministic": True}``).
        takes: the features it takes.
        needs: features it takes only with more constructor arguments
            (LAFTR takes token ids with ``inputs="coreset"``).
        suggested: whether refusals name it (not a variant of statistics such as
            ``reference="layerwise"``, which no refusal is fixed by).
    """

    name: str
    scope: str
    estimator: str
    options: Mapping[str, Any]
    takes: frozenset[Feature]
    needs: Mapping[Feature, Mapping[str, Any]] = field(default_factory=dict)
    suggested: bool = True

    def spelled(self, features: Iterable[Feature] = ()) -> tuple[str, dict[str, Any]]:
        """Its name and constructor arguments, with those the features need."""
        extra: dict[str, Any] = {}
        for feature in features:
            extra.update(self.needs.get(feature, {}))
        name = self.name + "".join(f" with {k}={v!r}" for k, v in extra.items())
        return name, {**self.options, **extra}


BGLN_D = Walker("BGLN-D with moments='paper' (Algorithm 2)",
                "chains of layers with rules (CNNs too)", "BGLN", {"deterministic": True},
                frozenset({Feature.UNFLAT, Feature.GATE_AFTER_NON_AFFINE, Feature.MOVED_BUFFERS}))
BGLN_D_LAYERWISE = Walker("BGLN-D with reference='layerwise'", "MLP chains", "BGLN",
                          {"deterministic": True, "reference": "layerwise"},
                          frozenset({Feature.MOVED_BUFFERS}), suggested=False)
BGLN_D_EXACT = Walker("BGLN-D with moments='exact'", "MLP chains and graphs of flat layers",
                      "BGLN", {"deterministic": True, "moments": "exact"},
                      frozenset({Feature.BRANCH, Feature.SHARED_WEIGHTS, Feature.MOVED_BUFFERS}))
BGLN_D_CORRECTED = Walker("BGLN-D with moments='corrected'",
                          "chains and residual graphs of layers with rules (CNNs too)", "BGLN",
                          {"deterministic": True, "moments": "corrected"},
                          frozenset({Feature.UNFLAT, Feature.BRANCH, Feature.MOVED_BUFFERS}))
BGLN_S = Walker("BGLN-S", "any graph torch.fx traces", "BGLN", {"deterministic": False}, _TRACED,
                {Feature.DISCRETE_INPUTS: {"inputs": "coreset"}})
LAFTR = Walker("LAFTR", "any graph torch.fx traces", "LAFTR", {}, _TRACED,
               {Feature.DISCRETE_INPUTS: {"inputs": "coreset"}})
EXACT_FSD = Walker("ExactFSD", "any model", "ExactFSD", {}, _ALL)
NTK = Walker("NTK", "any model", "NTK", {}, _ALL - {Feature.NOT_DIFFERENTIABLE})
EWC = Walker("EWC", "any model", "EWC", {},
             _ALL - {Feature.NO_PER_EXAMPLE_GRADIENTS, Feature.MOVED_BUFFERS})
KFAC = Walker("KFAC", "any model", "KFAC", {},
              _ALL - {Feature.NO_PER_EXAMPLE_GRADIENTS, Feature.MOVED_BUFFERS})

WALKERS: tuple[Walker, ...] = (BGLN_D, BGLN_D_LAYERWISE, BGLN_D_EXACT, BGLN_D_CORRECTED, BGLN_S,
                               LAFTR, EXACT_FSD, NTK, EWC, KFAC)
"""The support table, in the order refusals name the walkers."""


def walker_of(estimator: type, config: Mapping[str, Any]) -> Walker:
    """The table's row for an estimator class and its configuration (the most specific).

    A subclass (``BGLNVariant``) gets its nearest base class's row.
    """
    for cls in estimator.__mro__:
        rows = [w for w in WALKERS if w.estimator == cls.__name__
                and all(config.get(k) == v for k, v in w.options.items())]
        if rows:
            return max(rows, key=lambda w: len(w.options))
    raise KeyError(f"no row of fsd.model.support.WALKERS for {estimator.__name__} {dict(config)}")


def takers(*features: Feature, failing: Walker | None = None) -> list[Walker]:
    """The suggested walkers that take every one of ``features``.

    ``failing`` is left out unless other constructor arguments make it take them
    (BGLN-S refusing token ids with ``inputs="gaussian"`` takes them with ``"coreset"``).
    """
    wanted = set(features)
    return [w for w in WALKERS if w.suggested and wanted <= w.takes | set(w.needs)
            and (w is not failing or not wanted <= w.takes)]


def _either(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def advice(failing: Walker, *features: Feature) -> str:
    """What to use instead, in one clause: ``"use A or B on <scope>, or C, D on any model"``.

    Where no walker takes them all (ExactFSD refusing, or features no row takes together),
    the clause says so: ``"no other estimator takes a model with <features>; change that
    part of the model"``.

    Args:
        failing: the walker that refuses (never named).
        features: what it refused; the walkers named take all of them.
    """
    named = takers(*features, failing=failing)
    if not named:
        wanted = list(dict.fromkeys(features))  # in the order given, once each
        if not wanted:
            return "no other estimator takes this model"
        return (f"no other estimator takes a model with "
                f"{' and '.join(f.value for f in wanted)}; change that part of the model")
    groups: list[tuple[str, list[str]]] = []
    for walker in named:
        name = walker.spelled(features)[0]
        if groups and groups[-1][0] == walker.scope:
            groups[-1][1].append(name)
        else:
            groups.append((walker.scope, [name]))
    parts = [f"{_either(names)} on {scope}" for scope, names in groups]
    return "use " + (parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])}, or {parts[-1]}")


def describe(walker: Walker) -> str:
    """``"<name> takes <scope>"``: what the refusing walker does take."""
    return f"{walker.name} takes {walker.scope}"
