"""Output folders: fsd writes, locks and cleans only what is its own, and says why not.

``fsd cl --out`` takes a folder that is new, empty or marked as an fsd cl run's (older runs
without the marker are recognised by their layout); it never follows a link for its lock,
deletes only the temporary files its writers name, and puts no run inside another run's
checkpoints. A full disk, a file size limit, a FIFO or a device where a file is read or
written is one line naming the path and the reason, exit 2, nothing half-written. A
checkpoint edited after it was written, or written by a newer fsd, is refused. Other
commands refuse what would fail late (or write NaN) before they start.
"""

from __future__ import annotations

import errno
import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import fails_in_one_line, finished_cl_run
from datafiles import REAL_DATA_DIR
from fsd_experiments import continual
from fsd_experiments.cli import main

#: fsd_experiments.io.MARKER, spelled out: the file's name is part of the folders' layout
MARKER = ".fsd-output"

needs_mnist = pytest.mark.usefixtures("real_data")

CL = ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "1", "--tasks",
      "3", "--epochs", "1", "--train-subset", "50", "--test-subset", "50", "--no-plots",
      "--no-progress", "--data-dir", str(REAL_DATA_DIR)]
SRC = str(Path(continual.__file__).parents[2])


def fsd_process(argv: list[str], timeout: float = 300, limit: int | None = None
                ) -> subprocess.CompletedProcess[str]:
    """``python -m fsd_experiments argv`` in a child, optionally with a file size limit."""
    def limited() -> None:  # Python ignores SIGXFSZ: a write past the limit gets EFBIG
        if limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "fsd_experiments", *argv], text=True,
                          capture_output=True, timeout=timeout, preexec_fn=limited,
                          env={**os.environ, "PYTHONPATH": SRC})


