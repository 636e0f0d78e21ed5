"""The command line: help, data fetch, and the compare-estimators job on real MNIST."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from datafiles import REAL_DATA_DIR
from fsd_experiments.cli import main

DATA_DIR = REAL_DATA_DIR


def test_help_lists_commands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert "compare-estimators" in out and "data" in out


def test_python_dash_m_fsd_experiments_runs():
    result = subprocess.run([sys.executable, "-m", "fsd_experiments", "--help"],
                            capture_output=True,
                            text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert "usage: fsd" in result.stdout


def test_missing_data_is_a_clear_error(tmp_path, capsys):
    code = main(["compare-estimators", "--data-dir", str(tmp_path), "--no-download"])
    assert code == 2
    err = capsys.readouterr().err
    assert "fsd data fetch mnist" in err and str(tmp_path) in err
    with pytest.raises(SystemExit) as info:  # '' would be the current directory
        main(["compare-estimators", "--data-dir", ""])
    assert info.value.code == 2 and "--data-dir: is empty" in capsys.readouterr().err


@pytest.mark.usefixtures("real_data")
def test_data_fetch_from_local_source(tmp_path, capsys):
    assert main(["data", "fetch", "mnist", "--data-dir", str(tmp_path),
                 "--source", str(DATA_DIR / "mnist")]) == 0
    assert sorted(p.name for p in (tmp_path / "mnist").iterdir()) == sorted(
        f"{n}.gz" for n in ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte",
                            "train-images-idx3-ubyte", "train-labels-idx1-ubyte"))


@pytest.mark.usefixtures("real_data")
def test_compare_estimators_end_to_end(tmp_path, capsys):
    assert main(["compare-estimators", "--data-dir", str(DATA_DIR), "--width", "16",
                 "--repeats", "1", "--out", str(tmp_path)]) == 0
    saved = json.loads((tmp_path / "compare_estimators.json").read_text())
    assert saved["torch_version"] == torch.__version__ and saved["device"] == "cpu"
    assert saved["fsd_version"] and saved["torch_threads"] >= 1
    rows = saved["rows"]
    names = [r["estimator"] for r in rows]
    assert names[0].startswith("ExactFSD") and "BGLN-D" in names and "NTK (coreset)" in names
    true_fsd = rows[0]["true_fsd"]
    assert true_fsd > 0
    for row in rows:
        assert row["true_fsd"] == true_fsd and row["nbytes"] > 0 and row["estimate"] >= 0
    # the oracle keeps ~12.7k images; every parametric summary must be far smaller
    assert all(r["nbytes"] < rows[0]["nbytes"] / 5 for r in rows[1:])


def test_the_command_without_the_experiments_extra_says_what_to_install(tmp_path):
    # a library-only install has the console script but not scipy: a fresh interpreter in
    # which importing scipy fails, as it does there
    script = (
        "import sys\n"
        "class NoScipy:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'scipy' or name.startswith('scipy.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name='scipy')\n"
        "sys.meta_path.insert(0, NoScipy())\n"
        "from fsd_experiments.cli import main\n"
        "sys.exit(main(['cl', 'report', 'nowhere']))\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          cwd=tmp_path, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.startswith("error: the fsd command needs scipy")
    assert done.stderr.count("\n") == 1 and '.[experiments]' in done.stderr
