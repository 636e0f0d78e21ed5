"""The docs' results tables, regenerated from the result files committed under ``results/``.

A table in a docs page sits between two markers that name where it comes from. A
continual-learning table names the command producing it::

    <!-- fsd cl report results/cl/split-mnist --rows: begin -->
    | row | method | ...
    <!-- fsd cl report: end -->

An influence table names ``fsd influence report`` and its run folders the same way::

    <!-- fsd influence report results/influence/uci/U1-*: begin -->
    | run | data set | ...
    <!-- fsd influence report: end -->

``--rows`` blocks hold the results tables (:func:`~.continual.reporting.row_tables`),
``--tune`` blocks the tuning table (:func:`~.continual.tune.tune_tables`), ``--gap`` blocks
the estimate-against-truth table (:func:`~.continual.reporting.gap_tables`), ``--wall``
blocks the wall-time table (:func:`~.continual.reporting.wall_tables`), ``--learning``
blocks the learning-and-forgetting table (:func:`~.continual.reporting.learning_tables`).

A table copied from the markdown a study wrote beside its JSON (``fsd fidelity``, ``fsd toy``,
``fsd memory``) names the file and which of its tables, counted from 1::

    <!-- copied from results/fidelity/split-mnist/fidelity_split-mnist.md, table 1: begin -->
    | estimator | Spearman | ...
    <!-- copied: end -->

A table rendered from JSON result files names them (paths or globs under the repository
root, files or row folders as the renderer takes them, in the table's order) and the
renderer, one of :data:`~.result_tables.RENDERERS`, that formats them::

    <!-- rendered from results/moments/mlp_gap_chain_permuted_w100.json by gap-chain: begin -->
    | seed | task | true FSD | ...
    <!-- rendered: end -->

``python -m fsd_experiments.doc_tables docs/*.md`` rewrites every such block from the files
(run from the repository root); ``stale_tables`` lists the blocks that differ, which the test
suite checks, so no number in those tables can drift from the committed results.
"""

from __future__ import annotations

import glob
import re
import shlex
import sys
from pathlib import Path

from .continual.reporting import gap_tables, learning_tables, row_tables, wall_tables
from .continual.tune import tune_tables
from .influence.report import report_tables
from .io import atomic_write_text
from .result_tables import render_table

#: a generated block: the report's arguments in the opening marker, the table, the end marker
BLOCK = re.compile(r"(<!-- fsd cl report (?P<args>[^>]*?) "
                   r"--(?P<kind>rows|tune|gap|wall|learning): begin -->\n)"
                   r"(?P<table>.*?)(<!-- fsd cl report: end -->)", re.S)
#: an influence block: the report's run folders, the table, the end marker
INFLUENCE = re.compile(r"(<!-- fsd influence report (?P<args>[^>]*?): begin -->\n)"
                       r"(?P<table>.*?)(<!-- fsd influence report: end -->)", re.S)
#: a copied block: the markdown file and the table's number in it, the table, the end marker
COPY = re.compile(r"(<!-- copied from (?P<path>\S+), table (?P<number>\d+): begin -->\n)"
                  r"(?P<table>.*?)(<!-- copied: end -->)", re.S)
#: a rendered block: the result files, the renderer's name, the table, the end marker
RENDERED = re.compile(r"(<!-- rendered from (?P<paths>[^>]*?) by (?P<name>[\w-]+): begin -->\n)"
                      r"(?P<table>.*?)(<!-- rendered: end -->)", re.S)


def markdown_tables(text: str) -> list[str]:
    """The tables of a markdown text (each a maximal run of lines starting with ``|``)."""
    tables: list[list[str]] = []
    previous = False
    for line in text.splitlines():
        inside = line.startswith("|")
        if inside:
            if not previous:
                tables.append([])
            tables[-1].append(line)
        previous = inside
    return ["\n".join(t) for t in tables]


def copied_table(path: str, number: int, root: Path) -> str:
    """Table ``number`` (from 1) of the markdown file ``path`` under ``root``."""
    file = root / path
    if not file.is_file():
        raise ValueError(f"{path} is not a file under {root}")
    tables = markdown_tables(file.read_text(encoding="utf-8"))
    if not 1 <= number <= len(tables):
        raise ValueError(f"{path} has {len(tables)} tables, not a table {number}")
    return tables[number - 1]


