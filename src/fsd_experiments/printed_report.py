"""A benchmark's printed report kept as result files: the text and its tables as JSON.

The scripts in ``benchmarks/`` print markdown tables. Run with ``--out PREFIX`` they also
write ``PREFIX.md`` (exactly what was printed) and ``PREFIX.json`` (the command, the machine,
the load on it, and every table's heading, columns and rows), so a docs page copies its
tables from committed files (``<!-- copied from PREFIX.md, table N: begin -->``, see
:mod:`fsd_experiments.doc_tables`) and a test keeps the two equal.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, TextIO

from .io import atomic_write_text, versioned, write_json

#: the layout of the JSON file; raise it when a key changes meaning
SCHEMA = 1

#: options whose values are this machine's paths: recorded by a name, not the path
_PATH_OPTIONS = {"--data-dir": "DATA_DIR", "--out": "OUT"}


class _Tee(io.TextIOBase):
    """A text stream that writes to every stream it was given."""

    def __init__(self, *streams: TextIO) -> None:
        super().__init__()
        self._streams = streams

    def write(self, text: str) -> int:
        for stream in self._streams:
            stream.write(text)
        return len(text)

    def flush(self) -> None:
        for stream in self._streams:
            stream.flush()


def command_line(argv: list[str]) -> str:
    """The command that ran, with machine-local paths replaced by generic names.

    ``argv`` is ``sys.argv``: the script keeps its file name under ``benchmarks/``; the
    values of ``--data-dir`` and ``--out`` become ``DATA_DIR`` and ``OUT/NAME``.
    """
    words = [f"python benchmarks/{Path(argv[0]).name}"] if argv else []
    rest = iter(argv[1:])
    for word in rest:
        option, equals, value = word.partition("=")
        if option in _PATH_OPTIONS:
            value = value if equals else next(rest, "")
            name = _PATH_OPTIONS[option]
            words.append(f"{option} {name}/{Path(value).name}" if option == "--out"
                         else f"{option} {name}")
        else:
            words.append(word)
    return " ".join(words)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def report_tables(text: str) -> list[dict[str, Any]]:
    """Every markdown table of ``text``: its heading, columns and rows of cells.

    A table is a maximal run of lines starting with ``|`` whose second line is the
    ``|---|`` rule; its heading is the last non-empty line above it that is not a table.
    """
    tables: list[dict[str, Any]] = []
    heading, block = "", []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append(line)
            continue
        if block:
            if len(block) >= 2 and set(block[1].replace("|", "").strip()) <= set("-: "):
                tables.append({"heading": heading, "columns": _cells(block[0]),
                               "rows": [_cells(row) for row in block[2:]]})
            block = []
        if line.strip():
            heading = line.strip()
    return tables


@contextlib.contextmanager
def printed_report(out: str | os.PathLike | None, argv: list[str] | None = None,
                   device: str = "cpu") -> Iterator[None]:
    """Keep what the block prints as ``OUT.md`` and ``OUT.json`` (nothing when ``out`` is None).

    The text still goes to standard output as it is printed. The files are written only
    when the block finishes: a benchmark that fails leaves no half report behind.

    Args:
        out: the files' path without its suffix, e.g. ``results/performance/cpu/penalty``.
        argv: the command line to record (default ``sys.argv``).
        device: the GPU's name when the benchmark timed one, else ``"cpu"``.
    """
    if out is None:
        yield
        return
    argv = sys.argv if argv is None else argv
    captured = io.StringIO()
    load_at_start = os.getloadavg()[0]
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        yield
    text = captured.getvalue()
    prefix = Path(out)
    atomic_write_text(prefix.with_name(prefix.name + ".md"), text)
    write_json(prefix.with_name(prefix.name + ".json"), versioned({
        "command": command_line(argv),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "load_average": {"start": round(load_at_start, 2),
                         "end": round(os.getloadavg()[0], 2)},
        "tables": report_tables(text),
        "text": text,
    }, SCHEMA, device))