def fill_the_disk_at(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    """Make the disk full (ENOSPC) when a file whose path holds ``name`` is synced."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if name in os.readlink(f"/proc/self/fd/{fd}"):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory: pytest.TempPathFactory, real_data: Path) -> Path:
    """A finished 3-task fine-tuning run (one seed) that the tests copy."""
    return finished_cl_run(tmp_path_factory, CL)


def _copy(run: Path, tmp_path: Path, resumable: bool = True) -> Path:
    """A copy of ``run``; ``resumable``: without its results, so that the seed is resumed."""
    out = tmp_path / "run"
    shutil.copytree(run, out, symlinks=True)
    if resumable:
        (out / "results.json").unlink()
    return out


def _contents(folder: Path) -> dict[str, bytes | str]:
    """Every entry under ``folder``: a file's bytes, a link's target, a folder's mark."""
    found: dict[str, bytes | str] = {}
    for path in sorted(folder.rglob("*")):
        key = str(path.relative_to(folder))
        found[key] = (f"-> {os.readlink(path)}" if path.is_symlink() else "dir"
                      if path.is_dir() else path.read_bytes())
    return found


# ----- 1. only folders that are new, empty or fsd's own ------------------------------------

def _someone_elses(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "notes.txt").write_text("mine")
    (folder / "results.md").write_text("my own results")
    (folder / ".lock").write_text("my lock, not a pid")
    (folder / "deep" / "er").mkdir(parents=True)
    (folder / "deep" / "er" / ".draft.tmp").write_text("a draft of mine")
    (folder / ".session.tmp").write_text("an editor's")
    return folder


def test_cl_refuses_a_folder_holding_someone_elses_files(tmp_path, capsys):
    # it deleted every .*.tmp at any depth, replaced results.md and overwrote .lock
    folder = _someone_elses(tmp_path / "home")
    before = _contents(folder)
    line = fails_in_one_line([*CL, "--out", str(folder)], capsys)
    assert line.startswith(f"error: {folder} holds files that are not an fsd cl run's ("), line
    assert "give another" in line
    assert _contents(folder) == before


def test_cl_refuses_the_current_folder_when_it_is_not_empty(tmp_path, capsys, monkeypatch):
    folder = _someone_elses(tmp_path / "cwd")
    before = _contents(folder)
    monkeypatch.chdir(folder)
    line = fails_in_one_line([*CL, "--out", "."], capsys)
    assert "holds files that are not an fsd cl run's" in line
    assert _contents(folder) == before


def test_cl_on_the_parent_of_a_run_leaves_that_run_alone(finished_run, tmp_path, capsys):
    # it deleted the live run's in-progress temporary files
    parent = tmp_path / "parent"
    run = _copy(finished_run, parent, resumable=False)
    (run / ".results.json.4242.0123abcd.tmp").write_bytes(b"being written")
    (run / "checkpoints" / "seed1" / ".fsd-state.pt.abcd_123.tmp").write_bytes(b"being written")
    before = _contents(parent)
    line = fails_in_one_line([*CL, "--out", str(parent)], capsys)
    assert line.startswith(f"error: {parent} holds files that are not an fsd cl run's (run)")
    assert _contents(parent) == before


def test_cl_tune_refuses_a_folder_holding_someone_elses_files(tmp_path, capsys):
    folder = _someone_elses(tmp_path / "home")
    before = _contents(folder)
    line = fails_in_one_line(["cl", "tune", *CL[1:], "--seeds", "1", "--grid", "1",
                              "--out", str(folder)], capsys)
    assert line.startswith(f"error: {folder} holds files that are not an fsd cl tune's (")
    assert _contents(folder) == before


@needs_mnist
def test_resuming_removes_only_the_temporaries_fsd_wrote(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    ours = [run / ".results.json.4242.0123abcd.tmp",
            run / "checkpoints" / "seed1" / ".fsd-state.pt.abcd_123.tmp",
            run / "checkpoints" / "seed1" / ".state.pt.99.deadbeef.tmp"]
    for path in ours:
        path.write_bytes(b"half a file")
    # the user's own files in the run's folder: kept, whatever their names
    theirs = [run / "notes.txt", run / "drafts" / ".draft.tmp", run / "draft.tmp"]
    (run / "drafts").mkdir()
    for path in theirs:
        path.write_text("mine")
    precious = tmp_path / "precious.txt"
    precious.write_text("mine")
    (run / ".results.md.77.cafef00d.tmp").symlink_to(precious)  # a link is never fsd's
    capsys.readouterr()
    assert main([*CL, "--out", str(run)]) == 0
    assert not any(path.exists() for path in ours)
    assert all(path.read_text() == "mine" for path in theirs)
    assert (run / ".results.md.77.cafef00d.tmp").is_symlink() and precious.read_text() == "mine"


@needs_mnist
def test_a_run_folder_of_an_earlier_fsd_is_recognised_and_resumed(finished_run, tmp_path,
                                                                  capsys):
    # before the marker: a run's layout and nothing foreign (here with the docs' row files)
    run = _copy(finished_run, tmp_path, resumable=False)
    (run / MARKER).unlink(missing_ok=True)
    (run / "gap.md").write_text("| table |\n")
    first = json.loads((run / "results.json").read_text())
    capsys.readouterr()
    assert main([*CL, "--out", str(run)]) == 0
    assert "] task" not in capsys.readouterr().err  # finished: nothing trained again
    assert json.loads((run / "results.json").read_text())["accuracy_matrix"] == \
        first["accuracy_matrix"]
    assert json.loads((run / MARKER).read_text()) == {"kind": "cl run"}  # adopted


# ----- 2. the lock is never followed --------------------------------------------------------

def test_a_lock_that_is_a_symbolic_link_is_not_followed(finished_run, tmp_path, capsys):
    # `ln -s precious.txt RUN/.lock`: precious.txt ended up holding a process id
    run = _copy(finished_run, tmp_path, resumable=False)
    precious = tmp_path / "precious.txt"
    precious.write_text("precious")
    (run / ".lock").unlink()
    (run / ".lock").symlink_to(precious)
    line = fails_in_one_line([*CL, "--out", str(run)], capsys)
    assert line.startswith(f"error: {run / '.lock'} is a symbolic link, not fsd's lock file"), \
        line
    assert "remove it" in line
    assert precious.read_text() == "precious"


def test_a_lock_that_is_a_fifo_is_refused(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path, resumable=False)
    (run / ".lock").unlink()
    os.mkfifo(run / ".lock")
    line = fails_in_one_line([*CL, "--out", str(run)], capsys)
    assert line.startswith(f"error: {run / '.lock'} is a FIFO, not fsd's lock file"), line


# ----- 4. full disks, file size limits, FIFOs and devices -------------------------------------

@needs_mnist
def test_a_full_disk_while_writing_a_checkpoint_is_one_line(tmp_path, capsys, monkeypatch):
    # the disk fills up as the first checkpoint is written (the marker was written before)
    fill_the_disk_at(monkeypatch, "state.pt")
    out = tmp_path / "run"
    state = out / "checkpoints" / "seed1" / "state.pt"
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    assert line == (f"error: {state}: No space left on device; free some space there or "
                    "write elsewhere, then run again")
    assert not state.exists() and not list(out.rglob("*.tmp"))  # nothing half-written
    monkeypatch.undo()  # space again
    assert main([*CL, "--out", str(out)]) == 0  # space again: the run starts over


def test_a_full_disk_while_merging_leaves_no_half_copied_checkpoints(finished_run, tmp_path,
                                                                     capsys, monkeypatch):
    # shutil.Error's list of tuples, and the checkpoints copied so far left in --out
    def no_link(source, destination):
        raise OSError(errno.EXDEV, os.strerror(errno.EXDEV), source, None, destination)

    def full(source, destination, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "link", no_link)
    monkeypatch.setattr(shutil, "copy2", full)
    out = tmp_path / "merged"
    line = fails_in_one_line(["cl", "merge", str(finished_run), "--out", str(out),
                              "--no-plots"], capsys)
    assert line == (f"error: {out / 'checkpoints' / 'seed1' / 'state.pt'}: No space left on "
                    "device; free some space there or write elsewhere, then run again")
    assert not (out / "checkpoints").exists() and not (out / "results.json").exists()


@needs_mnist
def test_a_file_size_limit_while_writing_a_checkpoint_is_one_line(tmp_path):
    # ulimit -f: torch's writer gave a traceback without the file or the reason, exit 1
    out = tmp_path / "run"
    state = out / "checkpoints" / "seed1" / "state.pt"
    done = fsd_process([*CL, "--out", str(out)], limit=1 << 20)  # a checkpoint is ~3 MB
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0] == (f"error: {state}: File too large; a file size limit (ulimit -f) "
                        "stopped the write: raise it or write elsewhere, then run again")
    assert not state.exists() and not list(out.rglob("*.tmp"))


@needs_mnist
def test_a_checkpoint_that_is_a_fifo_is_refused_not_waited_on(finished_run, tmp_path):
    # torch.load waited for a writer for ever
    run = _copy(finished_run, tmp_path)
    state = run / "checkpoints" / "seed1" / "state.pt"
    state.unlink()
    os.mkfifo(state)
    try:
        done = fsd_process([*CL, "--out", str(run)], timeout=120)
    except subprocess.TimeoutExpired:
        pytest.fail("fsd cl waited on the FIFO")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip() == (f"error: {state} is a FIFO, not a checkpoint file; delete "
                                   f"{state.parent} to start seed 1 over")


@needs_mnist
def test_a_results_file_that_is_a_fifo_is_refused_before_training(finished_run, tmp_path,
                                                                  capsys):
    # it trained, then replaced the FIFO by a file
    run = _copy(finished_run, tmp_path, resumable=False)
    (run / "results.json").unlink()
    os.mkfifo(run / "results.json")
    line = fails_in_one_line([*CL, "--out", str(run), "--seeds", "2"], capsys)
    assert line.startswith(f"error: {run / 'results.json'} is a FIFO, not a regular file"), line
    assert not (run / "checkpoints" / "seed2").exists()  # nothing trained
    assert (run / "results.json").is_fifo()


def test_report_out_that_is_a_fifo_is_refused(finished_run, tmp_path, capsys):
    # the FIFO was replaced by the table (a device would have been too, as root)
    fifo = tmp_path / "table.md"
    os.mkfifo(fifo)
    line = fails_in_one_line(["cl", "report", str(finished_run), "--out", str(fifo)], capsys)
    assert line.endswith(f"argument --out: {fifo} is a FIFO, not a regular file: give a file "
                         f"name (fsd cl report --help lists the options)"), line
    assert fifo.is_fifo()


def test_cl_out_that_is_a_device_says_so(capsys):
    line = fails_in_one_line([*CL, "--out", "/dev/null"], capsys)
    assert "argument --out: /dev/null is a character device, not a directory" in line, line


# ----- 8. checkpoints edited after fsd wrote them, or from a newer fsd ---------------------------

@needs_mnist
def test_a_checkpoint_whose_matrix_was_cut_is_refused(finished_run, tmp_path, capsys):
    # a matrix cut to 2 rows resumed: task 3 trained again on top of its own weights
    run = _copy(finished_run, tmp_path)
    path = run / "checkpoints" / "seed1" / "state.pt"
    state = torch.load(path, weights_only=True)
    torch.save({**state, "matrix": state["matrix"][:2]}, path)
    line = fails_in_one_line([*CL, "--out", str(run)], capsys)
    assert line == (f"error: {path} was changed after fsd wrote it (its contents do not match "
                    f"the sha256 written with them), and resuming it would give other numbers; "
                    f"delete {path.parent} to start seed 1 over")
    assert not (run / "results.json").exists()


@needs_mnist
def test_a_checkpoint_of_a_newer_version_is_refused(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    path = run / "checkpoints" / "seed1" / "state.pt"
    torch.save({**torch.load(path, weights_only=True), "version": 99}, path)
    line = fails_in_one_line([*CL, "--out", str(run)], capsys)
    assert line == (f"error: {path} was written by a newer fsd (checkpoint version 99; this "
                    f"fsd reads up to 3): use that fsd; delete {path.parent} to start seed 1 "
                    "over")


@needs_mnist
def test_a_checkpoint_from_before_checksums_still_resumes(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path)
    path = run / "checkpoints" / "seed1" / "state.pt"
    state = torch.load(path, weights_only=True)
    state.pop("sha256", None)
    torch.save({**state, "version": 2}, path)
    capsys.readouterr()
    assert main([*CL, "--out", str(run)]) == 0
    assert "] task" not in capsys.readouterr().err  # after its last task: nothing trained


# ----- 9. refused before the work starts --------------------------------------------------------

@pytest.mark.parametrize("option", ["--estimators", "--minimize-estimators"])
def test_fidelity_unknown_estimator_exits_2(option, tmp_path, capsys):
    # exit 1 (a SystemExit with the message)
    line = fails_in_one_line(["fidelity", "--out", str(tmp_path / "out"), "--data-dir",
                              str(tmp_path / "no-data"), option, "bogus"], capsys)
    assert line.startswith("error: unknown estimators ['bogus']; choose from "), line
    assert not (tmp_path / "out").exists()


def test_compare_out_below_a_file_is_refused_while_parsing(tmp_path, capsys):
    # it trained and timed every estimator, then failed to create the folder
    (tmp_path / "afile").write_text("")
    out = tmp_path / "afile" / "x"
    line = fails_in_one_line(["compare-estimators", "--no-download", "--data-dir",
                              str(tmp_path / "no-data"), "--out", str(out)], capsys)
    assert f"argument --out: {out} cannot be created: {tmp_path / 'afile'} is a file, not a " \
           "directory" in line, line


@needs_mnist
def test_influence_mislabeled_without_corrupted_points_is_refused(tmp_path, capsys):
    # --n-train 1 corrupts round(0.1) = 0 labels: results.md held nan, exit 0
    out = tmp_path / "out"
    line = fails_in_one_line(["influence", "mislabeled", "--out", str(out), "--data-dir",
                              str(REAL_DATA_DIR), "--n-train", "1", "--methods", "random",
                              "--epochs", "1", "--no-progress"], capsys)
    assert line == ("error: the pool of 1 points holds no corrupted labels (0 of the 1 "
                    "training images are corrupted), so detection cannot be scored: raise "
                    "--n-train or --pool, or change --corrupt")
    assert not (out / "results.md").exists()


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/seed1/sub"])
def test_cl_out_inside_a_runs_checkpoints_is_refused(inside, finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path, resumable=False)
    before = _contents(run)
    out = run / inside
    line = fails_in_one_line([*CL, "--out", str(out)], capsys)
    where = "" if inside == "checkpoints" else f" is inside {run / 'checkpoints'}, which"
    assert line == (f"error: {out}{where} is the checkpoint folder of an fsd cl run: give a "
                    f"directory outside it")
    assert _contents(run) == before


def test_cl_merge_into_a_runs_checkpoints_is_refused(finished_run, tmp_path, capsys):
    run = _copy(finished_run, tmp_path, resumable=False)
    out = run / "checkpoints" / "merged"
    line = fails_in_one_line(["cl", "merge", str(finished_run), "--out", str(out),
                              "--no-plots"], capsys)
    assert "is the checkpoint folder of an fsd cl run" in line
    assert not out.exists()


# ----- 10. the other commands' --out: new, empty or their own ------------------------------------

TOY = ["toy", "--steps", "30", "--seeds", "1", "--width", "16"]
UCI = ["influence", "uci", "--dataset", "concrete", "--subset", "60", "--removals", "3",
       "--epochs", "1", "--pbrf-epochs", "1", "--lrs", "0.1", "--cg-iters", "3", "--methods",
       "exact", "ewc", "--no-progress"]
OTHER_COMMANDS = ["fidelity", "toy", "influence uci", "influence mislabeled",
                  "compare-estimators", "memory"]


@pytest.fixture(scope="module")
def uci_data(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """``--data-dir`` of a folder holding the UCI tables (copied from the package: offline)."""
    from fsd_experiments.data import fetch

    folder = tmp_path_factory.mktemp("data")
    fetch("uci", folder)
    return ["--data-dir", str(folder)]


def _fastest(command: str, tmp_path: Path, uci_data: list[str]) -> list[str]:
    """``fsd command``'s quickest arguments, ``--out`` left out; MNIST's find no data.

    A refusal must come before the data loads and the training.
    """
    no_data = ["--no-download", "--data-dir", str(tmp_path / "no-data")]
    return {"fidelity": ["fidelity", *no_data], "toy": TOY, "influence uci": [*UCI, *uci_data],
            "influence mislabeled": ["influence", "mislabeled", "--no-progress", *no_data],
            "compare-estimators": ["compare-estimators", *no_data],
            "memory": ["memory", "--arch", "mnist-mlp", "--no-measure"]}[command]


def _marked(folder: Path, kind: str) -> Path:
    """``folder`` with fsd's marker naming ``kind``, as fsd writes it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / MARKER).write_text(json.dumps({"kind": kind}) + "\n")
    return folder


@pytest.mark.parametrize("command", OTHER_COMMANDS)
def test_other_commands_refuse_a_folder_holding_someone_elses_files(command, tmp_path, uci_data,
                                                                   capsys):
    # toy, memory and influence uci wrote beside the user's files (uci replaced results.md);
    # fidelity, mislabeled and compare-estimators failed only for want of MNIST
    folder = _someone_elses(tmp_path / "home")
    before = _contents(folder)
    line = fails_in_one_line([*_fastest(command, tmp_path, uci_data), "--out", str(folder)],
                             capsys)
    assert line == (f"error: {folder} holds files that are not an fsd {command} run's (.lock, "
                    ".session.tmp, deep, ...): fsd writes only into a new or empty directory, "
                    "or one it made; give another")
    assert _contents(folder) == before


def test_a_folder_of_another_fsd_command_is_refused(tmp_path, capsys):
    # fidelity would have written its results beside toy's (it failed for want of MNIST)
    folder = _marked(tmp_path / "toy", "toy run")
    (folder / "toy.md").write_text("toy's table")
    line = fails_in_one_line([*_fastest("fidelity", tmp_path, []), "--out", str(folder)],
                             capsys)
    assert line == (f"error: {folder} is an fsd toy run folder, not an fsd fidelity run folder: "
                    "give a new or empty directory")
    assert sorted(p.name for p in folder.iterdir()) == [MARKER, "toy.md"]


def test_toy_adopts_an_earlier_fsds_folder_and_reruns_into_its_own(tmp_path):
    # an earlier fsd's toy folder: its files and nothing else (a killed write's too)
    out = tmp_path / "toy"
    out.mkdir()
    for name in ("toy.json", "toy.md", "toy.png"):
        (out / name).write_text("an earlier run's")
    (out / ".toy.png.4242.0123abcd.tmp").write_bytes(b"half a PNG")
    assert main([*TOY, "--out", str(out)]) == 0
    assert json.loads((out / MARKER).read_text()) == {"kind": "toy run"}  # adopted
    assert (out / "toy.png").read_bytes().startswith(b"\x89PNG")
    assert main([*TOY, "--lam", "2", "--out", str(out)]) == 0  # its own: rewritten
    assert json.loads((out / "toy.json").read_text())["config"]["lam"] == 2.0


def test_influence_uci_adopts_an_earlier_uci_folder_but_not_a_mislabeled_one(tmp_path, uci_data,
                                                                             capsys):
    data = uci_data
    earlier = tmp_path / "uci"
    (earlier / "concrete").mkdir(parents=True)
    (earlier / "results.md").write_text("an earlier summary")
    (earlier / "results.json").write_text(json.dumps({"experiment": "uci"}))
    (earlier / "concrete" / "scatter.png").write_bytes(b"an earlier plot")
    assert main([*UCI, *data, "--out", str(earlier)]) == 0
    assert json.loads((earlier / MARKER).read_text()) == {"kind": "influence uci run"}
    assert (earlier / "results.md").read_text().startswith("# Influence estimation on UCI")
    # the same names, but a mislabeled run's results: not uci's to overwrite
    mislabeled = tmp_path / "mislabeled"
    mislabeled.mkdir()
    (mislabeled / "results.json").write_text(json.dumps({"experiment": "mislabeled"}))
    (mislabeled / "results.md").write_text("a mislabeled table")
    before = _contents(mislabeled)
    line = fails_in_one_line([*UCI, *data, "--out", str(mislabeled)], capsys)
    assert line.startswith(f"error: {mislabeled} holds files that are not an fsd influence uci "
                           "run's (results.json, results.md): "), line
    assert _contents(mislabeled) == before


def test_influence_uci_never_writes_through_a_data_set_folder_that_is_a_link(tmp_path, uci_data,
                                                                             capsys):
    # the results went into the folder the link pointed at
    out = _marked(tmp_path / "run", "influence uci run")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (out / "concrete").symlink_to(elsewhere)
    line = fails_in_one_line([*UCI, *uci_data, "--out", str(out)], capsys)
    assert line == (f"error: {out / 'concrete'} is a symbolic link, not a folder: fsd writes "
                    "the concrete results into a folder of its own there; remove it or give "
                    "another --out")
    assert not any(elsewhere.iterdir())


def test_a_result_file_that_is_a_fifo_is_refused_before_the_work(tmp_path, capsys):
    # toy trained and drew toy.png first
    out = _marked(tmp_path / "toy", "toy run")
    os.mkfifo(out / "toy.json")
    line = fails_in_one_line([*TOY, "--out", str(out)], capsys)
    assert line == (f"error: {out / 'toy.json'} is a FIFO, not a regular file: fsd writes its "
                    "results as regular files; remove it or write elsewhere")
    assert not (out / "toy.png").exists() and (out / "toy.json").is_fifo()


def test_a_full_disk_while_writing_a_plot_leaves_no_half_png(tmp_path, capsys, monkeypatch):
    # savefig wrote straight into toy.png: a full disk left half a PNG behind
    fill_the_disk_at(monkeypatch, "toy.png")
    out = tmp_path / "toy"
    line = fails_in_one_line([*TOY, "--out", str(out)], capsys)
    assert line == (f"error: {out / 'toy.png'}: No space left on device; free some space there "
                    "or write elsewhere, then run again")
    assert not (out / "toy.png").exists() and not list(out.glob(".*.tmp"))


COMMITTED = Path(__file__).resolve().parents[1] / "results"


@pytest.mark.parametrize("folder, argv, kind", [
    ("fidelity/split-mnist", ["fidelity", "--benchmark", "split-mnist", "{no-data}"],
     "fidelity run"),
    ("fidelity/toy", TOY, "toy run"),
    ("fidelity/memory", ["memory", "--arch", "mnist-mlp", "--no-measure"], "memory run"),
    ("influence/uci/U3", [*UCI, "{uci-data}"], "influence uci run"),
    ("influence/mislabeled/M1-seed0", ["influence", "mislabeled", "{no-data}"],
     "influence mislabeled run"),
])
def test_the_committed_results_folders_are_their_commands_own(folder, argv, kind, tmp_path,
                                                              uci_data, capsys):
    # written before the marker: rerunning a command into its results/ folder is not refused
    out = tmp_path / "copy"
    shutil.copytree(COMMITTED / folder, out)
    data = {"{no-data}": ["--no-download", "--data-dir", str(tmp_path / "no-data")],
            "{uci-data}": uci_data}
    code = main([b for a in argv for b in data.get(a, [a])] + ["--out", str(out)])
    if "{no-data}" in argv:  # stopped for want of MNIST, after claiming the folder
        assert code == 2 and "error: MNIST is not in" in capsys.readouterr().err
    else:
        assert code == 0
    assert json.loads((out / MARKER).read_text()) == {"kind": kind}
