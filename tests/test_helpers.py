"""Test helpers are written once: shared ones live in conftest.py (or zoo_models.py).

A helper copied into a second test module drifts from the first; this finds top-level
functions and classes of the test modules that are the same code (names and docstrings
aside) in two modules.
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent
# copies found when this check was added, in modules it does not change: (module, name) pairs
KNOWN = {frozenset({("test_corrected_moments.py", "_data"), ("test_exact_moments.py", "_data")})}


def _code(node: ast.FunctionDef | ast.ClassDef) -> str:
    """The definition without its name and docstring."""
    copy = ast.parse(ast.unparse(node)).body[0]
    assert isinstance(copy, (ast.FunctionDef, ast.ClassDef))
    copy.name = "_"
    body = copy.body
    if len(body) > 1 and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        copy.body = body[1:]
    return ast.dump(copy, annotate_fields=False)


def test_no_helper_of_several_lines_is_defined_in_two_test_modules():
    where: dict[str, set[tuple[str, str]]] = defaultdict(set)
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and \
                    (node.end_lineno or node.lineno) - node.lineno >= 3:
                where[_code(node)].add((path.name, node.name))
    copies = [sorted(places) for places in where.values()
              if len({module for module, _ in places}) > 1 and frozenset(places) not in KNOWN]
    assert not copies, f"helpers defined in several test modules (move them to conftest.py): " \
                       f"{copies}"