def block_folders(args: str, root: Path) -> list[str]:
    """The folders under ``root`` that the words of ``args`` (paths or globs) name."""
    paths: list[str] = []
    for word in shlex.split(args):
        # row folders only: a file beside them (a README, notes) matches a glob as well
        found = [f for f in sorted(glob.glob(word, root_dir=root)) if (root / f).is_dir()]
        if not found:
            raise ValueError(f"{word} matches no folder under {root}")
        paths += [str(root / f) for f in found]
    return paths


def block_paths(args: str, root: Path) -> list[Path]:
    """The files and folders under ``root`` that the words of ``args`` (paths or globs) name.

    In the words' order, each glob's matches sorted.
    """
    paths: list[Path] = []
    for word in shlex.split(args):
        found = sorted(glob.glob(word, root_dir=root))
        if not found:
            raise ValueError(f"{word} matches nothing under {root}")
        paths += [root / f for f in found]
    return paths


def rendered_table(args: str, name: str, root: Path) -> str:
    """The table renderer ``name`` makes of the files ``args`` names under ``root``."""
    return render_table(name, block_paths(args, root)).strip("\n")


def render(args: str, root: Path, kind: str = "rows") -> str:
    """The table ``fsd cl report ARGS --KIND`` prints (KIND: rows, tune, gap, wall, learning).

    The folders are looked up under ``root``.
    """
    paths = block_folders(args, root)
    return {"rows": row_tables, "tune": tune_tables, "gap": gap_tables,
            "wall": wall_tables, "learning": learning_tables}[kind](paths)


def refreshed(text: str, root: Path) -> str:
    """``text`` with every generated, copied and rendered block's table regenerated."""
    text = BLOCK.sub(lambda m: m[1] + "\n" + render(m["args"], root, m["kind"]) + "\n" + m[5],
                     text)
    text = INFLUENCE.sub(lambda m: m[1] + "\n" + report_tables(block_folders(m["args"], root))
                         + "\n\n" + m[4], text)
    text = COPY.sub(lambda m: m[1] + "\n" + copied_table(m["path"], int(m["number"]), root)
                    + "\n\n" + m[5], text)
    return RENDERED.sub(lambda m: m[1] + "\n" + rendered_table(m["paths"], m["name"], root)
                        + "\n\n" + m[5], text)


def stale_tables(doc: Path, root: Path) -> list[str]:
    """The sources of every block of ``doc`` whose table differs from the result files.

    A report's arguments for a generated block, ``PATH, table N`` for a copied one,
    ``PATHS by NAME`` for a rendered one.
    """
    text = doc.read_text(encoding="utf-8")
    stale = [m["args"] for m in BLOCK.finditer(text)
             if m["table"] != "\n" + render(m["args"], root, m["kind"]) + "\n"]
    stale += [m["args"] for m in INFLUENCE.finditer(text)
              if m["table"] != "\n" + report_tables(block_folders(m["args"], root)) + "\n\n"]
    stale += [f"{m['path']}, table {m['number']}" for m in COPY.finditer(text)
              if m["table"] != "\n" + copied_table(m["path"], int(m["number"]), root) + "\n\n"]
    return stale + [f"{m['paths']} by {m['name']}" for m in RENDERED.finditer(text)
                    if m["table"] != "\n" + rendered_table(m["paths"], m["name"], root)
                    + "\n\n"]


def main(argv: list[str]) -> int:
    """Rewrite the generated blocks of the docs pages given (paths from the repo root)."""
    if not argv:
        print("usage: python -m fsd_experiments.doc_tables DOC.md...", file=sys.stderr)
        return 2
    for name in argv:
        doc = Path(name)
        text = doc.read_text(encoding="utf-8")
        try:
            new = refreshed(text, Path("."))
        except ValueError as error:  # a missing file or table: one line, nothing written
            print(f"{doc}: {error}", file=sys.stderr)
            return 2
        if new != text:
            atomic_write_text(doc, new)
            print(f"updated {doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
