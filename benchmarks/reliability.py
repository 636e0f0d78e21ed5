"""Every bad input and fault of the reliability table, and what a user sees.

Runs each case — a library call with a bad argument, a damaged file, a bad ``fsd`` command
line — and prints a markdown table: the case, the exception type (or the command's exit code)
and the first line of the message. ``docs/reliability.md`` is this script's output::

    python benchmarks/reliability.py --out OUT/reliability   # also OUT/reliability.{md,json}

The command-line cases need the ``fsd`` command of ``pip install -e ".[experiments]"``; they
read no real data (each fails on its arguments before any is loaded, or builds the files it
needs, a tiny fake MNIST included, in a temporary folder).
"""

from __future__ import annotations

import gzip
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from typing import Callable

import torch
from torch import nn

import fsd
from fsd_experiments.printed_report import printed_report

CASES: list[tuple[str, Callable[[], object]]] = []

#: the commands run offline: a case that reached for data must not download it
_OFFLINE = {**os.environ, "FSD_NO_DOWNLOAD": "1"}


def case(description: str):
    def register(fn: Callable[[], object]) -> Callable[[], object]:
        CASES.append((description, fn))
        return fn
    return register


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


X = torch.randn(32, 4)


@case("`fit` on data with the wrong feature size")
def _():
    fsd.BGLN(deterministic=True).fit(_mlp(), torch.randn(8, 5))


@case("`fit` with `outputs=[-1]`")
def _():
    fsd.EWC().fit(_mlp(), X, outputs=[-1])


@case("`fit` with `outputs=[0, 7]` on a 3-output model")
def _():
    fsd.LAFTR().fit(_mlp(), X, outputs=[0, 7])


@case("`fit` with `outputs=[0, 0]` (an output counted twice)")
def _():
    fsd.LAFTR().fit(_mlp(), X, outputs=[0, 0])


class _Squeezed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 1)

    def forward(self, x):
        return self.fc(x).squeeze(-1)


@case("`fit` on a regression net returning `(N,)`")
def _():
    fsd.NTK().fit(_Squeezed(), X)


@case("`fit` of `metric=\"kl\"` on one output")
def _():
    fsd.LAFTR(metric="kl").fit(_mlp(), X, outputs=[2])


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@case("KFAC on tied weights")
def _():
    fsd.KFAC().fit(_Tied(), X)


@case("NTK measuring another function at θ0 (ReLU swapped for GELU)")
def _():
    relu = _mlp()
    gelu = nn.Sequential(nn.Linear(4, 8), nn.GELU(), nn.Linear(8, 3))
    gelu.load_state_dict(relu.state_dict())
    fsd.NTK().fit(relu, X).distance(gelu)


@case("`fit` on dict batches without `batch_to_input`")
def _():
    fsd.EWC().fit(_mlp(), [{"image": X}])


@case("`fit` on an empty generator")
def _():
    fsd.NTK().fit(_mlp(), (b for b in []))


@case("`fit` with NaN inputs")
def _():
    fsd.ExactFSD().fit(_mlp(), torch.full((4, 4), float("nan")))


@case("class-wise `fit` with label −1")
def _():
    fsd.BGLN(deterministic=True, classwise=True).fit(_mlp(), [(X, -torch.ones(32).long())])


@case("`ExactFSD(batch_size=0)`")
def _():
    fsd.ExactFSD(batch_size=0)


@case("`BGLN(num_samples=2.5)`")
def _():
    fsd.BGLN(num_samples=2.5)


@case("LAFTR on a model with a forward hook")
def _():
    model = _mlp()
    model[0].register_forward_hook(lambda m, a, out: 10 * out)
    fsd.LAFTR().fit(model, X)


class _Residual(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 3)
        self.norm = nn.LayerNorm(4) if norm else nn.Identity()

    def forward(self, x):
        return self.fc2(x + torch.relu(self.norm(self.fc1(x))))


@case("BGLN-D (Algorithm 2) on a residual network")
def _():
    fsd.BGLN(deterministic=True).fit(_Residual(), X)


