"""``fsd cl --validation`` and ``fsd cl tune``'s grid on a validation split.

The split against index bookkeeping on every benchmark (disjoint, covering, reproducible,
seeded, independent of the other draws), the streams without it against a reconstruction
of today's draws, a tiny run's accuracies against a brute-force count on the held-out
examples, tune's grid and final runs, bad values, and files written before the setting.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from datafiles import REAL_DATA_DIR, write_cifar, write_mnist_like
from fsd_experiments import continual
from fsd_experiments.benchmarks import (
    CL_BENCHMARKS,
    SPLIT_PAIRS,
    Task,
    make_tasks,
    split_validation,
    subset,
)
from fsd_experiments.cli import main
from fsd_experiments.compat import cl_checkpoint_settings, cl_hyperparameters
from fsd_experiments.continual.reporting import _protocol, _row_changes
from fsd_experiments.continual.results import ResultsFormatError
from fsd_experiments.continual.runner import build_model
from fsd_experiments.data import load_mnist, split_by_classes

needs_mnist = pytest.mark.usefixtures("real_data")
TINY = ["--epochs", "1", "--train-subset", "200", "--test-subset", "100", "--tasks", "2",
        "--no-progress", "--no-plots", "--data-dir", str(REAL_DATA_DIR)]


@pytest.fixture(scope="module")
def fake_dir(tmp_path_factory) -> Path:
    """MNIST and Fashion-MNIST (6 random images per class and split) and CIFAR folders."""
    root = tmp_path_factory.mktemp("data")
    write_mnist_like(root / "mnist", per_class=6, seed=1)
    write_mnist_like(root / "fashion-mnist", per_class=6, seed=2)
    write_cifar(root, per_class=2)
    return root


def _rows(x: torch.Tensor) -> list[bytes]:
    return [row.numpy().tobytes() for row in x.reshape(x.shape[0], -1)]


def _indices(part: torch.Tensor, full: torch.Tensor) -> list[int]:
    """Where each row of ``part`` is in ``full`` (whose rows are all different)."""
    where = {row: i for i, row in enumerate(_rows(full))}
    return [where[row] for row in _rows(part)]


def _held_indices(benchmark: str, root: Path, seed: int, fraction: float, **kw) -> list[list]:
    full, _ = make_tasks(benchmark, str(root), seed, **kw)
    held, _ = make_tasks(benchmark, str(root), seed, validation=fraction, **kw)
    return [_indices(h.x_test, f.x_train) for h, f in zip(held, full, strict=True)]


# ----- the split ----------------------------------------------------------------------------

@pytest.mark.parametrize("benchmark", CL_BENCHMARKS)
@pytest.mark.parametrize("kw", [{}, {"train_subset": 9, "test_subset": 5, "num_tasks": 3}],
                         ids=["full", "subsets"])
def test_split_is_disjoint_covers_the_training_set_and_is_seeded(fake_dir, benchmark, kw):
    fraction = 0.25
    full, outputs = make_tasks(benchmark, str(fake_dir), 3, **kw)
    split, split_outputs = make_tasks(benchmark, str(fake_dir), 3, validation=fraction, **kw)
    assert split_outputs == outputs and len(split) == len(full)
    for f, s in zip(full, split, strict=True):
        n = f.x_train.shape[0]
        assert len(set(_rows(f.x_train))) == n  # random images: a row names its example
        kept, held = _indices(s.x_train, f.x_train), _indices(s.x_test, f.x_train)
        # disjoint, together every training example once, each part in the original order
        assert not set(kept) & set(held) and sorted(kept + held) == list(range(n))
        assert kept == sorted(kept) and held == sorted(held)
        assert len(held) == min(n - 1, max(1, round(fraction * n)))
        # the labels travel with their images; nothing of the test set is scored
        assert torch.equal(s.y_train, f.y_train[kept]) and torch.equal(s.y_test, f.y_train[held])
        assert not set(_rows(s.x_test)) & set(_rows(f.x_test))
        assert (s.name, s.outputs) == (f.name, f.outputs)
    # the same seed draws the same split; another seed another one
    assert _held_indices(benchmark, fake_dir, 3, fraction, **kw) == \
        [_indices(s.x_test, f.x_train) for f, s in zip(full, split, strict=True)]
    assert _held_indices(benchmark, fake_dir, 4, fraction, **kw) != \
        _held_indices(benchmark, fake_dir, 3, fraction, **kw)


def test_permuted_mnist_holds_out_the_same_images_in_every_task(fake_dir):
    full, _ = make_tasks("permuted-mnist", str(fake_dir), 5, num_tasks=4)
    split, _ = make_tasks("permuted-mnist", str(fake_dir), 5, num_tasks=4, validation=0.2)
    held = [_indices(s.x_test, f.x_train) for f, s in zip(full, split, strict=True)]
    assert all(h == held[0] for h in held) and len(held[0]) == 12  # 0.2 of 60
    # each task's permutation is the one drawn without the split
    for f, s in zip(full, split, strict=True):
        assert torch.equal(s.x_test, f.x_train[held[0]])


def test_split_validation_by_hand():
    x, y = torch.arange(20.0).reshape(10, 2), torch.arange(10)
    xa, ya, xb, yb = split_validation(x, y, 0.3, torch.Generator().manual_seed(0))
    assert len(yb) == 3 and len(ya) == 7
    assert sorted(ya.tolist() + yb.tolist()) == list(range(10))
    assert torch.equal(xa[:, 0], 2.0 * ya) and torch.equal(xb[:, 0], 2.0 * yb)
    again = split_validation(x, y, 0.3, torch.Generator().manual_seed(0))
    assert torch.equal(again[3], yb)
    # at least one example held out and one kept
    assert len(split_validation(x, y, 0.01, torch.Generator())[3]) == 1
    assert len(split_validation(x, y, 0.99, torch.Generator())[1]) == 1
    with pytest.raises(ValueError, match="at least 2 training examples"):
        split_validation(x[:1], y[:1], 0.5, torch.Generator())
    for bad in (0, 1, -0.1, math.nan, 1.5, True):
        with pytest.raises(ValueError, match="strictly between 0 and 1"):
            split_validation(x, y, bad, torch.Generator())


@pytest.mark.parametrize("seed", [0, 7])
def test_without_validation_the_streams_are_todays_draws(fake_dir, seed):
    # today's streams, drawn by hand: subsets from Generator(10000 + seed) in task order,
    # permutations from Generator(seed); the split must take nothing from either
    x_tr, y_tr = load_mnist(str(fake_dir), "train")
    x_te, y_te = load_mnist(str(fake_dir), "test")
    gen = torch.Generator().manual_seed(10_000 + seed)
    expected = []
    for i, pair in enumerate(SPLIT_PAIRS[:3]):
        xa, ya = subset(*split_by_classes(x_tr, y_tr, pair), 9, gen)
        xb, yb = subset(*split_by_classes(x_te, y_te, pair), 5, gen)
        expected.append(Task(xa, ya, xb, yb, f"{pair[0]}/{pair[1]}", [2 * i, 2 * i + 1]))
    gen, perm_gen = torch.Generator().manual_seed(10_000 + seed), \
        torch.Generator().manual_seed(seed)
    xa, ya = subset(x_tr, y_tr, 40, gen)
    xb, yb = subset(x_te, y_te, 20, gen)
    permuted = []
    for i in range(3):
        perm = torch.arange(784) if i == 0 else torch.randperm(784, generator=perm_gen)
        permuted.append(Task(xa.reshape(-1, 784)[:, perm].reshape(-1, 1, 28, 28), ya,
                             xb.reshape(-1, 784)[:, perm].reshape(-1, 1, 28, 28), yb,
                             f"perm {i + 1}"))
    for benchmark, want, kw in [
            ("split-mnist", expected, {"train_subset": 9, "test_subset": 5}),
            ("permuted-mnist", permuted, {"train_subset": 40, "test_subset": 20})]:
        for got in (make_tasks(benchmark, str(fake_dir), seed, num_tasks=3, **kw)[0],
                    make_tasks(benchmark, str(fake_dir), seed, num_tasks=3, validation=None,
                               **kw)[0]):
            for g, w in zip(got, want, strict=True):
                for name in ("x_train", "y_train", "x_test", "y_test"):
                    assert torch.equal(getattr(g, name), getattr(w, name)), (benchmark, name)
                assert (g.name, g.outputs) == (w.name, w.outputs)


# ----- a run on the held-out examples ---------------------------------------------------------

def _cl(out: Path, *extra: str, method: str = "finetune") -> int:
    return main(["cl", "--benchmark", "split-mnist", "--method", method, "--seeds", "3",
                 "--out", str(out), *TINY, *extra])


@needs_mnist
def test_a_run_scores_the_held_out_training_examples(tmp_path, capsys):
    out = tmp_path / "val"
    assert _cl(out, "--validation", "0.07") == 0
    res = json.loads((out / "results.json").read_text())
    assert res["hyperparameters"]["validation"] == 0.07
    state = torch.load(out / "checkpoints" / "seed3" / "state.pt", weights_only=True)
    assert json.loads(state["hyperparameters"])["validation"] == 0.07
    # brute force: the final model's correct answers counted on the held-out examples
    hp = continual.Hyperparameters.from_dict(res["hyperparameters"])
    tasks, outputs = make_tasks("split-mnist", str(REAL_DATA_DIR), 3, train_subset=200,
                                test_subset=100, num_tasks=2, validation=0.07)
    assert [len(t.y_test) for t in tasks] == [14, 14] and [len(t.y_train) for t in tasks] == \
        [186, 186]
    model = build_model(hp, tasks[0].x_train.shape[1:], outputs)
    model.load_state_dict(state["model"])
    model.eval()
    matrix = res["accuracy_matrix"]["3"]
    with torch.no_grad():
        for j, task in enumerate(tasks):
            correct = int((model(task.x_test)[:, task.outputs].argmax(-1) == task.y_test).sum())
            assert matrix[-1][j] == pytest.approx(100.0 * correct / 14, abs=1e-12)
    # every accuracy is a count out of the 14 held-out examples, not of the 100 test ones
    assert all(abs(a * 14 / 100 - round(a * 14 / 100)) < 1e-9 for row in matrix for a in row)
    # the report names it as not the paper's protocol
    assert main(["cl", "report", str(out)]) == 0
    assert "validation) |" in capsys.readouterr().out
    # the same command resumes (trains nothing); without --validation the directory is refused
    capsys.readouterr()
    assert _cl(out, "--validation", "0.07") == 0
    assert "] task" not in capsys.readouterr().err
    assert _cl(out) == 2 and "written with other settings" in capsys.readouterr().err


@needs_mnist
def test_gap_of_a_validation_run_compares_on_the_inputs_it_trained_on(tmp_path):
    out = tmp_path / "val"
    assert _cl(out, "--validation", "0.5", "--width", "16", "--metric", "euclidean",
               method="laftr-coreset") == 0
    rows = continual.penalty_gap(out, str(REAL_DATA_DIR), examples=1000)
    tasks, _ = make_tasks("split-mnist", str(REAL_DATA_DIR), 3, train_subset=200,
                          test_subset=100, num_tasks=2, validation=0.5)
    res = json.loads((out / "results.json").read_text())
    hp = continual.Hyperparameters.from_dict(res["hyperparameters"])
    final = build_model(hp, tasks[0].x_train.shape[1:], 10)
    final.load_state_dict(torch.load(out / "checkpoints" / "seed3" / "state.pt",
                                     weights_only=True)["model"])
    from fsd.estimators.base import load as fsd_load
    reference = build_model(hp, tasks[0].x_train.shape[1:], 10)
    reference.load_state_dict(fsd_load(out / "checkpoints" / "seed3" / "task0.fsd")
                              .reference_state_dict())
    with torch.no_grad():  # the true FSD over task 1's 100 training inputs, not all 200
        x, head = tasks[0].x_train, tasks[0].outputs
        by_hand = 0.5 * ((final(x)[:, head] - reference(x)[:, head]) ** 2).sum(1).mean()
    assert len(x) == 100
    assert rows[0]["true_fsd"] == pytest.approx(float(by_hand), rel=1e-5)


@needs_mnist
def test_runs_without_validation_record_none_and_old_files_read_as_none(tmp_path, capsys):
    out = tmp_path / "plain"
    assert _cl(out) == 0
    first = json.loads((out / "results.json").read_text())
    assert first["hyperparameters"]["validation"] is None
    # a checkpoint written before the setting: resumes as a run on the test sets
    state_path = out / "checkpoints" / "seed3" / "state.pt"
    state = torch.load(state_path, weights_only=True)
    saved = json.loads(state["hyperparameters"])
    del saved["validation"]
    state["hyperparameters"] = json.dumps(saved)
    torch.save(state, state_path)
    # and a results.json written before it
    older = dict(first, hyperparameters={k: v for k, v in first["hyperparameters"].items()
                                         if k != "validation"})
    (out / "results.json").write_text(json.dumps(older))
    read = continual.RunResults.read(out / "results.json")
    assert read.hyperparameters.validation is None
    capsys.readouterr()
    assert _cl(out) == 0
    assert "] task" not in capsys.readouterr().err  # resumed after its last task
    assert json.loads((out / "results.json").read_text())["accuracy_matrix"] == \
        first["accuracy_matrix"]


def test_compat_and_reporting_of_the_setting():
    paper = continual.default_hyperparameters("split-mnist", "bgln-d")
    # settings added later come last, and files from before them read as what those runs did
    assert list(paper)[-3:] == ["validation", "injection_rank", "statistics"]
    legacy = {"validation": None, "injection_rank": None, "statistics": "last-epoch"}
    assert {k: paper[k] for k in legacy} == legacy
    for added, before in legacy.items():
        old = {k: v for k, v in paper.items() if k != added}
        assert cl_hyperparameters(old, "split-mnist", "bgln-d")[added] == before
        saved = json.dumps({"benchmark": "split-mnist", "method": "bgln-d", **old})
        assert cl_checkpoint_settings(saved, "split-mnist", "bgln-d")[added] == before
    old = {k: v for k, v in paper.items() if k != "validation"}
    saved = json.dumps({**old, "validation": 0.1})
    assert cl_checkpoint_settings(saved, "split-mnist", "bgln-d")["validation"] == 0.1
    hp = continual.Hyperparameters.from_dict(paper)
    assert "not paper protocol" not in _protocol(hp, "split-mnist", "bgln-d")
    assert _row_changes(hp, "split-mnist", "bgln-d") == "–"
    held = hp.with_overrides(validation=0.1)
    assert _protocol(held, "split-mnist", "bgln-d").endswith(
        "(**not paper protocol**: validation)")
    assert _row_changes(held, "split-mnist", "bgln-d") == "validation 0.1"


def test_results_files_with_a_bad_fraction_are_refused():
    hp = continual.Hyperparameters.paper("split-mnist", "finetune").with_overrides(tasks=2)
    done = [continual.SeedResult(7, [[99.0, 50.0], [98.0, 97.0]], 12.0, [])]
    written = continual.RunResults.collect("split-mnist", "finetune", hp, [7], done).to_json()
    for good in (None, 0.1):
        raw = dict(written, hyperparameters={**written["hyperparameters"], "validation": good})
        assert continual.RunResults.from_json(raw).hyperparameters.validation == good
    for bad in (0, 1, 1.5, -0.1, "0.1", True):
        raw = dict(written, hyperparameters={**written["hyperparameters"], "validation": bad})
        with pytest.raises(ResultsFormatError, match="validation must be null or a fraction"):
            continual.RunResults.from_json(raw)


# ----- tune -------------------------------------------------------------------------------------

@needs_mnist
def test_tune_chooses_on_the_validation_split_and_reports_the_test_sets(tmp_path, capsys):
    root = tmp_path / "tune"
    args = ["cl", "tune", "--benchmark", "split-mnist", "--method", "ewc", "--grid", "0", "30",
            "--tuning-seed", "7", "--seeds", "3", "--out", str(root), *TINY]
    assert main(args) == 0
    tuned = json.loads((root / "tune.json").read_text())
    assert tuned["validation"] == 0.1 and tuned["schema_version"] == 2
    for scale in (0, 30):
        point = json.loads((root / "grid" / f"lambda-{scale}" / "results.json").read_text())
        assert point["hyperparameters"]["validation"] == 0.1 and point["seeds"] == [7]
        # scored on 20 held-out examples per task (0.1 of 200), not on the 100 test ones
        assert all(abs(a / 5 - round(a / 5)) < 1e-9
                   for row in point["accuracy_matrix"]["7"] for a in row)
    final = json.loads((root / "final" / "results.json").read_text())
    assert final["hyperparameters"]["validation"] is None
    assert final["hyperparameters"]["fsd_scale"] == tuned["chosen"]
    text = (root / "tune.md").read_text()
    assert "on a validation split: 10 % of each task's training examples held out" in text
    assert "avg validation accuracy" in text and "average test accuracy" in text
    # the tuning table reads the output as it is: tune.json, the final run in final/
    table = continual.tune_tables([str(tmp_path)]).splitlines()
    assert len(table) == 3 and table[2].startswith(
        "| tune | split-mnist | ewc | epochs 1, train subset 200, test subset 100, tasks 2 | "
        "7, validation (10 %) | ")
    assert f"**{tuned['chosen']:g}: " in table[2] and "| 3 |" in table[2]
    # resumable: started again, nothing trains
    capsys.readouterr()
    assert main(args) == 0
    assert "] task" not in capsys.readouterr().err
    assert json.loads((root / "tune.json").read_text()) == tuned


@needs_mnist
def test_tune_validation_zero_is_the_grid_on_the_test_sets(tmp_path):
    root = tmp_path / "tune"
    assert main(["cl", "tune", "--benchmark", "split-mnist", "--method", "finetune", "--grid",
                 "0", "--tuning-seed", "7", "--seeds", "3", "--out", str(root),
                 "--validation", "0", *TINY]) == 0
    point = json.loads((root / "grid" / "lambda-0" / "results.json").read_text())
    assert point["hyperparameters"]["validation"] is None
    tuned = json.loads((root / "tune.json").read_text())
    assert tuned["validation"] is None
    assert "on the test sets" in (root / "tune.md").read_text()


def test_tune_help_explains_the_split(capsys):
    with pytest.raises(SystemExit):
        main(["cl", "tune", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "validation split" in text and "--validation FRACTION" in text
    assert "default 0.1; 0: the grid on the test sets" in text


# ----- bad values -------------------------------------------------------------------------------

CL = ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--out"]
TUNE = ["cl", "tune", "--benchmark", "split-mnist", "--method", "finetune", "--grid", "1",
        "--out"]


@pytest.mark.parametrize("command, value", [
    *[(CL, v) for v in ("0", "1", "-0.1", "nan", "x", "inf", "0.0")],
    *[(TUNE, v) for v in ("1", "-0.1", "nan", "x", "1.5")]])
def test_bad_fractions_exit_2_with_one_line(tmp_path, capsys, command, value):
    with pytest.raises(SystemExit) as stop:
        main([*command, str(tmp_path / "out"), "--validation", value,
              "--data-dir", str(tmp_path / "no-data")])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert stop.value.code == 2 and len(lines) == 1, err
    assert "argument --validation" in lines[0] and repr(value) in lines[0]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("bad", [0, 1, -0.1, math.nan, 2])
def test_bad_fractions_are_refused_by_the_settings(tmp_path, bad):
    with pytest.raises(ValueError, match="validation must be a fraction strictly between"):
        continual.RunSettings.create("split-mnist", "finetune", [0], tmp_path,
                                     validation=bad)
    with pytest.raises(ValueError, match="validation must be a fraction strictly between"):
        make_tasks("split-mnist", str(tmp_path), 0, validation=bad)
