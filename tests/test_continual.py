"""The continual-learning harness ``fsd cl``: metrics, tiny end-to-end runs, kill and resume."""

from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from datafiles import REAL_DATA_DIR
from fsd import load as fsd_load
from fsd_experiments import continual
from fsd_experiments.cli import main
from fsd_experiments.compat import CL_RESULTS_SCHEMA, cl_hyperparameters
from fsd_experiments.continual import reporting
from fsd_experiments.continual.reporting import _protocol
from fsd_experiments.continual.tune import grid_edge
from fsd_experiments.devices import cpu_name
from fsd_experiments.models import mlp

DATA_DIR = REAL_DATA_DIR
needs_mnist = pytest.mark.usefixtures("real_data")

TINY = ["--epochs", "1", "--train-subset", "200", "--test-subset", "100", "--tasks", "3",
        "--no-progress", "--num-samples", "16", "--data-dir", str(DATA_DIR)]


# ----- metrics ------------------------------------------------------------------------------

def test_average_accuracy_and_backward_transfer_by_hand():
    r = [[90.0, 10.0, 20.0],
         [80.0, 95.0, 30.0],
         [70.0, 85.0, 99.0]]
    assert continual.average_accuracy(r) == pytest.approx((70 + 85 + 99) / 3)
    # ((70 − 90) + (85 − 95)) / 2
    assert continual.backward_transfer(r) == pytest.approx(-15.0)
    assert continual.backward_transfer([[50.0]]) == 0.0
    s = continual.accuracy_summary([1.0, 3.0])
    assert s["mean"] == 2.0 and s["std"] == 1.0 and s["per_seed"] == [1.0, 3.0]


def test_paper_defaults_follow_the_appendix_tables():
    d = continual.default_hyperparameters("split-mnist", "bgln-d")
    assert (d["epochs"], d["fsd_scale"], d["batch_size"], d["lr"], d["width"]) == \
        (15, 0.1, 32, 1e-3, 256)
    assert continual.default_hyperparameters("split-mnist", "bgln-s")["lr"] == 1e-4
    p = continual.default_hyperparameters("permuted-mnist", "bgln-d")
    assert (p["epochs"], p["fsd_scale"], p["batch_size"], p["lr"], p["width"]) == \
        (15, 0.005, 128, 1e-4, 512)
    # the paper's 1e-4 is for every BGLN-D row on Permuted MNIST, and for no other method
    slow = {m for m in continual.METHODS
            if continual.default_hyperparameters("permuted-mnist", m)["lr"] == 1e-4}
    assert slow == {"bgln-d", "bgln-d-exact", "bgln-d-layerwise", "bgln-d-cw", "bgln-d-var",
                    "bgln-d-no-gate-variance", "bgln-d-no-cross-covariance", "bgln-d-corrected",
                    "bgln-d-corrected-cut", "bgln-d-corrected-cw", "bgln-d-corrected-fired"}
    assert continual.default_hyperparameters("split-mnist", "bgln-d-cw")["lr"] == 1e-3
    assert continual.default_hyperparameters("permuted-mnist", "ntk")["epochs"] == 5
    with pytest.raises(ValueError, match="unknown method"):
        continual.default_hyperparameters("split-mnist", "nope")
    assert set(continual.METHODS) >= {
        "finetune", "ewc", "ntk", "exact-coreset", "laftr", "laftr-coreset", "bgln-s", "bgln-d",
        "bgln-s-cw", "bgln-d-cw", "bgln-s-var", "bgln-d-var", "bgln-s-coreset"}


def test_report_table_from_a_handmade_results_file(tmp_path):
    res = {"benchmark": "split-mnist", "method": "bgln-d", "seeds": [1, 2],
           "seeds_requested": [1, 2], "complete": True,
           "accuracy_matrix": {"1": [[99.0, 50.0], [98.0, 97.0]],
                               "2": [[99.0, 50.0], [99.0, 97.0]]},
           "avg_accuracy": continual.accuracy_summary([97.5, 98.0]),
           "backward_transfer": continual.accuracy_summary([-1.0, 0.0]),
           "wall_seconds": {"per_seed": [60.0, 60.0], "total": 120.0},
           "summary_bytes_per_task": 1234.0,
           "hyperparameters": continual.default_hyperparameters("split-mnist", "bgln-d")}
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "results.json").write_text(json.dumps(res))
    table = continual.report([str(tmp_path)])
    assert "| split-mnist | bgln-d | 1,2 | 97.75 ± 0.25 | 99.72 ± 0.03 | -0.50 ± 0.50 | " \
           "-0.09 ± 0.04 | 1,234 | 1.0 min/seed |" in table
    assert "not paper protocol" not in table
    # results.json files of other commands under the same folder are passed over
    (tmp_path / "influence").mkdir()
    (tmp_path / "influence" / "results.json").write_text(json.dumps({"dataset": "energy"}))
    assert continual.report([str(tmp_path)]).count("| split-mnist |") == 1
    # a run on a GPU says so in its protocol column
    res["device"] = "NVIDIA H200"
    (tmp_path / "run" / "results.json").write_text(json.dumps(res))
    assert ", on NVIDIA H200 |" in continual.report([str(tmp_path)])
    # a CPU run with more than one torch thread says how many beside its wall time
    res["device"], res["torch_threads"] = "cpu", 4
    (tmp_path / "run" / "results.json").write_text(json.dumps(res))
    assert "| 1.0 min/seed (4 threads) |" in continual.report([str(tmp_path)])