@case("BGLN-D (exact moments) on a residual network with LayerNorm")
def _():
    fsd.BGLN(deterministic=True, moments="exact").fit(_Residual(norm=True), X)


@case("KFAC on a residual network with LayerNorm")
def _():
    est = fsd.KFAC().fit(_Residual(norm=True), X)
    return f"diagonal Gauss-Newton blocks for {', '.join(est.diagonal_parameters)}"


@case("KFAC on a grouped convolution")
def _():
    est = fsd.KFAC().fit(nn.Sequential(nn.Conv2d(2, 4, 3, groups=2), nn.Flatten()),
                         torch.randn(8, 2, 5, 5))
    return f"diagonal Gauss-Newton blocks for {', '.join(est.diagonal_parameters)}"


@case("`distance` of a model with another architecture")
def _():
    est = fsd.EWC().fit(_mlp(), X)
    est.distance(nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 3)))


def _damaged(change: Callable[[dict], None]) -> Callable[[], object]:
    def run() -> object:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "summary.fsd")
            fsd.BGLN(deterministic=True, covariance="full").fit(_mlp(), X).save(path)
            payload = torch.load(path, weights_only=True)
            change(payload["tensors"])
            torch.save(payload, path)
            return fsd.load(path)
    return run


case("`fsd.load` of a summary with a negated covariance")(
    _damaged(lambda t: t.update({"input.cov": -t["input.cov"]})))
case("`fsd.load` of a summary with a wrong-shaped mean")(
    _damaged(lambda t: t.update({"input.mean": t["input.mean"][:, :2]})))
case("`fsd.load` of a summary with integer tensors")(
    _damaged(lambda t: t.update({"input.mean": t["input.mean"].long()})))


@case("`fsd.load` of a truncated file")
def _():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "summary.fsd")
        fsd.EWC().fit(_mlp(), X).save(path)
        with open(path, "rb") as f:
            head = f.read(300)
        with open(path, "wb") as f:
            f.write(head)
        fsd.load(path)


@case("`est.save()` to a directory")
def _():
    with tempfile.TemporaryDirectory() as d:
        os.mkdir(os.path.join(d, "summaries"))
        fsd.EWC().fit(_mlp(), X).save(os.path.join(d, "summaries"))


@case("`est.save()` into a missing folder")
def _():
    with tempfile.TemporaryDirectory() as d:
        fsd.EWC().fit(_mlp(), X).save(os.path.join(d, "missing", "summary.fsd"))


@case("`est.save()` after a save to the same file was killed before its rename")
def _():
    with tempfile.TemporaryDirectory() as d:
        leftover = os.path.join(d, ".fsd-summary.fsd.k1ll3d.tmp")  # what a killed save leaves
        open(leftover, "wb").close()
        os.utime(leftover, (time.time() - 7200, time.time() - 7200))
        fsd.EWC().fit(_mlp(), X).save(os.path.join(d, "summary.fsd"))
        return "the leftover of two hours ago is removed: " + ", ".join(sorted(os.listdir(d)))


def _gzip_bomb(path: str, shape: tuple[int, ...], megabytes: int) -> None:
    """A uint8 idx header declaring ``shape``, then ``megabytes`` MB of zeros, gzipped."""
    with gzip.open(path, "wb", compresslevel=9) as gz:
        gz.write(bytes([0, 0, 0x08, len(shape)]) + b"".join(struct.pack(">I", n) for n in shape))
        for _ in range(megabytes):
            gz.write(bytes(1 << 20))


@case("`read_idx` of a 400 KB .gz declaring 2 images that inflates to 400 MB")
def _():
    from fsd_experiments.data import read_idx
    with tempfile.TemporaryDirectory() as d:
        _gzip_bomb(os.path.join(d, "t10k-images-idx3-ubyte.gz"), (2, 28, 28), 400)
        read_idx(os.path.join(d, "t10k-images-idx3-ubyte.gz"))


