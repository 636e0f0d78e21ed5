"""The docs' continual-learning tables, regenerated from the result files in ``results/cl``.

A table in a docs page sits between two markers that name the command producing it::

    <!-- fsd cl report results/cl/split-mnist --rows: begin -->
    | row | method | ...
    <!-- fsd cl report: end -->

``--rows`` blocks hold the results tables (:func:`~.reporting.row_tables`), ``--tune`` blocks
the tuning table (:func:`~.tune.tune_tables`), ``--gap`` blocks the estimate-against-truth
table (:func:`~.reporting.gap_tables`), ``--wall`` blocks the wall-time table
(:func:`~.reporting.wall_tables`).

``python -m fsd_experiments.continual.doc_tables docs/*.md`` rewrites every such block from
the files (run from the repository root); ``stale_tables`` lists the blocks that differ, which
the test suite checks, so no number in those tables can drift from the committed results.
"""

from __future__ import annotations

import glob
import re
import shlex
import sys
from pathlib import Path

from ..io import atomic_write_text
from .reporting import gap_tables, row_tables, wall_tables
from .tune import tune_tables

#: a generated block: the report's arguments in the opening marker, the table, the end marker
BLOCK = re.compile(r"(<!-- fsd cl report (?P<args>[^>]*?) "
                   r"--(?P<kind>rows|tune|gap|wall): begin -->\n)"
                   r"(?P<table>.*?)(<!-- fsd cl report: end -->)", re.S)


def render(args: str, root: Path, kind: str = "rows") -> str:
    """The table ``fsd cl report ARGS --KIND`` prints (KIND: rows, tune, gap, wall).

    The folders are looked up under ``root``.
    """
    paths: list[str] = []
    for word in shlex.split(args):
        # row folders only: a file beside them (a README, notes) matches a glob as well
        found = [f for f in sorted(glob.glob(word, root_dir=root)) if (root / f).is_dir()]
        if not found:
            raise ValueError(f"{word} matches no folder under {root}")
        paths += [str(root / f) for f in found]
    return {"rows": row_tables, "tune": tune_tables, "gap": gap_tables,
            "wall": wall_tables}[kind](paths)


def refreshed(text: str, root: Path) -> str:
    """``text`` with every generated block's table regenerated."""
    return BLOCK.sub(lambda m: m[1] + "\n" + render(m["args"], root, m["kind"]) + "\n" + m[5],
                     text)


def stale_tables(doc: Path, root: Path) -> list[str]:
    """The arguments of every block of ``doc`` whose table differs from the result files."""
    text = doc.read_text(encoding="utf-8")
    return [m["args"] for m in BLOCK.finditer(text)
            if m["table"] != "\n" + render(m["args"], root, m["kind"]) + "\n"]


def main(argv: list[str]) -> int:
    """Rewrite the generated blocks of the docs pages given (paths from the repo root)."""
    if not argv:
        print("usage: python -m fsd_experiments.continual.doc_tables DOC.md...", file=sys.stderr)
        return 2
    for name in argv:
        doc = Path(name)
        text = doc.read_text(encoding="utf-8")
        new = refreshed(text, Path("."))
        if new != text:
            atomic_write_text(doc, new)
            print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
