"""The worked examples of docs/architecture.md run as written (a new rule, a new evaluator)."""

from __future__ import annotations

import pathlib
import re

import pytest

from fsd.estimators import base as estimator
from fsd.model import rules
from fsd.moments import evaluators

DOC = pathlib.Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
EXAMPLES = re.findall(r"```python\n(.*?)```", DOC.read_text(encoding="utf-8"), flags=re.S)


def test_the_page_has_both_examples():
    assert len(EXAMPLES) == 2


@pytest.mark.parametrize("index", range(len(EXAMPLES)))
def test_worked_example_runs(index, monkeypatch):
    # the examples register a rule, an evaluator and an estimator class: restored after
    monkeypatch.setattr(rules, "RULES", dict(rules.RULES))
    monkeypatch.setattr(evaluators, "_EVALUATORS", dict(evaluators._EVALUATORS))
    monkeypatch.setattr(estimator, "ESTIMATORS", dict(estimator.ESTIMATORS))
    exec(compile(EXAMPLES[index], f"{DOC.name} example {index + 1}", "exec"), {})
