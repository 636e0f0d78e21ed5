"""The benchmarks whose tables the docs copy still run, and write the files the docs name.

Each script runs once with its smallest settings on MNIST-shaped random data; the timings
mean nothing here. What is checked: the script finishes, its ``--out`` files hold what it
printed, and its tables have the columns of the committed result file's, in the same order,
so the docs' "table N" still names the same table after a rerun.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from datafiles import write_mnist_like

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
RESULTS = Path(__file__).resolve().parents[1] / "results" / "performance" / "cpu"

#: script, its quickest arguments, the result file's name, and how many tables it prints
CASES = [
    ("penalty.py", ["--repeats", "1", "--fit-examples", "200", "--sections", "abc"],
     "penalty_abc", 2),
    ("penalty.py", ["--repeats", "1", "--fit-examples", "200", "--sections", "defghi"],
     "penalty_defghi", 5),
    ("moments.py", ["--repeats", "1"], "moments", 2),
    ("conv_moments.py", ["--repeats", "1"], "conv_moments", 1),
    ("graph_moments.py", ["--repeats", "1", "--width", "32"], "graph_moments", 1),
    ("pbrf.py", ["--points", "2", "--steps", "2", "--width", "16"], "pbrf", 1),
    ("ewc_fisher.py", ["--examples", "8", "--widths", "16"], "ewc_fisher", 1),
    ("defaults.py", ["--repeats", "1"], "defaults", 4),
]


@pytest.fixture(scope="module")
def mnist_dir(tmp_path_factory) -> Path:
    directory = tmp_path_factory.mktemp("mnist")
    write_mnist_like(directory, per_class=40)
    return directory


@pytest.mark.slow
@pytest.mark.parametrize("script, arguments, name, tables", CASES, ids=[c[2] for c in CASES])
def test_a_benchmark_runs_and_writes_its_tables(script, arguments, name, tables, mnist_dir,
                                                tmp_path):
    out = tmp_path / name
    data = ["--data-dir", str(mnist_dir)] if script in {"penalty.py", "moments.py",
                                                         "defaults.py"} else []
    done = subprocess.run([sys.executable, script, *arguments, *data, "--out", str(out)],
                          cwd=BENCHMARKS, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads(out.with_suffix(".json").read_text())
    assert saved["text"] == out.with_suffix(".md").read_text() == done.stdout
    assert len(saved["tables"]) == tables
    assert saved["command"].startswith(f"python benchmarks/{script} ")
    assert str(mnist_dir) not in saved["command"] and str(tmp_path) not in saved["command"]
    # the committed result file has the same tables, in the same order, with the same columns
    committed = RESULTS / f"{name}.json"
    if committed.is_file():
        kept = json.loads(committed.read_text())["tables"]
        assert [t["columns"] for t in kept] == [t["columns"] for t in saved["tables"]]