@case("`load_mnist` of a header declaring a million test images")
def _():
    from fsd_experiments.data import load_mnist
    with tempfile.TemporaryDirectory() as d:
        os.mkdir(os.path.join(d, "mnist"))
        _gzip_bomb(os.path.join(d, "mnist", "t10k-images-idx3-ubyte.gz"), (10**6, 28, 28), 1)
        _gzip_bomb(os.path.join(d, "mnist", "t10k-labels-idx1-ubyte.gz"), (10**6,), 1)
        load_mnist(d, split="test")


def _uci(rows: list[str], features: str = "0\n1\n") -> Callable[[], object]:
    def run() -> object:
        from fsd_experiments.data import load_uci
        with tempfile.TemporaryDirectory() as d:
            _write_uci(d, rows, features)
            return load_uci("energy", d)
    return run


def _write_uci(d: str, rows: list[str], features: str = "0\n1\n") -> None:
    folder = os.path.join(d, "uci", "energy")
    os.makedirs(folder)
    for name, text in [("data.txt", "\n".join(rows) + "\n"), ("index_features.txt", features),
                       ("index_target.txt", "2\n")]:
        with open(os.path.join(folder, name), "w") as f:
            f.write(text)


case("`load_uci` of a data.txt with a NaN row")(_uci(["1 2 3", "4 nan 6", "7 8 9"]))
case("`load_uci` of a one-row data.txt")(_uci(["1 2 3"]))
case("`load_uci` of a data.txt with a 1e308 entry")(_uci(["1 2 3", "1e308 5 6", "7 8 9"]))
case("`load_uci` with the target column among the features")(
    _uci(["1 2 3", "4 5 6"], features="0\n2\n"))


@case("EWC on a model with `ReLU(inplace=True)` (was 2.7× too large)")
def _():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    est = fsd.EWC(metric="kl").fit(model, torch.randn(256, 4))
    return f"Fisher of layer 0 sums to {float(est._stored['fisher.0.weight'].sum()):.4g}"


@case("`fit` of a model with a NaN parameter")
def _():
    model = _mlp()
    with torch.no_grad():
        model[2].weight[0, 0] = float("nan")
    fsd.LAFTR().fit(model, X)


@case("`fit` of a model on the `meta` device")
def _():
    fsd.EWC().fit(_mlp().to("meta"), X)


@case("`fit` of a model whose forward returns a dict, without `output=`")
def _():
    class DictOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _mlp()

        def forward(self, x):
            return {"logits": self.net(x)}

    fsd.NTK().fit(DictOut(), X)


@case("EWC on a float16 model (its Fisher overflowed to inf before)")
def _():
    est = fsd.EWC().fit(_mlp().half(), 255 * X.abs().half())
    moved = _mlp().half()
    with torch.no_grad():
        moved[0].weight.add_(0.01)
    distance = est.distance(moved)
    return (f"finite {distance.dtype} distance {float(distance.detach()):.3g}; the Fisher is "
            f"stored in {est._stored['fisher.0.weight'].dtype}")


@case("`fsd.load` of a summary with one flipped bit in a stored tensor")
def _():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "summary.fsd")
        fsd.EWC().fit(_mlp(), X).save(path)
        payload = torch.load(path, weights_only=True)
        weight = payload["tensors"]["theta0.0.weight"]
        weight.view(torch.int32)[0, 0] ^= 1 << 20  # one bit of the first weight's mantissa
        torch.save(payload, path)
        return fsd.load(path)


@case("`fsd.calibrate` with `scale=0`")
def _():
    est = fsd.EWC().fit(_mlp(), X)
    fsd.calibrate(est, _mlp(), X, scale=0.0)


@case("`ContinualRegularizer(strength=1e308)`")
def _():
    fsd.ContinualRegularizer(strength=1e308)


@case("`distance` of a model with a NaN parameter (all 11 estimator configurations)")
def _():
    est = fsd.BGLN(deterministic=True).fit(_mlp(), X)
    moved = _mlp()
    with torch.no_grad():
        moved[2].weight[0, 0] = float("nan")
    est.distance(moved)


