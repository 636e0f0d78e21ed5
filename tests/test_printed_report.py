"""A benchmark's printed report kept as files: the text as printed, its tables as JSON."""

from __future__ import annotations

import json

import pytest

from fsd_experiments.doc_tables import copied_table, markdown_tables
from fsd_experiments.printed_report import command_line, printed_report, report_tables

REPORT = """# machine: x86_64, 2 cores

## (a) step with penalty / plain step
| width | penalty | ms |
|---:|---|---:|
| 256 | none | 2.87 |
| 256 | BGLN-D full | 8.10 |

## (b) one distance call
ExactFSD: 666.5 ms, BGLN-D: 2.152 ms, ratio 310x

| K | ms |
|---:|---:|
| 9 | 20.32 |
"""


def test_the_files_hold_what_was_printed(tmp_path, capsys):
    with printed_report(tmp_path / "cpu" / "penalty",
                        ["benchmarks/penalty.py", "--repeats", "3"]):
        print(REPORT, end="")
    assert capsys.readouterr().out == REPORT  # still printed as it runs
    assert (tmp_path / "cpu" / "penalty.md").read_text() == REPORT
    saved = json.loads((tmp_path / "cpu" / "penalty.json").read_text())
    assert saved["text"] == REPORT
    assert saved["command"] == "python benchmarks/penalty.py --repeats 3"
    assert saved["device"] == "cpu" and saved["cpu"] and saved["torch_version"]
    assert set(saved["load_average"]) == {"start", "end"}
    # the docs copy table N of the .md; the JSON holds the same cells under the same number
    for number, table in enumerate(saved["tables"], 1):
        lines = copied_table("cpu/penalty.md", number, tmp_path).splitlines()
        assert [c.strip() for c in lines[0].strip("|").split("|")] == table["columns"]
        assert len(lines) - 2 == len(table["rows"])
        for line, row in zip(lines[2:], table["rows"], strict=True):
            assert [c.strip() for c in line.strip("|").split("|")] == row


def test_tables_are_found_with_their_headings():
    tables = report_tables(REPORT)
    assert len(tables) == len(markdown_tables(REPORT)) == 2
    assert tables[0] == {"heading": "## (a) step with penalty / plain step",
                         "columns": ["width", "penalty", "ms"],
                         "rows": [["256", "none", "2.87"], ["256", "BGLN-D full", "8.10"]]}
    assert tables[1]["heading"] == "ExactFSD: 666.5 ms, BGLN-D: 2.152 ms, ratio 310x"
    assert tables[1]["rows"] == [["9", "20.32"]]


def test_no_files_when_the_benchmark_fails_or_no_out_is_given(tmp_path, capsys):
    with pytest.raises(RuntimeError):
        with printed_report(tmp_path / "penalty", ["benchmarks/penalty.py"]):
            print("| a |\n|---|\n| 1 |")
            raise RuntimeError("killed half way")
    assert list(tmp_path.iterdir()) == []
    with printed_report(None):
        print("plain")
    assert capsys.readouterr().out.endswith("plain\n")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("argv, expected", [
    (["/home/me/fsd/benchmarks/penalty.py", "--data-dir", "/home/me/data", "--out",
      "/tmp/x/results/performance/cpu/penalty"],
     "python benchmarks/penalty.py --data-dir DATA_DIR --out OUT/penalty"),
    (["penalty.py", "--data-dir=/srv/data", "--sections", "ac", "--out=runs/p"],
     "python benchmarks/penalty.py --data-dir DATA_DIR --sections ac --out OUT/p"),
])
def test_the_command_names_no_local_path(argv, expected):
    assert command_line(argv) == expected
