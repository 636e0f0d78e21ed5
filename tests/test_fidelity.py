"""Fidelity studies: metrics, common random numbers, a tiny end-to-end run."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

import fsd_experiments
from datafiles import REAL_DATA_DIR
from fsd_experiments.benchmarks import Benchmark, Task, load_benchmark
from fsd_experiments.cli import main
from fsd_experiments.fidelity import (
    FidelityConfig,
    fidelity_metrics,
    fit_suite,
    run_fidelity,
    train_reference,
)
from fsd_experiments.fidelity.cli import add_cli

DATA_DIR = REAL_DATA_DIR


def synthetic(d: int = 6, n: int = 120, seed: int = 0) -> Benchmark:
    """Two 2-class Gaussian tasks with class-dependent means."""
    g = torch.Generator().manual_seed(seed)

    def task(shift: float) -> Task:
        def part(m: int) -> tuple[torch.Tensor, torch.Tensor]:
            y = torch.arange(m) % 2
            x = torch.randn(m, d, generator=g) + shift + 1.5 * y.unsqueeze(1).float()
            return x, y
        return Task(*part(n), *part(n // 2))

    return Benchmark("synthetic", 2, task(0.0), task(3.0))


def test_metrics_on_known_values():
    m = fidelity_metrics([1, 2, 3, 4], [2, 4, 6, 8], [1.0, 0.5, 0.0, 1.0])
    assert m["spearman"] == pytest.approx(1) and m["kendall"] == pytest.approx(1)
    assert m["pearson"] == pytest.approx(1)
    assert m["median_ratio"] == pytest.approx(2) and m["median_rel_error"] == pytest.approx(1)
    assert m["median_grad_cosine"] == pytest.approx(0.75) and m["min_grad_cosine"] == 0
    reverse = fidelity_metrics([1, 2, 3], [3, 2, 1])
    assert reverse["spearman"] == pytest.approx(-1)


def test_sampled_estimates_use_common_random_numbers():
    torch.set_num_threads(1)
    bench = synthetic()
    ref = train_reference(bench, width=8, depth=1, epochs=1, lr=1e-2, batch_size=32, seed=0)
    suite = fit_suite(ref, bench, ["BGLN-S", "BGLN-D", "LAFTR (coreset)"], coreset_size=20,
                      num_samples=32, repeats=2)
    other = train_reference(bench, width=8, depth=1, epochs=1, lr=1e-2, batch_size=32, seed=1)
    first = suite.evaluate("BGLN-S", other)
    assert torch.equal(first, suite.evaluate("BGLN-S", other))  # same draws every time
    assert float(suite.evaluate("BGLN-D", ref).detach()) == pytest.approx(0, abs=1e-10)
    assert float(suite.evaluate("LAFTR (coreset)", ref).detach()) == pytest.approx(0, abs=1e-10)


def test_tiny_run_writes_everything(tmp_path):
    torch.set_num_threads(1)
    cfg = FidelityConfig(width=8, depth=1, lrs=(1e-3, 1e-2), iters=(2, 5), references=2,
                         coreset_size=16, num_samples=32, repeats=2, depths=(1, 2),
                         depth_lrs=(1e-2,), depth_iters=(2, 5, 10), depth_references=1,
                         minimize_steps=6, log_every=3, lams=(1.0,),
                         minimize_estimators=("none", "BGLN-D", "NTK (coreset)"))
    results = run_fidelity(synthetic(), tmp_path, cfg, progress=False)
    for name in ("fidelity_synthetic.json", "fidelity_synthetic.md", "scatter_synthetic.png",
                 "depth_synthetic.png", "minimize_synthetic.png"):
        assert (tmp_path / name).exists(), name
    saved = json.loads((tmp_path / "fidelity_synthetic.json").read_text())
    assert len(saved["pairs"]["pairs"]) == 8
    assert set(saved["pairs"]["summary"]) == set(cfg.estimators)
    for m in results["pairs"]["summary"].values():
        assert -1 <= m["median_grad_cosine"] <= 1
    assert [r["depth"] for r in saved["depth"]["depths"]] == [1, 2]
    assert saved["schema_version"] == 1 and saved["fsd_version"] == fsd_experiments.__version__
    assert saved["torch_version"] == torch.__version__ and saved["torch_threads"] >= 1
    curve = saved["minimize"]["runs"][0]
    assert curve["step"] == [0, 3, 6] and curve["true_fsd"][0] == 0
    assert curve["estimator"] == "none" and curve["estimate"] == [None] * 3
    for run in saved["minimize"]["runs"][1:]:  # the regularizer's own estimate, 0 at θ1
        assert len(run["estimate"]) == 3 and run["estimate"][0] == pytest.approx(0, abs=1e-8)
        assert run["estimate"][-1] > 0
    bgln_d = saved["minimize"]["runs"][1]
    ratio = bgln_d["estimate"][-1] / bgln_d["true_fsd"][-1]
    assert f"| BGLN-D | 1 | {bgln_d['true_fsd'][-1]:.4g} |" in (
        tmp_path / "fidelity_synthetic.md").read_text()
    assert f"| {ratio:.3g} |" in (tmp_path / "fidelity_synthetic.md").read_text()


def test_cli_rejects_an_unknown_estimator_before_loading_data(tmp_path, capsys):
    missing = tmp_path / "no-data-here"
    with pytest.raises(SystemExit) as stop:
        main(["fidelity", "--out", str(tmp_path / "out"), "--data-dir", str(missing),
              "--minimize-estimators", "none,BGLN-Q"])
    assert "unknown estimators ['BGLN-Q']" in str(stop.value) and "'BGLN-D (exact)'" in str(
        stop.value)
    with pytest.raises(SystemExit, match="unknown estimators"):
        main(["fidelity", "--out", str(tmp_path / "out"), "--data-dir", str(missing),
              "--estimators", "none"])
    assert not (tmp_path / "out").exists()


def test_softmax_metric_reaches_the_truth_and_every_estimator(tmp_path):
    """On a linear network, coreset estimators over all the data are exact in any metric.

    So with ``metric="softmax_euclidean"`` the estimate must equal a brute-force softmax
    distance, and the minimization log's estimate must equal its truth at every step; an
    estimator left on logits would be off by orders of magnitude.
    """
    torch.set_num_threads(1)
    bench = synthetic()
    ref = train_reference(bench, width=8, depth=0, epochs=1, lr=1e-2, batch_size=32, seed=0)
    names = ["LAFTR (coreset)", "NTK (coreset)"]
    suite = fit_suite(ref, bench, names, coreset_size=1000, metric="softmax_euclidean")
    other = train_reference(bench, width=8, depth=0, epochs=1, lr=1e-2, batch_size=32, seed=1)
    x = bench.task1.x_train
    with torch.no_grad():
        brute = 0.5 * (other(x).softmax(-1) - ref(x).softmax(-1)).pow(2).sum(-1).mean()
    assert float(suite.exact.distance(other)) == pytest.approx(float(brute), rel=1e-5)
    for name in names:
        assert float(suite.evaluate(name, other).detach()) == pytest.approx(float(brute),
                                                                             rel=1e-4)
    cfg = FidelityConfig(width=8, depth=0, coreset_size=1000, minimize_steps=6, log_every=3,
                         lams=(1.0,), minimize_estimators=("none", *names),
                         metric="softmax_euclidean")
    results = run_fidelity(bench, tmp_path, cfg, studies=("minimize",), progress=False)
    for run in results["minimize"]["runs"][1:]:
        assert run["true_fsd"][-1] > 0
        assert run["estimate"] == pytest.approx(run["true_fsd"], rel=1e-4, abs=1e-9)
    assert "Output metric: softmax_euclidean" in (tmp_path / "fidelity_synthetic.md").read_text()
    with pytest.raises(ValueError, match="BGLN-D compute only the Euclidean metric"):
        fit_suite(ref, bench, ["BGLN-D"], metric="kl")


def test_cli_metric_keeps_the_estimators_that_compute_it(tmp_path):
    missing = tmp_path / "no-data-here"
    with pytest.raises(SystemExit) as stop:
        main(["fidelity", "--out", str(tmp_path / "out"), "--data-dir", str(missing),
              "--metric", "kl", "--minimize-estimators", "none,BGLN-S,BGLN-D,EWC"])
    assert str(stop.value).startswith("BGLN-D, EWC compute only the Euclidean metric")
    assert "'BGLN-S'" in str(stop.value) and "'BGLN-D'" not in str(stop.value)
    assert not (tmp_path / "out").exists()
    args = argparse.Namespace(**{**vars(_parser_defaults()), "metric": "kl"})
    cfg = FidelityConfig.from_args(args)
    assert "BGLN-D" not in cfg.estimators + cfg.minimize_estimators + cfg.depth_estimators
    assert {"BGLN-S", "LAFTR (gaussian)", "NTK (coreset)"} <= set(cfg.estimators)
    assert "none" in cfg.minimize_estimators and "BGLN-S" in cfg.depth_estimators


def _parser_defaults() -> argparse.Namespace:
    """``fsd fidelity``'s parsed defaults."""
    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    return parser.parse_args(["fidelity", "--out", "unused"])


@pytest.mark.usefixtures("real_data")
def test_benchmarks_load():
    split = load_benchmark("split-mnist", str(DATA_DIR), max_train=50, max_test=20)
    assert split.outputs == 2 and split.task1.x_train.shape == (50, 784)
    assert set(split.task2.y_train.tolist()) <= {0, 1}
    perm = load_benchmark("permuted-mnist", str(DATA_DIR), max_train=30, max_test=10)
    assert perm.outputs == 10
    torch.testing.assert_close(perm.task1.x_train.sort(1).values, perm.task2.x_train.sort(1).values)
    assert torch.equal(perm.task1.y_train, perm.task2.y_train)


def test_cli_lists_fidelity(capsys):
    with pytest.raises(SystemExit):
        main(["fidelity", "--help"])
    assert "--benchmark" in capsys.readouterr().out