def test_comparison_plot_draws_each_runs_accuracies(tmp_path, capsys):
    from fsd_experiments.continual.reporting import _comparison_figure, _read_runs
    matrices = {"finetune": {"1": [[99.0, 50.0, 40.0], [60.0, 98.0, 45.0], [30.0, 70.0, 97.0]],
                             "2": [[97.0, 50.0, 40.0], [62.0, 96.0, 45.0], [34.0, 72.0, 99.0]]},
                "bgln-d": {"1": [[99.0, 50.0, 40.0], [97.0, 98.0, 45.0], [96.0, 95.0, 97.0]]}}
    for method, matrix in matrices.items():
        res = {"benchmark": "split-mnist", "method": method, "seeds": [int(s) for s in matrix],
               "seeds_requested": [int(s) for s in matrix], "complete": True,
               "accuracy_matrix": matrix,
               "avg_accuracy": continual.accuracy_summary([90.0] * len(matrix)),
               "backward_transfer": continual.accuracy_summary([-1.0] * len(matrix)),
               "wall_seconds": {"per_seed": [60.0] * len(matrix), "total": 60.0 * len(matrix)},
               "summary_bytes_per_task": 0.0,
               "hyperparameters": continual.default_hyperparameters("split-mnist", method)}
        (tmp_path / method).mkdir()
        (tmp_path / method / "results.json").write_text(json.dumps(res))
    fig = _comparison_figure(_read_runs([str(tmp_path)]))
    (ax,) = fig.axes
    thick = {line.get_label().split(":")[0]: line for line in ax.lines if line.get_lw() > 2}
    # the mean over tasks trained so far, of the seeds' mean matrix, after each task
    assert list(thick["finetune"].get_ydata()) == pytest.approx([98.0, 79.0, 67.0])
    assert list(thick["bgln-d"].get_ydata()) == pytest.approx([99.0, 97.5, 96.0])
    assert thick["finetune"].get_label() == "finetune: 67.00 % after task 3, 2 seeds"
    thin = [list(line.get_ydata()) for line in ax.lines if line.get_lw() < 2]
    assert [99.0, 97.0, 96.0] in thin and [98.0, 97.0] not in thin and len(thin) == 6
    # through the command: the table and the figure file
    assert main(["cl", "report", str(tmp_path), "--plot", str(tmp_path / "c.png")]) == 0
    assert (tmp_path / "c.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.count("| split-mnist |") == 2
    with pytest.raises(SystemExit) as info:  # refused while parsing, before any table
        main(["cl", "report", str(tmp_path), "--plot", str(tmp_path / "c.bad")])
    assert info.value.code == 2 and "--plot: must end in .png" in capsys.readouterr().err


# ----- end to end through the CLI ------------------------------------------------------------

def _run(out: Path, benchmark: str, method: str, *extra: str) -> dict:
    code = main(["cl", "--benchmark", benchmark, "--method", method, "--seeds", "3",
                 "--out", str(out), "--no-plots", *TINY, *extra])
    assert code == 0
    return json.loads((out / "results.json").read_text())


@needs_mnist
@pytest.mark.parametrize("method", ["finetune", "bgln-d", "bgln-s", "ntk", "ewc", "osla",
                                    "exact-coreset"])
def test_split_mnist_tiny_end_to_end(tmp_path, method):
    res = _run(tmp_path, "split-mnist", method)
    matrix = res["accuracy_matrix"]["3"]
    assert len(matrix) == 3 and all(len(row) == 3 for row in matrix)
    assert res["seeds"] == [3] and res["complete"]
    # a binary task is learnt well above chance even from 200 examples and one epoch
    assert matrix[0][0] > 80
    assert res["avg_accuracy"]["mean"] == pytest.approx(sum(matrix[-1]) / 3)
    assert (res["summary_bytes_per_task"] > 0) == (method != "finetune")
    assert {"benchmark", "method", "seeds", "accuracy_matrix", "avg_accuracy",
            "backward_transfer", "wall_seconds", "hyperparameters"} <= set(res)
    assert res["device"] == "cpu"
    assert "avg accuracy" in (tmp_path / "results.md").read_text()


@needs_mnist
@pytest.mark.parametrize("method", ["bgln-s-cw", "bgln-d-cw", "bgln-s-var", "bgln-d-var",
                                    "bgln-d-exact", "bgln-d-layerwise",
                                    "laftr", "laftr-coreset", "bgln-s-coreset"])
def test_other_methods_run(tmp_path, method):
    res = _run(tmp_path, "split-mnist", method, "--tasks", "2", "--width", "32")
    assert len(res["accuracy_matrix"]["3"]) == 2
    assert res["summary_bytes_per_task"] > 0


@needs_mnist
@pytest.mark.parametrize("method", ["bgln-d", "bgln-s", "finetune", "ntk", "ewc",
                                    "exact-coreset"])
def test_permuted_mnist_tiny_end_to_end(tmp_path, method):
    res = _run(tmp_path, "permuted-mnist", method, "--width", "32", "--batch-size", "20",
               "--lr", "0.003")
    matrix = res["accuracy_matrix"]["3"]
    assert len(matrix) == 3
    assert matrix[0][0] > 40  # ten classes, 200 examples, one epoch: far above chance (10)
    assert matrix[1][1] > 25  # the permuted task is learnt too (chance: 10)


@needs_mnist
def test_plots_and_report_cli(tmp_path, capsys):
    code = main(["cl", "--benchmark", "split-mnist", "--method", "bgln-d", "--seeds", "3", "4",
                 "--out", str(tmp_path / "run"), *TINY, "--tasks", "2"])
    assert code == 0
    assert (tmp_path / "run" / "accuracy_matrix.png").stat().st_size > 0
    assert (tmp_path / "run" / "task_accuracy.png").stat().st_size > 0
    res = json.loads((tmp_path / "run" / "results.json").read_text())
    assert res["seeds"] == [3, 4] and len(res["avg_accuracy"]["per_seed"]) == 2
    assert main(["cl", "report", str(tmp_path), "--out", str(tmp_path / "r.md")]) == 0
    text = (tmp_path / "r.md").read_text()
    assert "bgln-d" in text and "99.72 ± 0.03" in text and "not paper protocol" in text


def test_missing_data_gives_clear_error(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FSD_NO_DOWNLOAD", "1")
    code = main(["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "1",
                 "--out", str(tmp_path / "o"), "--data-dir", str(tmp_path / "empty")])
    assert code == 2
    assert "fsd data fetch mnist" in capsys.readouterr().err


# ----- crash safety ----------------------------------------------------------------------------

@needs_mnist
def test_killed_run_resumes_after_last_finished_task(tmp_path, capsys):
    args = [sys.executable, "-m", "fsd_experiments", "cl", "--benchmark", "split-mnist", "--method",
            "bgln-d", "--seeds", "5", "--no-plots", "--epochs", "2", "--train-subset", "800",
            "--width", "64",
            "--test-subset", "100", "--tasks", "3", "--no-progress", "--data-dir",
            str(DATA_DIR)]
    killed, clean = tmp_path / "killed", tmp_path / "clean"
    env = {**os.environ, "PYTHONPATH": str(Path(continual.__file__).parents[2])}
    proc = subprocess.Popen([*args, "--out", str(killed)], env=env, stderr=subprocess.PIPE,
                            stdout=subprocess.DEVNULL, text=True)
    state = killed / "checkpoints" / "seed5" / "state.pt"
    deadline = time.monotonic() + 60
    while not state.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert state.exists(), "task 1's checkpoint never appeared"
    assert not (killed / "results.json").exists(), "the run finished before it was killed"

    second = subprocess.run([*args, "--out", str(killed)], env=env, capture_output=True,
                            text=True, check=True)
    assert "resuming after task 1/3" in second.stderr
    assert "task 1/3 (0/1)" not in second.stderr  # task 1 was not trained again
    # the uninterrupted reference run, in this process (same code, one thread, same seed)
    assert main([*args[3:], "--out", str(clean)]) == 0
    resumed = json.loads((killed / "results.json").read_text())
    reference = json.loads((clean / "results.json").read_text())
    assert resumed["accuracy_matrix"] == reference["accuracy_matrix"]
    assert resumed["summary_bytes_per_task"] == reference["summary_bytes_per_task"]

    # a finished run started again trains nothing and keeps its results
    capsys.readouterr()
    assert main([*args[3:], "--out", str(clean)]) == 0
    assert "] task" not in capsys.readouterr().err
    assert json.loads((clean / "results.json").read_text())["accuracy_matrix"] == \
        reference["accuracy_matrix"]


@needs_mnist
def test_a_second_process_on_the_same_directory_is_refused(tmp_path):
    # two fsd cl processes with different settings on one --out: the second is refused with
    # one line naming the first's pid, and the first's results are exactly a lone run's
    # long enough (≈ 10 s) that the second process starts while the first still runs
    common = ["--benchmark", "split-mnist", "--seeds", "5", "--no-plots", "--epochs", "2",
              "--train-subset", "2000", "--width", "32", "--test-subset", "100", "--tasks", "4",
              "--no-progress", "--data-dir", str(DATA_DIR)]
    first_args = ["cl", "--method", "bgln-d", *common]
    shared, lone = tmp_path / "shared", tmp_path / "lone"
    env = {**os.environ, "PYTHONPATH": str(Path(continual.__file__).parents[2])}
    first = subprocess.Popen([sys.executable, "-m", "fsd_experiments", *first_args, "--out",
                              str(shared)], env=env, stderr=subprocess.PIPE,
                             stdout=subprocess.DEVNULL, text=True)
    lock = shared / ".lock"
    deadline = time.monotonic() + 60
    while not (lock.exists() and lock.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.02)
    second = subprocess.run([sys.executable, "-m", "fsd_experiments", "cl", "--method",
                             "finetune", *common, "--out", str(shared)], env=env,
                            capture_output=True, text=True)
    still_running = first.poll() is None
    first.wait(timeout=600)
    assert still_running, "the first run ended before the second one started: lengthen it"
    assert first.returncode == 0, first.stderr.read() if first.stderr else ""
    assert second.returncode == 2
    lines = [line for line in second.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and f"in use by another fsd process (pid {first.pid})" in lines[0]
    assert main([*first_args, "--out", str(lone)]) == 0
    together = json.loads((shared / "results.json").read_text())
    alone = json.loads((lone / "results.json").read_text())
    assert together["method"] == "bgln-d"
    assert together["accuracy_matrix"] == alone["accuracy_matrix"]
    assert together["summary_bytes_per_task"] == alone["summary_bytes_per_task"]
    # the lock goes with the process: the directory can be used again at once, and the
    # temporary files of a write killed before its rename are cleared then
    stale = [shared / ".fsd-killed.tmp", shared / "checkpoints" / "seed5" / ".state.pt.1.a.tmp"]
    for path in stale:
        path.write_bytes(b"half a file")
    assert main([*first_args, "--out", str(shared)]) == 0
    assert not any(path.exists() for path in stale)


@needs_mnist
def test_results_of_finished_seeds_accumulate_over_reruns(tmp_path, capsys):
    def cl(*seeds, extra=()):
        return main(["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds",
                     *map(str, seeds), "--out", str(tmp_path / "run"), "--no-plots", *TINY,
                     *extra])

    assert cl(3) == 0
    first = json.loads((tmp_path / "run" / "results.json").read_text())
    assert cl(4) == 0  # another seed, same directory: seed 3 stays
    both = json.loads((tmp_path / "run" / "results.json").read_text())
    assert both["seeds"] == [3, 4]
    assert both["accuracy_matrix"]["3"] == first["accuracy_matrix"]["3"]
    capsys.readouterr()
    assert cl(5, extra=("--epochs", "2")) == 2  # other settings: refused, nothing lost
    assert "results.json was written with other settings" in capsys.readouterr().err
    assert json.loads((tmp_path / "run" / "results.json").read_text()) == both
    # merging into one of the inputs is refused
    assert main(["cl", "merge", str(tmp_path / "run"), "--out", str(tmp_path / "run")]) == 2
    assert "is one of the runs merged" in capsys.readouterr().err


@needs_mnist
def test_resume_with_other_data_is_refused(tmp_path, capsys):
    # a --data-dir whose files differ must not resume the run silently (the fingerprint is
    # of the tasks' tensors, the data the run reads)
    import gzip
    import shutil

    data = tmp_path / "data" / "mnist"
    shutil.copytree(DATA_DIR / "mnist", data)
    args = ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "3",
            "--out", str(tmp_path / "run"), "--no-plots", *TINY, "--data-dir",
            str(tmp_path / "data")]
    assert main(args) == 0
    images = next(data.glob("train-images*"))
    raw = bytearray(gzip.decompress(images.read_bytes()) if images.suffix == ".gz"
                    else images.read_bytes())
    raw[16:] = bytes(255 - b for b in raw[16:])  # every training image inverted
    images.write_bytes(gzip.compress(bytes(raw)) if images.suffix == ".gz" else bytes(raw))
    capsys.readouterr()
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "was written with other data" in err and len(err.strip().splitlines()) == 1


@needs_mnist
def test_resume_with_other_settings_is_refused(tmp_path, capsys):
    _run(tmp_path, "split-mnist", "finetune", "--tasks", "2")
    with pytest.raises(RuntimeError, match="other settings"):
        continual.run_continual("split-mnist", "finetune", [3], tmp_path, data_dir=DATA_DIR,
                                progress=False, plots=False, epochs=1, train_subset=200,
                                test_subset=100, tasks=2, num_samples=16, lr=0.01)
    # the command line says so in one line, without a traceback
    assert main(["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "3",
                 "--out", str(tmp_path), "--no-plots", *TINY, "--tasks", "2",
                 "--lr", "0.01"]) == 2
    assert "written with other settings" in capsys.readouterr().err


@needs_mnist
def test_checkpoint_older_than_penalty_outputs_resumes(tmp_path, capsys):
    first = _run(tmp_path, "split-mnist", "finetune", "--tasks", "2")
    state_path = tmp_path / "checkpoints" / "seed3" / "state.pt"
    state = torch.load(state_path, weights_only=True)
    saved = json.loads(state["hyperparameters"])
    del saved["penalty_outputs"]  # as written before the setting existed: each task's head
    state["hyperparameters"] = json.dumps(saved)
    torch.save(state, state_path)
    capsys.readouterr()
    again = _run(tmp_path, "split-mnist", "finetune", "--tasks", "2")
    assert "] task" not in capsys.readouterr().err  # resumed after its last task: no training
    assert again["accuracy_matrix"] == first["accuracy_matrix"]
    # all logits is not what an old checkpoint did: refused
    assert main(["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "3",
                 "--out", str(tmp_path), "--no-plots", *TINY, "--tasks", "2",
                 "--penalty-outputs", "all"]) == 2
    assert "written with other settings" in capsys.readouterr().err


# ----- optimizer and penalty modes ------------------------------------------------------------

def test_penalty_weights_mean_and_sum():
    assert continual.penalty_weights(4, "mean") == [0.25] * 4
    assert continual.penalty_weights(3, "sum") == [1.0] * 3
    assert continual.penalty_weights(0, "mean") == []
    with pytest.raises(ValueError, match="penalty must be one of"):
        continual.penalty_weights(2, "max")


@needs_mnist
def test_shared_and_per_task_optimizer_differ(tmp_path):
    # the shared Adam carries its moment estimates into task 2; a fresh one does not
    shared = _run(tmp_path / "a", "split-mnist", "finetune", "--tasks", "2")
    fresh = _run(tmp_path / "b", "split-mnist", "finetune", "--tasks", "2", "--optimizer",
                 "per-task")
    assert shared["accuracy_matrix"]["3"][0] == fresh["accuracy_matrix"]["3"][0]
    assert shared["accuracy_matrix"]["3"][1] != fresh["accuracy_matrix"]["3"][1]
    assert "per-task Adam" in continual.report([str(tmp_path / "b")])


@needs_mnist
def test_penalty_outputs_all_covers_the_other_heads(tmp_path):
    # the authors' BGLN-D penalizes every logit on Split MNIST; their sampled penalties the head
    assert continual.default_hyperparameters("split-mnist", "bgln-d")["penalty_outputs"] == "all"
    assert continual.default_hyperparameters("split-mnist", "bgln-s")["penalty_outputs"] == "head"
    extra = ("--tasks", "2", "--width", "32")
    _run(tmp_path / "all", "split-mnist", "bgln-d", *extra)
    _run(tmp_path / "head", "split-mnist", "bgln-d", *extra, "--penalty-outputs", "head")
    summaries = {k: fsd_load(tmp_path / k / "checkpoints" / "seed3" / "task0.fsd")
                 for k in ("all", "head")}
    # move only the output rows of task 2's head (units 2, 3) away from task 1's reference
    moved = mlp(28 * 28, 32, 2, 10)
    moved.load_state_dict(summaries["all"].reference_state_dict())
    with torch.no_grad():
        last = [m for m in moved.modules() if isinstance(m, torch.nn.Linear)][-1]
        last.weight[2:4] += 0.1
    with torch.no_grad():
        assert float(summaries["head"].distance(moved)) == pytest.approx(0.0, abs=1e-10)
        assert float(summaries["all"].distance(moved)) > 1e-4
    table = continual.report([str(tmp_path / "head")])
    changes = table.split("**not paper protocol**: ")[1].split(")")[0].split(", ")
    assert "head logits" in table and "penalty_outputs" in changes
    table = continual.report([str(tmp_path / "all")])
    assert "penalty_outputs" not in table.split("**not paper protocol**: ")[1].split(")")[0]
    with pytest.raises(ValueError, match="penalty_outputs must be one of"):
        continual.run_continual("split-mnist", "bgln-d", [0], tmp_path / "x",
                                penalty_outputs="some")


def _file_protocol(res: dict) -> str:
    # the report's protocol column for a results file's settings, read as the report reads them
    hp = continual.Hyperparameters.from_dict(
        cl_hyperparameters(res["hyperparameters"], res["benchmark"], res["method"]))
    return _protocol(hp, res["benchmark"], res["method"])


def test_results_older_than_penalty_outputs_read_as_head_only():
    res = {"benchmark": "split-mnist", "method": "bgln-d",
           "hyperparameters": continual.default_hyperparameters("split-mnist", "bgln-d")}
    del res["hyperparameters"]["penalty_outputs"]
    assert "penalty_outputs" in _file_protocol(res)
    # single head: the head is every logit, so an old Permuted MNIST run is still the protocol
    res = {"benchmark": "permuted-mnist", "method": "bgln-d",
           "hyperparameters": continual.default_hyperparameters("permuted-mnist", "bgln-d")}
    del res["hyperparameters"]["penalty_outputs"]
    assert "not paper protocol" not in _file_protocol(res)


def test_results_json_round_trip_and_version_one_files():
    hp = continual.Hyperparameters.paper("split-mnist", "bgln-d").with_overrides(tasks=2)
    done = [continual.SeedResult(7, [[99.0, 50.0], [98.0, 97.0]], 12.0, [1000])]
    results = continual.RunResults.collect("split-mnist", "bgln-d", hp, [7, 8], done)
    written = results.to_json()
    assert written["schema_version"] == CL_RESULTS_SCHEMA and written["fsd_version"]
    assert list(written["hyperparameters"]) == list(
        continual.default_hyperparameters("split-mnist", "bgln-d"))
    assert "devices" not in written and not written["complete"]
    assert continual.RunResults.from_json(json.loads(json.dumps(written))) == results
    # a file written before the schema version, complete/seeds_requested/device and the
    # optimizer, penalty and penalty_outputs settings: read as the run that wrote it was made
    old = {k: v for k, v in written.items()
           if k not in ("schema_version", "fsd_version", "complete", "seeds_requested",
                        "device", "torch_threads")}
    old["hyperparameters"] = {k: v for k, v in written["hyperparameters"].items()
                              if k not in ("optimizer", "penalty", "penalty_outputs", "rank")}
    read = continual.RunResults.from_json(old)
    assert read.schema_version == 1 and read.fsd_version is None
    assert read.complete and read.seeds_requested == [7] and read.device == "cpu"
    assert (read.hyperparameters.optimizer, read.hyperparameters.penalty,
            read.hyperparameters.penalty_outputs, read.hyperparameters.rank) == \
        ("per-task", "sum", "head", None)
    assert read.accuracy_matrix == results.accuracy_matrix


def test_bad_optimizer_mode_is_refused(tmp_path):
    with pytest.raises(ValueError, match="optimizer must be one of"):
        continual.run_continual("split-mnist", "finetune", [0], tmp_path, optimizer="sgd")


@needs_mnist
def test_rank_option_stores_low_rank_moments(tmp_path):
    full = _run(tmp_path / "full", "split-mnist", "bgln-d", "--tasks", "2", "--width", "32")
    low = _run(tmp_path / "low", "split-mnist", "bgln-d", "--tasks", "2", "--width", "32",
               "--rank", "8")
    # 784² covariance floats replaced by 784·(8+1): far fewer bytes per task
    assert low["summary_bytes_per_task"] < full["summary_bytes_per_task"] - 2_000_000
    assert "lowrank r=8" in continual.report([str(tmp_path / "low")])
    with pytest.raises(ValueError, match="rank applies to"):
        continual.run_continual("split-mnist", "bgln-d-var", [0], tmp_path / "x", rank=4)


def test_injection_rank_option_reaches_the_corrected_summaries_only(tmp_path):
    # None keeps each preset's own (8 for the cut, the whole covariance otherwise); a value
    # reaches the summary, is reported as a change, and other methods refuse it
    hp = continual.default_hyperparameters("permuted-mnist", "bgln-d-corrected")
    assert hp["injection_rank"] is None
    whole, cut = continual.METHODS["bgln-d-corrected"], continual.METHODS["bgln-d-corrected-cut"]
    assert "injection_rank" not in whole.continual_estimator(hp, 0).config
    assert cut.continual_estimator(hp, 0).config["injection_rank"] == 8
    for preset in (whole, cut):
        assert preset.continual_estimator({**hp, "injection_rank": 16}, 0).config[
            "injection_rank"] == 16
    with pytest.raises(ValueError, match="injection rank applies to"):
        continual.run_continual("permuted-mnist", "bgln-d-exact", [0], tmp_path / "x",
                                injection_rank=4)


def test_bgln_d_exact_defaults_to_the_measured_setting():
    # head-only summaries with a rank-64 covariance (99.66 on Split MNIST); the paper's
    # BGLN-D keeps the authors' all-logit penalty and full covariance
    exact = continual.default_hyperparameters("split-mnist", "bgln-d-exact")
    paper = continual.default_hyperparameters("split-mnist", "bgln-d")
    assert (exact["penalty_outputs"], exact["rank"]) == ("head", 64)
    assert (paper["penalty_outputs"], paper["rank"]) == ("all", None)
    assert exact["fsd_scale"] == paper["fsd_scale"]


def test_metric_option_reaches_monte_carlo_estimators_only(tmp_path):
    # default: softmax outputs for the Monte Carlo methods, as the authors' BGLN-S code
    hp = continual.default_hyperparameters("split-mnist", "bgln-s")
    bgln_s = continual.METHODS["bgln-s"]
    assert bgln_s.continual_estimator(hp, 0).config["metric"] == "softmax_euclidean"
    # but LAFTR (no paper row on the MNIST benchmarks) on logits there, KL on CIFAR (kl_cifar)
    for method in ("laftr", "laftr-coreset"):
        for benchmark, metric in (("split-mnist", "euclidean"), ("permuted-mnist", "euclidean"),
                                  ("split-fashion-mnist", "euclidean"), ("split-cifar100", "kl")):
            assert continual.METHODS[method].continual_estimator(
                continual.default_hyperparameters(benchmark, method), 0
            ).config["metric"] == metric
    assert bgln_s.continual_estimator({**hp, "metric": "euclidean"}, 0).config[
        "metric"] == "euclidean"
    assert continual.default_hyperparameters("split-mnist", "bgln-d")["metric"] is None
    with pytest.raises(ValueError, match="metric applies to"):
        continual.run_continual("split-mnist", "bgln-d", [0], tmp_path, metric="kl")
    with pytest.raises(ValueError, match="metric"):
        continual.run_continual("split-mnist", "bgln-s", [0], tmp_path, metric="cosine")


@needs_mnist
def test_penalty_gap_compares_each_summary_with_the_true_fsd(tmp_path, capsys):
    _run(tmp_path, "split-mnist", "laftr-coreset", "--tasks", "3", "--width", "32",
         "--metric", "euclidean")
    rows = continual.penalty_gap(tmp_path, str(DATA_DIR), examples=200)
    assert [(r["seed"], r["task"]) for r in rows] == [(3, 1), (3, 2)]
    for r in rows:
        assert r["true_fsd"] > 0 and r["estimate"] > 0
        assert r["ratio"] == pytest.approx(r["estimate"] / r["true_fsd"])
    # the true FSD by hand: ½‖Δz‖² on the task's head, averaged over its first 200 inputs
    import torch

    from fsd_experiments.models import mlp
    tasks, _ = continual.make_tasks("split-mnist", str(DATA_DIR), 3, train_subset=200,
                                    test_subset=100, num_tasks=3)
    final = mlp(784, 32, 2, 10)
    final.load_state_dict(torch.load(tmp_path / "checkpoints" / "seed3" / "state.pt",
                                     weights_only=True)["model"])
    reference = mlp(784, 32, 2, 10)
    reference.load_state_dict(fsd_load(tmp_path / "checkpoints" / "seed3" / "task1.fsd")
                              .reference_state_dict())
    with torch.no_grad():
        x, head = tasks[1].x_train[:200], tasks[1].outputs
        by_hand = 0.5 * ((final(x)[:, head] - reference(x)[:, head]) ** 2).sum(1).mean()
    assert rows[1]["true_fsd"] == pytest.approx(float(by_hand), rel=1e-5)
    assert main(["cl", "gap", str(tmp_path), "--data-dir", str(DATA_DIR), "--examples",
                 "200"]) == 0
    assert "| 3 | 2 |" in capsys.readouterr().out

    # --linearized: ½‖J(θ − θ_t)‖², J by reverse mode per input (the estimator uses forward
    # mode), in chunks smaller than the 200 inputs so the weighting of chunks is exercised
    from torch.func import functional_call, jacrev

    from fsd_experiments.continual import reporting
    theta0 = {k: v.detach() for k, v in reference.named_parameters()}
    delta = {k: v.detach() - theta0[k] for k, v in final.named_parameters()}
    jac = jacrev(lambda p: functional_call(reference, p, (x,))[:, head])(theta0)
    jdelta = sum((jac[k] * delta[k]).flatten(2).sum(2) for k in theta0)
    by_hand = 0.5 * (jdelta ** 2).sum(1).mean()
    linearized = reporting._linearized_fsd(reference, final, x, "euclidean", head, chunk=64)
    assert linearized == pytest.approx(float(by_hand), rel=1e-5)
    assert main(["cl", "gap", str(tmp_path), "--data-dir", str(DATA_DIR), "--examples",
                 "200", "--linearized"]) == 0
    out = capsys.readouterr().out
    assert "linearized / true" in out and f"{linearized:.3g}" in out
    with pytest.raises(ValueError, match=r"--by-layer splits summaries whose estimate is a "
                                         r"sum over layers \(fsd cl --method ewc or osla\)"):
        continual.penalty_gap(tmp_path, str(DATA_DIR), examples=20, by_layer=True)

    # a seed that has not finished: settings from its checkpoint, compared on the tasks
    # trained before its latest one (here the checkpoint is made to say two tasks of three)
    state_path = tmp_path / "checkpoints" / "seed3" / "state.pt"
    state = torch.load(state_path, weights_only=True)
    torch.save({**state, "matrix": state["matrix"][:2]}, state_path)
    (tmp_path / "results.json").unlink()
    (partial,) = continual.penalty_gap(tmp_path, str(DATA_DIR), examples=200)
    assert (partial["task"], partial["after_task"], partial["finished"]) == (1, 2, False)
    assert partial["true_fsd"] == rows[0]["true_fsd"] and partial["estimate"] == rows[0][
        "estimate"]
    assert main(["cl", "gap", str(tmp_path), "--data-dir", str(DATA_DIR), "--examples",
                 "200"]) == 0
    assert "seed 3 has not finished: compared at its latest checkpoint, after task 2" in \
        capsys.readouterr().out
    with pytest.raises(ValueError, match=r"neither results\.json nor a checkpoint"):
        continual.penalty_gap(tmp_path / "checkpoints", str(DATA_DIR))


@needs_mnist
def test_penalty_gap_walks_bgln_d_statistics_by_other_evaluators(tmp_path, capsys):
    _run(tmp_path, "split-mnist", "bgln-d-corrected", "--tasks", "2", "--width", "16")
    (row,) = continual.penalty_gap(tmp_path, str(DATA_DIR), examples=100,
                                   evaluators=["corrected", "exact", "algorithm2"])
    walked = row["evaluators"]
    # the recorded walk is the summary's own estimate; the others read the same statistics
    assert walked["corrected"] == pytest.approx(row["estimate"], rel=1e-12)
    summary = fsd_load(tmp_path / "checkpoints" / "seed3" / "task0.fsd")
    from fsd_experiments.models import mlp
    final = mlp(784, 16, 2, 10)
    final.load_state_dict(torch.load(tmp_path / "checkpoints" / "seed3" / "state.pt",
                                     weights_only=True)["model"])
    with torch.no_grad():
        for name in ("exact", "algorithm2"):
            assert walked[name] == pytest.approx(float(summary.distance_by(final, name)),
                                                 rel=1e-12)
    assert walked["algorithm2"] != pytest.approx(walked["exact"], rel=1e-3)
    assert main(["cl", "gap", str(tmp_path), "--data-dir", str(DATA_DIR), "--examples", "100",
                 "--evaluators", "exact", "algorithm2"]) == 0
    out = capsys.readouterr().out
    assert "| by exact | exact / estimate | by algorithm2 | algorithm2 / estimate |" in out
    # the second table does not disturb reading the first back (committed gap.md files)
    from fsd_experiments.continual.reporting import read_gap_markdown
    (read,) = read_gap_markdown(out)
    assert (read["seed"], read["task"]) == (3, 1)
    with pytest.raises(ValueError, match=r"unknown evaluators \['nope'\]"):
        continual.penalty_gap(tmp_path, str(DATA_DIR), evaluators=["nope"])
    # a CNN run is refused the MLP walks before any data loads (its results.json says cnn)
    cnn_run = tmp_path / "cnn"
    cnn_run.mkdir()
    raw = json.loads((tmp_path / "results.json").read_text())
    raw["hyperparameters"]["model"] = "cnn"
    (cnn_run / "results.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=r"evaluators \['exact'\] walk MLP chains; .* cnn "
                                         r"\(its walks: algorithm2-conv"):
        continual.penalty_gap(cnn_run, str(DATA_DIR), evaluators=["exact", "algorithm2-conv"])
    other = tmp_path / "laftr"
    _run(other, "split-mnist", "laftr-coreset", "--tasks", "2", "--width", "16")
    with pytest.raises(ValueError, match=r"walks BGLN-D summaries' moments; .* laftr-coreset"):
        continual.penalty_gap(other, str(DATA_DIR), evaluators=["exact"])


@needs_mnist
@pytest.mark.parametrize("method", ["osla", "ewc"])
def test_penalty_gap_by_layer_splits_a_run_by_layer(tmp_path, capsys, method):
    from torch.func import functional_call, jacrev

    from fsd_experiments.models import mlp
    _run(tmp_path, "split-mnist", method, "--tasks", "2", "--width", "16")
    rows = continual.penalty_gap(tmp_path, str(DATA_DIR), examples=100, by_layer=True)
    (row,) = rows
    layers = {part["layer"]: part for part in row["layers"]}
    assert list(layers) == ["1", "3", "5"]  # the MLP's three Linear layers (0 flattens)
    # the summary's terms add up to its estimate
    assert sum(p["estimate"] for p in layers.values()) == pytest.approx(row["estimate"],
                                                                        rel=1e-5)
    # each layer's linearized FSD by hand: ½‖J_l(θ_l − θ_l,0)‖², J_l by reverse mode
    tasks, _ = continual.make_tasks("split-mnist", str(DATA_DIR), 3, train_subset=200,
                                    test_subset=100, num_tasks=2)
    final, reference = mlp(784, 16, 2, 10), mlp(784, 16, 2, 10)
    final.load_state_dict(torch.load(tmp_path / "checkpoints" / "seed3" / "state.pt",
                                     weights_only=True)["model"])
    reference.load_state_dict(fsd_load(tmp_path / "checkpoints" / "seed3" / "task0.fsd")
                              .reference_state_dict())
    x, head = tasks[0].x_train[:100], tasks[0].outputs
    theta0 = {k: v.detach() for k, v in reference.named_parameters()}
    jac = jacrev(lambda p: functional_call(reference, p, (x,))[:, head])(theta0)
    for layer, part in layers.items():
        names = [k for k in theta0 if k.startswith(f"{layer}.")]
        jdelta = sum((jac[k] * (dict(final.named_parameters())[k].detach() - theta0[k]))
                     .flatten(2).sum(2) for k in names)
        by_hand = 0.5 * (jdelta ** 2).sum(1).mean()
        assert part["linearized"] == pytest.approx(float(by_hand), rel=1e-5)
    assert main(["cl", "gap", str(tmp_path), "--data-dir", str(DATA_DIR), "--examples", "100",
                 "--by-layer"]) == 0
    assert "| 3 | 1 | 3 |" in capsys.readouterr().out


@needs_mnist
def test_merge_combines_seeds_run_separately(tmp_path, capsys):
    for seed in ("1", "2"):
        assert main(["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", seed,
                     "--out", str(tmp_path / seed), "--no-plots", *TINY]) == 0
    assert main(["cl", "merge", str(tmp_path / "1"), str(tmp_path / "2"),
                 "--out", str(tmp_path / "both"), "--no-plots"]) == 0
    merged = json.loads((tmp_path / "both" / "results.json").read_text())
    one, two = (json.loads((tmp_path / s / "results.json").read_text()) for s in ("1", "2"))
    assert merged["seeds"] == [1, 2] and merged["complete"]
    assert merged["accuracy_matrix"] == {**one["accuracy_matrix"], **two["accuracy_matrix"]}
    per_seed = [one["avg_accuracy"]["mean"], two["avg_accuracy"]["mean"]]
    assert merged["avg_accuracy"] == continual.accuracy_summary(per_seed)
    assert merged["devices"] == {"1": "cpu", "2": "cpu"}
    # the runs' thread count is kept, not the merging process's
    assert merged["torch_threads"] == one["torch_threads"] == two["torch_threads"]
    three = {**two, "torch_threads": one["torch_threads"] + 3}
    (tmp_path / "2" / "results.json").write_text(json.dumps(three))
    mixed = continual.merge_runs([tmp_path / "1", tmp_path / "2"], tmp_path / "mixed",
                                 plots=False)
    assert mixed.torch_threads is None  # the runs differ: no single count to report
    # the versions that ran the seeds are kept too (a GPU machine's torch is not this one's)
    other = {**two, "torch_version": "0.0.1+other", "fsd_version": None}
    (tmp_path / "2" / "results.json").write_text(json.dumps(other))
    versions = continual.merge_runs([tmp_path / "1", tmp_path / "2"], tmp_path / "versions",
                                    plots=False)
    assert versions.torch_version == " + ".join(sorted([one["torch_version"], "0.0.1+other"]))
    assert versions.fsd_version == " + ".join(sorted([one["fsd_version"], "unrecorded"]))
    assert merged["torch_version"] == one["torch_version"]
    # the CPU (model and torch's vector instructions): runs repeat only on the same one
    assert one["cpu"] == two["cpu"] == merged["cpu"] == cpu_name()
    other_cpu = {**two, "cpu": "Some CPU, AVX2"}
    (tmp_path / "2" / "results.json").write_text(json.dumps(other_cpu))
    cpus = continual.merge_runs([tmp_path / "1", tmp_path / "2"], tmp_path / "cpus",
                                plots=False)
    assert cpus.cpu == " + ".join(sorted([one["cpu"], "Some CPU, AVX2"]))
    capability = one["cpu"].rsplit(", ", 1)[1]
    assert reporting._machine(cpus) == \
        f"cpu ({' + '.join(sorted({capability, 'AVX2'}))}), {one['torch_threads']} thread" \
        + ("s" if one["torch_threads"] != 1 else "")
    unrecorded = {k: v for k, v in two.items() if k != "cpu"}  # older files lack it
    (tmp_path / "2" / "results.json").write_text(json.dumps(unrecorded))
    assert continual.RunResults.read(tmp_path / "2" / "results.json").cpu is None
    with pytest.raises(ValueError, match="cpu must be a non-empty string"):
        continual.RunResults.from_json({**two, "cpu": 3})
    (tmp_path / "2" / "results.json").write_text(json.dumps(two))
    # a seed twice, or other settings, are refused
    with pytest.raises(ValueError, match="seed 1 appears twice"):
        continual.merge_runs([tmp_path / "1", tmp_path / "both"], tmp_path / "x")
    assert main(["cl", "--benchmark", "split-mnist", "--method", "finetune", "--seeds", "3",
                 "--out", str(tmp_path / "other"), "--no-plots", *TINY, "--lr", "0.01"]) == 0
    with pytest.raises(ValueError, match=r"differs .* in hyperparameters"):
        continual.merge_runs([tmp_path / "1", tmp_path / "other"], tmp_path / "y")
    assert main(["cl", "merge", str(tmp_path / "missing"), "--out", str(tmp_path / "z")]) == 2
    assert "results.json not found" in capsys.readouterr().err
    # a run written before a setting existed lacks its key: it merges if the setting is None
    older = json.loads((tmp_path / "2" / "results.json").read_text())
    absent = [k for k, v in older["hyperparameters"].items() if v is None]
    assert absent
    for key in absent:
        del older["hyperparameters"][key]
    (tmp_path / "2" / "results.json").write_text(json.dumps(older))
    merged = continual.merge_runs([tmp_path / "1", tmp_path / "2"], tmp_path / "w", plots=False)
    assert merged.seeds == [1, 2]
    # a run stopped before all its seeds: refused, unless its finished seeds are asked for
    stopped = json.loads((tmp_path / "1" / "results.json").read_text())
    stopped["complete"], stopped["seeds_requested"] = False, [1, 5]
    (tmp_path / "1" / "results.json").write_text(json.dumps(stopped))
    with pytest.raises(ValueError, match="unfinished"):
        continual.merge_runs([tmp_path / "1", tmp_path / "2"], tmp_path / "v")
    assert main(["cl", "merge", str(tmp_path / "1"), str(tmp_path / "2"), "--partial",
                 "--out", str(tmp_path / "v"), "--no-plots"]) == 0
    merged = json.loads((tmp_path / "v" / "results.json").read_text())
    assert merged["seeds"] == [1, 2] and merged["complete"]


@needs_mnist
def test_grid_edge_names_a_choice_at_either_end_only():
    assert "smallest value, so the best may lie below" in grid_edge([1, 0.01, 0.1], 0.01)
    assert "largest value, so the best may lie above" in grid_edge([0.1, 10, 1], 10)
    assert grid_edge([0.01, 0.1, 10, 0.001], 0.01) is None
    assert grid_edge([5.0], 5.0) is None


def test_tune_runs_the_papers_protocol_and_resumes(tmp_path, capsys):
    args = ["cl", "tune", "--benchmark", "split-mnist", "--method", "ewc", "--grid", "0", "30",
            "--tuning-seed", "7", "--seeds", "3", "4", "--out", str(tmp_path / "tune"),
            "--no-plots", "--no-progress", *TINY]
    assert main(args) == 0
    tuned = json.loads((tmp_path / "tune" / "tune.json").read_text())
    assert tuned["torch_version"] == torch.__version__ and tuned["device"] == "cpu"
    # the grid ran on the tuning seed, one ordinary run per λ
    grid = {row["fsd_scale"]: row for row in tuned["grid"]}
    assert set(grid) == {0.0, 30.0}
    for scale, row in grid.items():
        run = json.loads((tmp_path / "tune" / "grid" / f"lambda-{scale:g}" /
                          "results.json").read_text())
        assert run["seeds"] == [7] and run["hyperparameters"]["fsd_scale"] == scale
        assert row["avg_accuracy"] == run["avg_accuracy"]["mean"]
    # the chosen λ is the grid's best, and the reported seeds ran with it
    assert tuned["chosen"] == max(grid.values(), key=lambda r: r["avg_accuracy"])["fsd_scale"]
    final = json.loads((tmp_path / "tune" / "final" / "results.json").read_text())
    assert final["seeds"] == [3, 4] and final["hyperparameters"]["fsd_scale"] == tuned["chosen"]
    assert "**(chosen)**" in (tmp_path / "tune" / "tune.md").read_text()
    # a two-point grid's choice is one of its edges: said on stderr and in tune.md
    side = "smallest" if tuned["chosen"] == 0 else "largest"
    assert f"the grid's {side} value" in capsys.readouterr().err
    assert f"the grid's {side} value" in (tmp_path / "tune" / "tune.md").read_text()
    # started again, it trains nothing and writes the same choice
    assert main(args) == 0
    assert "] task" not in capsys.readouterr().err
    assert json.loads((tmp_path / "tune" / "tune.json").read_text()) == tuned
    # nor without the checkpoints (a grid kept as result files, or run on another machine)
    for folder in sorted((tmp_path / "tune").rglob("checkpoints")):
        shutil.rmtree(folder)
    assert main(args) == 0
    assert "] task" not in capsys.readouterr().err
    assert json.loads((tmp_path / "tune" / "tune.json").read_text()) == tuned
    # a grid that now chooses another λ keeps the earlier final run beside the new one
    other = "30" if tuned["chosen"] == 0 else "0"
    capsys.readouterr()
    assert args[6:9] == ["--grid", "0", "30"]
    assert main([*args[:7], other, *args[9:]]) == 0
    assert f"kept in {tmp_path / 'tune' / 'final-lambda-'}" in capsys.readouterr().err
    kept = json.loads((tmp_path / "tune" / f"final-lambda-{tuned['chosen']:g}" /
                       "results.json").read_text())
    assert kept["hyperparameters"]["fsd_scale"] == tuned["chosen"]
    final = json.loads((tmp_path / "tune" / "final" / "results.json").read_text())
    assert final["hyperparameters"]["fsd_scale"] == float(other)
    with pytest.raises(SystemExit):  # a repeated λ is refused while parsing
        main(["cl", "tune", "--benchmark", "split-mnist", "--method", "ewc", "--grid", "1",
              "1", "--out", str(tmp_path / "again")])


@needs_mnist
def test_merge_carries_checkpoints_so_gap_and_tune_use_runs_made_apart(tmp_path, capsys):
    # the grid points and the final seeds run as separate processes (in parallel, or on
    # other machines), then gathered: fsd cl tune must find every run finished
    base = ["--benchmark", "split-mnist", "--method", "ewc", "--no-plots", *TINY]
    root = tmp_path / "tune"
    accuracy = {}
    for scale in ("0", "30"):
        out = root / "grid" / f"lambda-{scale}"
        assert main(["cl", *base, "--validation", "0.1", "--seeds", "7", "--fsd-scale", scale,
                     "--out", str(out)]) == 0
        accuracy[scale] = json.loads((out / "results.json").read_text())["avg_accuracy"]["mean"]
    chosen = max(accuracy, key=lambda s: accuracy[s])  # the first of equal ones, as tune
    for seed in ("3", "4"):
        assert main(["cl", *base, "--seeds", seed, "--fsd-scale", chosen,
                     "--out", str(tmp_path / f"s{seed}")]) == 0
    capsys.readouterr()
    assert main(["cl", "merge", str(tmp_path / "s3"), str(tmp_path / "s4"),
                 "--out", str(root / "final"), "--no-plots"]) == 0
    assert "checkpoints of seeds [3, 4]" in capsys.readouterr().out
    for seed in ("3", "4"):
        source = tmp_path / f"s{seed}" / "checkpoints" / f"seed{seed}"
        carried = root / "final" / "checkpoints" / f"seed{seed}"
        assert sorted(p.name for p in carried.iterdir()) == \
            sorted(p.name for p in source.iterdir())
        for file in source.iterdir():
            assert (carried / file.name).read_bytes() == file.read_bytes()
    # the gathered tuning trains nothing and reports what the separate runs measured
    assert main(["cl", "tune", *base, "--grid", "0", "30", "--tuning-seed", "7",
                 "--seeds", "3", "4", "--out", str(root)]) == 0
    assert "] task" not in capsys.readouterr().err
    tuned = json.loads((root / "tune.json").read_text())
    assert tuned["chosen"] == float(chosen) and tuned["final_seeds"] == [3, 4]
    assert [row["avg_accuracy"] for row in tuned["grid"]] == [accuracy["0"], accuracy["30"]]
    # fsd cl gap reads the merged seeds' checkpoints: the same rows as each run's own
    gap_args = ["--data-dir", str(DATA_DIR), "--examples", "100"]
    rows = set()
    for seed in ("3", "4"):
        assert main(["cl", "gap", str(tmp_path / f"s{seed}"), *gap_args]) == 0
        rows |= {line for line in capsys.readouterr().out.splitlines()
                 if line.startswith(f"| {seed} |")}
    assert main(["cl", "gap", str(root / "final"), *gap_args]) == 0
    merged_rows = {line for line in capsys.readouterr().out.splitlines()
                   if line.startswith(("| 3 |", "| 4 |"))}
    assert rows and merged_rows == rows
    # without them, the merged seeds are results only
    assert main(["cl", "merge", str(tmp_path / "s3"), str(tmp_path / "s4"),
                 "--out", str(tmp_path / "bare"), "--no-plots", "--no-checkpoints"]) == 0
    assert not (tmp_path / "bare" / "checkpoints").exists()
    assert "checkpoints of seeds none" in capsys.readouterr().out
    assert main(["cl", "gap", str(tmp_path / "bare"), *gap_args]) == 2
    assert "checkpoint" in capsys.readouterr().err


@needs_mnist
def test_tune_with_jobs_equals_one_process_and_resumes(tmp_path, capfd, monkeypatch):
    args = ["cl", "tune", "--benchmark", "split-mnist", "--method", "ewc", "--grid", "0", "30",
            "--tuning-seed", "7", "--seeds", "3", "4", "--no-plots", "--threads", "1", *TINY]
    assert main([*args, "--out", str(tmp_path / "one")]) == 0
    capfd.readouterr()
    assert main([*args, "--out", str(tmp_path / "two"), "--jobs", "2"]) == 0
    err = capfd.readouterr().err  # the workers write to the inherited stderr
    assert "grid/lambda-30: [ewc seed 7] task 1/3" in err
    assert "final-seeds/seed4: [ewc seed 4] task 3/3" in err
    one, two = (json.loads((tmp_path / d / "tune.json").read_text()) for d in ("one", "two"))
    assert two == one
    finals = [json.loads((tmp_path / d / "final" / "results.json").read_text())
              for d in ("one", "two")]
    assert finals[1]["accuracy_matrix"] == finals[0]["accuracy_matrix"]
    assert finals[1]["seeds"] == [3, 4] and finals[1]["torch_threads"] == 1
    # the seeds run apart were merged into final, their checkpoints with them
    assert not (tmp_path / "two" / "final-seeds").exists()
    for seed in (3, 4):
        assert (tmp_path / "two" / "final" / "checkpoints" / f"seed{seed}" / "state.pt").is_file()
    # started again, it trains nothing
    assert main([*args, "--out", str(tmp_path / "two"), "--jobs", "2"]) == 0
    assert "] task" not in capfd.readouterr().err
    assert json.loads((tmp_path / "two" / "tune.json").read_text()) == two
    # stopped after the final seeds ran apart, before their merge: one job resumes them
    # apart (they are complete, so it trains nothing) and merges them
    def stop(*_args, **_kwargs):
        raise KeyboardInterrupt

    # the package re-exports the function tune, which hides the module of that name
    monkeypatch.setattr(sys.modules["fsd_experiments.continual.tune"], "merge_runs", stop)
    with pytest.raises(KeyboardInterrupt):
        main([*args, "--out", str(tmp_path / "three"), "--jobs", "2"])
    monkeypatch.undo()
    assert (tmp_path / "three" / "final-seeds" / "seed4" / "results.json").is_file()
    assert not (tmp_path / "three" / "final").exists()
    capfd.readouterr()
    assert main([*args, "--out", str(tmp_path / "three")]) == 0
    assert "] task" not in capfd.readouterr().err
    assert json.loads((tmp_path / "three" / "tune.json").read_text()) == one
    assert not (tmp_path / "three" / "final-seeds").exists()
    three = json.loads((tmp_path / "three" / "final" / "results.json").read_text())
    assert three["accuracy_matrix"] == finals[0]["accuracy_matrix"]
    # a worker's error is the command's one-line error, after the other runs finish
    bad = tmp_path / "bad"
    assert main(["cl", "--benchmark", "split-mnist", "--method", "ewc", "--seeds", "7",
                 "--fsd-scale", "30", "--validation", "0.1", "--lr", "0.01", "--no-plots",
                 *TINY, "--out", str(bad / "grid" / "lambda-30")]) == 0
    capfd.readouterr()
    assert main([*args, "--out", str(bad), "--jobs", "2"]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("error: ") and "lambda-30" in lines[-1]
    assert (bad / "grid" / "lambda-0" / "results.json").is_file()
    assert not (bad / "tune.json").exists()


def test_statistics_after_records_the_final_network_in_evaluation_mode():
    # ground truth: the library's own fit from the data (a traced pass, not the collector's
    # hooks) at the same parameters, which reads the network in evaluation mode
    from fsd import StatisticsCollector
    from fsd_experiments.ablations import BGLNVariant
    from fsd_experiments.benchmarks import Task
    from fsd_experiments.continual.runner import _record_after
    from fsd_experiments.data import TensorBatches

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Dropout(0.5),
        torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    x, y = torch.randn(2500, 12), torch.randint(0, 4, (2500,))  # three passes of 1024
    task = Task(x, y, x[:10], y[:10])
    moved = copy.deepcopy(model)
    with torch.no_grad():  # another network near the reference
        for p in moved.parameters():
            p.add_(0.05 * torch.randn_like(p))
    options = {"moments": "corrected", "covariance": "lowrank", "rank": 6, "classwise": True}

    def fitted(record) -> float:
        collector = StatisticsCollector(model)
        record(collector)
        collector.remove()
        estimate = BGLNVariant(**options).fit(model, statistics=collector)
        return float(estimate.distance(moved).detach())

    fitted_on_data = BGLNVariant(**options).fit(model, TensorBatches(x, y, 500))
    truth = float(fitted_on_data.distance(moved).detach())
    model.train()
    after = fitted(lambda c: _record_after(model, c, task, True, torch.device("cpu")))
    assert model.training  # left as training found it
    assert after == pytest.approx(truth, rel=1e-5)

    def in_training(collector):  # what the last epoch records: dropout masks on
        for i in range(0, 2500, 500):
            with collector.record(labels=y[i:i + 500]):
                model(x[i:i + 500])

    assert abs(fitted(in_training) / truth - 1) > 0.01


@needs_mnist
def test_statistics_option_reaches_the_run_and_its_report(tmp_path):
    hp = continual.default_hyperparameters("split-mnist", "bgln-d-corrected")
    assert hp["statistics"] == "last-epoch"
    results = _run(tmp_path / "after", "split-mnist", "bgln-d-corrected", "--statistics", "after")
    assert results["hyperparameters"]["statistics"] == "after"
    assert "statistics after" in continual.report([str(tmp_path / "after")])
    for method, options, message in (
            ("ntk", {"statistics": "after"}, "statistics applies to"),
            ("bgln-s", {"statistics": "after", "momentum": 0.9}, "leave momentum"),
            ("bgln-s", {"statistics": "later"}, "statistics must be one of")):
        with pytest.raises(ValueError, match=message):
            continual.run_continual("split-mnist", method, [0], tmp_path / "x", **options)


def test_keep_freed_memory_applies_under_glibc():
    import platform

    from fsd_experiments.training import keep_freed_memory
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc's mallopt only")
    assert keep_freed_memory() is True
    assert keep_freed_memory() is True  # again: the same settings, no error


@needs_mnist
def test_a_run_keeps_freed_memory_mapped(tmp_path, monkeypatch):
    from fsd_experiments.continual import runner
    calls = []
    monkeypatch.setattr(runner, "keep_freed_memory", lambda: calls.append(1) or True)
    _run(tmp_path, "split-mnist", "finetune", "--tasks", "2", "--width", "32")
    assert calls == [1]