@case("`distance` of a model on the `meta` device")
def _():
    fsd.ExactFSD().fit(_mlp(), X).distance(_mlp().to("meta"))


@case("EWC measuring another function at θ0 (ReLU swapped for Tanh)")
def _():
    relu = _mlp()
    tanh = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3))
    tanh.load_state_dict(relu.state_dict())
    fsd.EWC().fit(relu, X).distance(tanh)


@case("KFAC measuring another function at θ0 (ReLU replaced by Identity)")
def _():
    relu = _mlp()
    identity = nn.Sequential(nn.Linear(4, 8), nn.Identity(), nn.Linear(8, 3))
    identity.load_state_dict(relu.state_dict())
    fsd.KFAC().fit(relu, X).distance(identity)


@case("`fit` on a later batch of another feature width")
def _():
    batches = [(X, torch.zeros(32).long()), (torch.randn(8, 5), torch.zeros(8).long())]
    fsd.KFAC().fit(_mlp(), batches)


@case("`fsd.calibrate` with `seed='a'`")
def _():
    fsd.calibrate(fsd.EWC().fit(_mlp(), X), _mlp(), X, seed="a")


@case("`fsd.calibrate` with `seed=2**70`")
def _():
    fsd.calibrate(fsd.EWC().fit(_mlp(), X), _mlp(), X, seed=2 ** 70)


@case("`fsd.calibrate` with `model=None`")
def _():
    fsd.calibrate(fsd.EWC().fit(_mlp(), X), None, X)  # type: ignore[arg-type]


@case("`fsd.calibrate` with a model of another architecture")
def _():
    other = nn.Sequential(nn.Linear(4, 9), nn.ReLU(), nn.Linear(9, 3))
    fsd.calibrate(fsd.EWC().fit(_mlp(), X), other, X)


@case("`ContinualRegularizer(strength=10**400)`")
def _():
    fsd.ContinualRegularizer(strength=10 ** 400)


@case("EWC on a feature of 1.7e12 (a Unix time in ms): the summary would not load")
def _():
    x = X.clone()
    x[:, 3] = 1.7e12 + torch.arange(32.0)
    fsd.EWC().fit(_mlp(), x)


@case("LAFTR with Gaussian inputs on inputs ×1e20")
def _():
    fsd.LAFTR(inputs="gaussian").fit(_mlp(), X * 1e20)


@case("`ContinualRegularizer.end_task` with a task that would not load (inputs ×1e10)")
def _():
    regularizer = fsd.ContinualRegularizer(fsd.KFAC)
    regularizer.end_task(_mlp(), X)
    regularizer.end_task(_mlp(), X * 1e10)  # refused; the first task stays


def _in_a_child(code: str, limit: int) -> None:
    """Run ``code`` in a Python child with a file size limit; raise its last error line."""
    import resource

    def limited() -> None:  # Python ignores SIGXFSZ: a write past the limit gets EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    with tempfile.TemporaryDirectory() as d:
        run = subprocess.run([sys.executable, "-c", code], cwd=d, capture_output=True,
                             text=True, preexec_fn=limited, timeout=300)
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
    if run.returncode:  # the child's "Type: message", raised here as that type
        name, _, message = (lines[-1] if lines else "Error: ").partition(": ")
        raise type(name, (Exception,), {})(message.replace(d, "DIR"))


@case("`est.save()` past a file size limit (`ulimit -f`), as on a full disk")
def _():
    _in_a_child("import torch, fsd; m = torch.nn.Linear(300, 300); "
                "fsd.EWC().fit(m, torch.randn(8, 300)).save('s.fsd')", limit=64 << 10)


@case("`fsd.load` of a FIFO with no writer (it waited for ever)")
def _():
    with tempfile.TemporaryDirectory() as d:
        os.mkfifo(os.path.join(d, "pipe.fsd"))
        fsd.load(os.path.join(d, "pipe.fsd"))


@case("`fsd.load` of a summary whose `checksums` entry was deleted")
def _():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "summary.fsd")
        fsd.EWC().fit(_mlp(), X).save(path)
        payload = torch.load(path, weights_only=True)
        del payload["checksums"]
        torch.save(payload, path)
        return fsd.load(path)


