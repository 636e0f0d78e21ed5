"""``fsd cl`` with the CNN: Split CIFAR-100 (6 and 11 tasks) and Split Fashion-MNIST.

Everything runs on tiny data sets in the official file formats written by the tests
(``datafiles``): CIFAR is not needed on the machine. The runs that fit Gaussian input
moments of CIFAR's 3072 dimensions decompose 3072 × 3072 covariances (seconds each) and are
marked slow.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from datafiles import write_cifar, write_mnist_like
from fsd_experiments import continual
from fsd_experiments.benchmarks import make_tasks
from fsd_experiments.cli import main
from fsd_experiments.continual.reporting import penalty_gap
from fsd_experiments.continual.settings import Hyperparameters
from fsd_experiments.models import cifar_cnn, conv_net
from fsd_experiments.presets import CNN_METHODS

#: the methods the paper runs on Split CIFAR-100; the first three fit no input moments
CHEAP = ["finetune", "ntk", "laftr-coreset", "osla"]
MOMENTS = ["laftr", "bgln-s", "bgln-s-cw"]
TINY = ["--seeds", "3", "--epochs", "1", "--train-subset", "12",
        "--test-subset", "10", "--num-samples", "2", "--coreset-size", "5", "--no-progress",
        "--no-plots"]


@pytest.fixture(scope="module")
def cifar_dir(tmp_path_factory) -> Path:
    """CIFAR-10 and CIFAR-100 folders, 2 images per class in every batch file."""
    return write_cifar(tmp_path_factory.mktemp("cifar"), per_class=2)


@pytest.fixture(scope="module")
def fashion_dir(tmp_path_factory) -> Path:
    """Fashion-MNIST idx files, 6 images per class in each split."""
    root = tmp_path_factory.mktemp("fashion")
    write_mnist_like(root / "fashion-mnist", per_class=6)
    return root


def _cl(out: Path, data_dir: Path, benchmark: str, method: str, *extra: str) -> int:
    # CIFAR's first task trains 200 epochs unless told otherwise
    first = ["--first-epochs", "1"] if benchmark.startswith("split-cifar") else []
    return main(["cl", "--benchmark", benchmark, "--method", method, "--out", str(out),
                 "--data-dir", str(data_dir), *TINY, *first, *extra])


def _run_and_resume(out: Path, data_dir: Path, benchmark: str, method: str, *extra: str,
                    capsys: pytest.CaptureFixture) -> dict:
    """One run, then the same command again: it must train nothing and change nothing."""
    assert _cl(out, data_dir, benchmark, method, *extra) == 0
    first = (out / "results.json").read_text()
    capsys.readouterr()
    assert _cl(out, data_dir, benchmark, method, *extra) == 0
    assert "] task" not in capsys.readouterr().err  # no task trained again
    assert (out / "results.json").read_text() == first
    return json.loads(first)


# ----- the network -----------------------------------------------------------------------------

def test_conv_net_follows_the_input_shape_and_has_froms_dropout():
    cifar = conv_net((3, 32, 32), 60)
    fashion = conv_net((1, 28, 28), 10)
    dense = [m for m in cifar if isinstance(m, nn.Linear)]
    assert dense[0].in_features == 64 * 6 * 6 and dense[1].out_features == 60
    assert next(m for m in fashion if isinstance(m, nn.Linear)).in_features == 64 * 5 * 5
    # FROMP's CifarNet: 0.25 after each max-pool, 0.5 after the dense layer
    assert [m.p for m in cifar if isinstance(m, nn.Dropout)] == [0.25, 0.25, 0.5]
    kinds = [type(m).__name__ for m in cifar]
    assert kinds[kinds.index("MaxPool2d") + 1] == "Dropout" and kinds[-2] == "Dropout"
    # the paper's parameter count; dropout adds none
    assert sum(p.numel() for p in cifar_cnn().parameters()) == 1_276_508
    assert not any(isinstance(m, nn.Dropout) for m in conv_net((1, 28, 28), 10, dropout=False))
    x = torch.rand(4, 1, 28, 28)
    fashion.eval()
    assert torch.equal(fashion(x), fashion(x))  # dropout off at evaluation


def test_the_average_pool_cnn_differs_only_in_its_pools():
    torch.manual_seed(0)
    maxed = conv_net((1, 28, 28), 10)
    torch.manual_seed(0)
    averaged = conv_net((1, 28, 28), 10, pool="avg")
    kinds = [type(m).__name__ for m in maxed]
    assert [type(m).__name__ for m in averaged] == [
        "AvgPool2d" if k == "MaxPool2d" else k for k in kinds]
    # same parameters (the same draws), so the outputs differ by the pooling alone
    for a, b in zip(maxed.parameters(), averaged.parameters(), strict=True):
        assert torch.equal(a, b)
    x = torch.rand(3, 1, 28, 28)
    pooled = averaged[:5].eval()(x)  # conv, ReLU, conv, ReLU, pool
    assert torch.allclose(pooled, nn.functional.avg_pool2d(averaged[:4].eval()(x), 2))
    with pytest.raises(ValueError, match="pool must be"):
        conv_net((1, 28, 28), 10, pool="min")


# ----- the task streams -------------------------------------------------------------------------

@pytest.mark.parametrize("benchmark, count", [("split-cifar100", 6), ("split-cifar100-11", 11)])
def test_split_cifar100_streams(cifar_dir, benchmark, count):
    tasks, outputs = make_tasks(benchmark, str(cifar_dir), seed=0)
    assert len(tasks) == count and outputs == 10 * count
    for t, task in enumerate(tasks):
        assert task.outputs == list(range(10 * t, 10 * t + 10))  # its own head of 10 units
        assert task.x_train.shape[1:] == (3, 32, 32)
        assert 0.0 <= float(task.x_train.min()) and float(task.x_train.max()) <= 1.0
        # every image carries its original class in its first byte (datafiles.cifar_files)
        for x, y in ((task.x_train, task.y_train), (task.x_test, task.y_test)):
            original = (x[:, 0, 0, 0] * 255).round().long()
            first = 0 if t == 0 else 10 * (t - 1)  # CIFAR-10, then CIFAR-100 0–9, 10–19, …
            assert sorted(set(original.tolist())) == list(range(first, first + 10))
            assert torch.equal(y, original - first)  # labels 0–9 within the head
        assert task.x_train.shape[0] == (100 if t == 0 else 20)
    assert tasks[0].name == "CIFAR-10" and tasks[1].name == "CIFAR-100 0–9"
    assert tasks[-1].name == f"CIFAR-100 {10 * (count - 2)}–{10 * (count - 1) - 1}"
    short, _ = make_tasks(benchmark, str(cifar_dir), seed=0, num_tasks=2, train_subset=7,
                          test_subset=5)
    assert len(short) == 2 and [len(t.y_train) for t in short] == [7, 7]
    assert [len(t.y_test) for t in short] == [5, 5]


def test_split_cifar100_paper_settings():
    d = continual.default_hyperparameters("split-cifar100", "bgln-s-cw")
    assert (d["first_epochs"], d["epochs"], d["fsd_scale"], d["batch_size"], d["lr"]) == \
        (200, 50, 10.0, 512, 1e-3)
    assert (d["model"], d["coreset_size"], d["momentum"], d["metric"]) == \
        ("cnn", 200, 0.99, "softmax_euclidean")
    ntk = continual.default_hyperparameters("split-cifar100-11", "ntk")
    assert (ntk["epochs"], ntk["fsd_scale"], ntk["metric"]) == (80, 0.005, "kl")
    assert continual.default_hyperparameters("split-cifar100", "laftr-coreset")["metric"] == "kl"
    assert continual.default_hyperparameters("split-cifar100", "bgln-s")["fsd_scale"] == 1.0
    # MNIST benchmarks keep the MLP and one number of epochs for every task
    m = continual.default_hyperparameters("split-fashion-mnist", "bgln-s")
    assert (m["model"], m["first_epochs"], m["coreset_size"]) == ("mlp", None, 40)
    hp = Hyperparameters.paper("split-cifar100", "finetune")
    assert [hp.epochs_of_task(t) for t in range(3)] == [200, 80, 80]
    assert {"finetune", "laftr", "laftr-coreset", "bgln-s", "bgln-s-cw", "ntk"} <= \
        set(CNN_METHODS)
    # Algorithm 2 runs on the CNN (fsd.moments.algorithm2_conv), and K-FAC (KFC's convolution
    # factors); exact moments do not
    assert {"bgln-d", "bgln-d-cw", "bgln-d-var", "osla"} <= set(CNN_METHODS)
    assert not {"bgln-d-exact", "bgln-d-layerwise"} & set(CNN_METHODS)
    assert continual.default_hyperparameters("split-cifar100", "bgln-d")["rank"] == 64
    # the NTK estimator gets the metric too
    est = continual.METHODS["ntk"].continual_estimator(ntk, 0)
    assert est.config["metric"] == "kl" and est.config["coreset_size"] == 200


@pytest.mark.parametrize("argv, needle", [
    (["--benchmark", "split-cifar100", "--method", "bgln-d-exact"],
     "bgln-d-exact does not run on the CNN"),
    (["--benchmark", "split-cifar100-11", "--method", "bgln-d-layerwise"],
     "bgln-d-layerwise does not run on the CNN"),
    (["--benchmark", "split-mnist", "--model", "cnn", "--method", "bgln-d-layerwise"],
     "the methods that do: finetune"),
    (["--benchmark", "split-cifar100", "--method", "bgln-s", "--width", "64"],
     "width applies to the MLP"),
    (["--benchmark", "split-mnist", "--model", "cnn-avgpool", "--method", "bgln-d-exact"],
     "bgln-d-exact does not run on the CNN"),
])
def test_methods_without_a_cnn_version_are_refused(tmp_path, capsys, argv, needle):
    assert main(["cl", *argv, "--out", str(tmp_path / "run"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert needle in err and err.count("\n") == 1 and err.startswith("error: ")
    assert not (tmp_path / "run").exists()  # refused before anything ran


# ----- end to end ------------------------------------------------------------------------------

def _check_cifar_run(res: dict, tasks: int, method: str, out: Path) -> None:
    matrix = res["accuracy_matrix"]["3"]
    assert len(matrix) == tasks and all(len(row) == tasks for row in matrix)
    assert res["hyperparameters"]["model"] == "cnn"
    assert res["hyperparameters"]["first_epochs"] == 1
    assert (res["summary_bytes_per_task"] > 0) == (method != "finetune")
    summaries = sorted(p.name for p in (out / "checkpoints" / "seed3").glob("task*.fsd"))
    assert len(summaries) == (0 if method == "finetune" else tasks - 1)
    assert "CNN" in continual.report([str(out)])


@pytest.mark.parametrize("method", [
    *CHEAP, *(pytest.param(m, marks=pytest.mark.slow) for m in MOMENTS)])
def test_split_cifar100_end_to_end_and_resume(tmp_path, cifar_dir, capsys, method):
    extra = ["--tasks", "2"]
    if method == "bgln-s-cw":
        # each class's covariance costs 3072 × 3072 eigendecompositions: at most two classes
        # (the Fashion-MNIST test fits all of them)
        extra += ["--train-subset", "2"]
    res = _run_and_resume(tmp_path, cifar_dir, "split-cifar100", method, *extra,
                          capsys=capsys)
    _check_cifar_run(res, 2, method, tmp_path)


@pytest.mark.parametrize("method", ["finetune", "laftr-coreset", "ntk"])
def test_split_cifar100_11_end_to_end_and_resume(tmp_path, cifar_dir, capsys, method):
    # the whole 11-task stream (110 outputs); the Gaussian-input methods run the same code on
    # the 6-task benchmark above, as its first two tasks are this one's
    extra = ["--tasks", "3"] if method == "ntk" else []
    res = _run_and_resume(tmp_path, cifar_dir, "split-cifar100-11", method, *extra,
                          capsys=capsys)
    _check_cifar_run(res, 3 if extra else 11, method, tmp_path)


@pytest.mark.parametrize("method, model", [
    *((m, "cnn") for m in ("finetune", "bgln-s-cw", "laftr", "bgln-d", "osla")),
    ("bgln-d-corrected", "cnn-avgpool")])
def test_split_fashion_mnist_with_the_cnn(tmp_path, fashion_dir, capsys, method, model):
    extra = ["--rank", "8"] if method.startswith("bgln-d") else []
    res = _run_and_resume(tmp_path, fashion_dir, "split-fashion-mnist", method, "--model",
                          model, "--tasks", "3", "--batch-size", "8", *extra, capsys=capsys)
    matrix = res["accuracy_matrix"]["3"]
    assert len(matrix) == 3 and res["hyperparameters"]["model"] == model
    state = torch.load(tmp_path / "checkpoints" / "seed3" / "state.pt", weights_only=True)
    assert state["model"]["13.weight"].shape == (512, 64 * 5 * 5)  # the 1×28×28 CNN
    if method != "finetune":  # fsd cl gap rebuilds the CNN from the checkpoints
        rows = penalty_gap(tmp_path, str(fashion_dir), examples=20)
        assert [r["task"] for r in rows] == [1, 2] and all(r["true_fsd"] > 0 for r in rows)
    assert ("CNN, average pools" in continual.report([str(tmp_path)])) == (model != "cnn")
    # the MLP stays the default on the MNIST benchmarks
    mlp_run = tmp_path / "mlp"
    assert _cl(mlp_run, fashion_dir, "split-fashion-mnist", "finetune", "--tasks", "2") == 0
    assert json.loads((mlp_run / "results.json").read_text())["hyperparameters"][
        "model"] == "mlp"


def test_checkpoint_older_than_the_model_setting_resumes(tmp_path, fashion_dir, capsys):
    assert _cl(tmp_path, fashion_dir, "split-fashion-mnist", "finetune", "--tasks", "2") == 0
    first = json.loads((tmp_path / "results.json").read_text())
    state_path = tmp_path / "checkpoints" / "seed3" / "state.pt"
    state = torch.load(state_path, weights_only=True)
    saved = json.loads(state["hyperparameters"])
    del saved["model"], saved["first_epochs"]  # as written before the settings existed
    state["hyperparameters"] = json.dumps(saved)
    torch.save(state, state_path)
    raw = dict(first)
    raw["hyperparameters"] = {k: v for k, v in first["hyperparameters"].items()
                              if k not in ("model", "first_epochs")}
    (tmp_path / "results.json").write_text(json.dumps(raw))
    capsys.readouterr()
    assert _cl(tmp_path, fashion_dir, "split-fashion-mnist", "finetune", "--tasks", "2") == 0
    assert "] task" not in capsys.readouterr().err
    again = json.loads((tmp_path / "results.json").read_text())
    assert again["accuracy_matrix"] == first["accuracy_matrix"]
    assert again["hyperparameters"]["model"] == "mlp"


@pytest.mark.parametrize("method", ["finetune", "osla", "bgln-d-corrected"])
def test_split_fashion_mnist_with_the_residual_cnn(tmp_path, fashion_dir, capsys, method):
    # the small ResNet (residual additions, a conv1×1 shortcut, adaptive pooling) trains,
    # resumes, reports as a ResNet, and fsd cl gap walks its checkpoints
    extra = ["--rank", "8"] if method.startswith("bgln-d") else []
    res = _run_and_resume(tmp_path, fashion_dir, "split-fashion-mnist", method, "--model",
                          "resnet", "--tasks", "2", "--batch-size", "8", *extra, capsys=capsys)
    assert len(res["accuracy_matrix"]["3"]) == 2 and res["hyperparameters"]["model"] == "resnet"
    state = torch.load(tmp_path / "checkpoints" / "seed3" / "state.pt", weights_only=True)
    assert state["model"]["layer2.downsample.weight"].shape == (32, 16, 1, 1)
    assert "ResNet" in continual.report([str(tmp_path)])
    if method != "finetune":
        rows = penalty_gap(tmp_path, str(fashion_dir), examples=20)
        assert [r["task"] for r in rows] == [1] and rows[0]["true_fsd"] > 0


def test_a_method_that_walks_chains_only_is_refused_on_the_residual_cnn(tmp_path, fashion_dir,
                                                                        capsys):
    # before any training, in one line naming the methods that run on it
    assert _cl(tmp_path / "run", fashion_dir, "split-fashion-mnist", "bgln-d", "--model",
               "resnet") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bgln-d does not run on the residual CNN" in err[0]
    assert "bgln-d-corrected" in err[0] and not (tmp_path / "run" / "results.json").exists()