@case("`fsd.load` of a summary of format version 99")
def _():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "summary.fsd")
        fsd.EWC().fit(_mlp(), X).save(path)
        payload = torch.load(path, weights_only=True)
        payload["version"] = 99
        torch.save(payload, path)
        return fsd.load(path)


@case("`ContinualRegularizer.load` of a file with a task dropped")
def _():
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "reg.fsd")
        regularizer = fsd.ContinualRegularizer(fsd.EWC)
        regularizer.end_task(_mlp(), X)
        regularizer.end_task(_mlp(), X)
        regularizer.save(path)
        payload = torch.load(path, weights_only=True)
        payload["summaries"] = payload["summaries"][:1]
        torch.save(payload, path)
        return fsd.ContinualRegularizer.load(path)


CL = ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--out", "OUT"]
COMMANDS: list[tuple[str, list[str]]] = [
    ("`fsd cl ... --tasks -1`", [*CL, "--tasks", "-1"]),
    ("`fsd cl ... --train-subset -5`", [*CL, "--train-subset", "-5"]),
    ("`fsd cl ... --fsd-scale nan`", [*CL, "--fsd-scale", "nan"]),
    ("`fsd cl ... --fsd-scale -5`", [*CL, "--fsd-scale", "-5"]),
    ("`fsd cl ... --width 0`", [*CL, "--width", "0"]),
    ("`fsd cl ... --epochs 0`", [*CL, "--epochs", "0"]),
    ("`fsd cl ... --seeds 3 3`", [*CL, "--seeds", "3", "3"]),
    ("`fsd cl ... --threads 0`", [*CL, "--threads", "0"]),
    ("`fsd cl ... --device bogus`", [*CL, "--device", "bogus"]),
    ("`fsd influence uci --removals -3`",
     ["influence", "uci", "--dataset", "boston", "--out", "OUT", "--removals", "-3"]),
    ("`fsd influence uci --removals 2`",
     ["influence", "uci", "--dataset", "boston", "--out", "OUT", "--removals", "2"]),
    ("`fsd influence uci --cg-iters 0`",
     ["influence", "uci", "--dataset", "boston", "--out", "OUT", "--cg-iters", "0"]),
    ("`fsd influence uci --damping -1`",
     ["influence", "uci", "--dataset", "boston", "--out", "OUT", "--damping", "-1"]),
    ("`fsd influence mislabeled --corrupt 1.5`",
     ["influence", "mislabeled", "--out", "OUT", "--corrupt", "1.5"]),
    ("`fsd toy --lam nan`", ["toy", "--out", "OUT", "--lam", "nan"]),
    ("`fsd compare-estimators --repeats 0`", ["compare-estimators", "--repeats", "0"]),
    ("`fsd cl report` of a missing directory", ["cl", "report", "MISSING"]),
    ("`fsd fidelity --epochs 1e30`", ["fidelity", "--out", "OUT", "--epochs", "1e30"]),
    ("`fsd fidelity --lrs 0`", ["fidelity", "--out", "OUT", "--lrs", "0"]),
    ("`fsd memory --C -1`", ["memory", "--C", "-1"]),
    ("`fsd toy --out ''`", ["toy", "--out", ""]),
    ("`fsd cl ... --data-dir ''`", [*CL, "--data-dir", ""]),
    ("`fsd cl` with MNIST missing and downloads off",
     [*CL, "--seeds", "1", "--no-download"]),
    ("`fsd fidelity --estimators bogus`", ["fidelity", "--out", "OUT", "--estimators", "bogus"]),
]


def _fake_mnist(d: str) -> str:
    """A tiny MNIST (100 train, 50 test images, every digit) in ``d/data``; its path."""
    folder = os.path.join(d, "data", "mnist")
    os.makedirs(folder)
    for prefix, n in (("train", 100), ("t10k", 50)):
        for kind, shape, body in (("images-idx3", (n, 28, 28), bytes(range(256)) * (n * 784 // 256)
                                   + bytes(n * 784 % 256)),
                                  ("labels-idx1", (n,), bytes(i % 10 for i in range(n)))):
            with open(os.path.join(folder, f"{prefix}-{kind}-ubyte"), "wb") as f:
                f.write(bytes([0, 0, 0x08, len(shape)]))
                f.write(b"".join(struct.pack(">I", s) for s in shape) + body)
    return os.path.join(d, "data")


TINY_CL = ["cl", "--benchmark", "split-mnist", "--method", "bgln-d", "--seeds", "1", "--tasks",
           "3", "--epochs", "1", "--no-plots", "--no-progress"]


def _cl_checkpoint(d: str, damage: Callable[[str], None]) -> list[str]:
    """A finished tiny ``fsd cl`` run on fake MNIST, damaged; the command resuming it."""
    args = [*TINY_CL, "--data-dir", _fake_mnist(d), "--out", os.path.join(d, "run")]
    subprocess.run([shutil.which("fsd") or "fsd", *args], check=True, capture_output=True,
                   env=_OFFLINE)
    os.remove(os.path.join(d, "run", "results.json"))
    damage(os.path.join(d, "run", "checkpoints", "seed1"))
    return args


def _garbage_state(folder: str) -> None:
    with open(os.path.join(folder, "state.pt"), "wb") as f:
        f.write(os.urandom(300))


def _lose_task0(folder: str) -> None:
    # the checkpoint after task 2 of 3, whose task 3 reads task0.fsd and task1.fsd
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    state["matrix"] = state["matrix"][:2]
    torch.save(state, os.path.join(folder, "state.pt"))
    os.remove(os.path.join(folder, "task0.fsd"))


def _cut_matrix(folder: str) -> None:
    # the accuracy matrix of a finished seed cut to its first 2 rows: resuming would retrain
    # task 3 on top of task 3's weights
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    state["matrix"] = state["matrix"][:2]
    torch.save(state, os.path.join(folder, "state.pt"))


def _future_version(folder: str) -> None:
    state = torch.load(os.path.join(folder, "state.pt"), weights_only=True)
    state["version"] = 99
    torch.save(state, os.path.join(folder, "state.pt"))


def _users_folder(d: str) -> list[str]:
    folder = os.path.join(d, "mine")
    os.makedirs(os.path.join(folder, "drafts"))
    for name in ("notes.txt", "results.md", os.path.join("drafts", ".draft.tmp")):
        with open(os.path.join(folder, name), "w") as f:
            f.write("the user's\n")
    return [*TINY_CL, "--data-dir", _fake_mnist(d), "--out", folder]


def _linked_lock(d: str) -> list[str]:
    args = _cl_checkpoint(d, lambda folder: None)
    run = os.path.join(d, "run")
    with open(os.path.join(d, "precious.txt"), "w") as f:
        f.write("keep me\n")
    os.remove(os.path.join(run, ".lock"))
    os.symlink(os.path.join(d, "precious.txt"), os.path.join(run, ".lock"))
    return args


def _inside_checkpoints(d: str) -> list[str]:
    args = _cl_checkpoint(d, lambda folder: None)
    inside = os.path.join(d, "run", "checkpoints", "seed1", "sub")
    return [*args[:-1], inside]


def _a_file(d: str) -> str:
    open(os.path.join(d, "a-file"), "w").close()
    return os.path.join(d, "a-file")


def _huge_uci_row(d: str) -> list[str]:
    _write_uci(d, ["1 2 3", "1e308 5 6", "7 8 9", "2 3 4"])
    return ["influence", "uci", "--dataset", "energy", "--data-dir", d, "--out",
            os.path.join(d, "out")]


#: command lines that need files first: each builds them in a temporary folder DIR
FILE_COMMANDS: list[tuple[str, Callable[[str], list[str]]]] = [
    ("`fsd cl --out` an existing regular file",
     lambda d: [*TINY_CL, "--data-dir", d, "--out", _a_file(d)]),
    ("`fsd cl` resuming a random-bytes `state.pt`", lambda d: _cl_checkpoint(d, _garbage_state)),
    ("`fsd cl` resuming a checkpoint without the `task0.fsd` it needs",
     lambda d: _cl_checkpoint(d, _lose_task0)),
    ("`fsd data fetch mnist --data-dir` a regular file",
     lambda d: ["data", "fetch", "mnist", "--data-dir", _a_file(d)]),
    ("`fsd influence uci` on a data.txt with a 1e308 entry", _huge_uci_row),
    ("`fsd cl --out` a folder holding a user's files (`notes.txt`, `results.md`, "
     "`drafts/.draft.tmp`)", _users_folder),
    ("`fsd cl` on a run whose `.lock` is a symbolic link to a user's file", _linked_lock),
    ("`fsd cl` resuming a `state.pt` whose accuracy matrix was cut to 2 rows",
     lambda d: _cl_checkpoint(d, _cut_matrix)),
    ("`fsd cl` resuming a checkpoint of `version: 99`",
     lambda d: _cl_checkpoint(d, _future_version)),
    ("`fsd cl --out` inside another run's checkpoint folder", _inside_checkpoints),
    ("`fsd compare-estimators --out` below a regular file",
     lambda d: ["compare-estimators", "--no-download", "--data-dir", d, "--out",
                os.path.join(_a_file(d), "x")]),
    ("`fsd influence mislabeled --n-train 1` (no corrupted point to detect)",
     lambda d: ["influence", "mislabeled", "--out", os.path.join(d, "out"), "--data-dir",
                _fake_mnist(d), "--n-train", "1", "--methods", "random", "--epochs", "1",
                "--no-progress"]),
]


def _file_command(setup: Callable[[str], list[str]]) -> tuple[str, str]:
    command = shutil.which("fsd")
    if command is None:
        return "skipped", "no `fsd` command (pip install -e \".[experiments]\")"
    with tempfile.TemporaryDirectory() as d:
        run = subprocess.run([command, *setup(d)], capture_output=True, text=True, timeout=300,
                             env=_OFFLINE)
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
        message = lines[-1].replace(d, "DIR") if lines else ""
    return f"exit {run.returncode}", message


def _outcome(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        result = fn()
    except Exception as error:  # what the user sees is the point
        message = (str(error).strip().splitlines() or [""])[0]
        # a temporary folder's path is DIR: the same on every machine
        return type(error).__name__, re.sub(re.escape(tempfile.gettempdir()) + r"/[^/\s']+",
                                            "DIR", message)
    return "works", "" if result is None or isinstance(result, fsd.Estimator) else str(result)


def _command(args: list[str]) -> tuple[str, str]:
    command = shutil.which("fsd")
    if command is None:
        return "skipped", "no `fsd` command (pip install -e \".[experiments]\")"
    with tempfile.TemporaryDirectory() as d:
        args = [os.path.join(d, "out") if a == "OUT" else
                os.path.join(d, "missing") if a == "MISSING" else a for a in args]
        run = subprocess.run([command, *args, *(["--data-dir", d] if args[0] != "cl" or
                                                  args[1] != "report" else [])],
                             capture_output=True, text=True, timeout=120, env=_OFFLINE)
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
        message = lines[-1].replace(d, "DIR") if lines else ""
    return f"exit {run.returncode}", message


def main() -> None:
    """Print the table (``--out PREFIX``: also to PREFIX.md and PREFIX.json)."""
    out = sys.argv[sys.argv.index("--out") + 1] if "--out" in sys.argv else None
    with printed_report(out):
        table()


def table() -> None:
    """Run every case and print the markdown table."""
    rows = [(d, *_outcome(fn)) for d, fn in CASES]
    rows += [(d, *_command(args)) for d, args in COMMANDS]
    rows += [(d, *_file_command(setup)) for d, setup in FILE_COMMANDS]
    print("| case | outcome | message |")
    print("|---|---|---|")
    for description, outcome, message in rows:
        print(f"| {description} | {outcome} | {message.replace('|', '/')} |")


if __name__ == "__main__":
    sys.exit(main())
