"""Every bad input and fault of the reliability table, and what a user sees.

Runs each case — a library call with a bad argument, a damaged file, a bad ``fsd`` command
line — and prints a markdown table: the case, the exception type (or the command's exit code)
and the first line of the message. ``docs/reliability.md`` is this script's output::

    python benchmarks/reliability.py > table.md

The command-line cases need the ``fsd`` command of ``pip install -e ".[experiments]"``; they
read no data (each fails on its arguments before any is loaded).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Callable

import torch
from torch import nn

import fsd

CASES: list[tuple[str, Callable[[], object]]] = []


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


@case("BGLN-D on a residual network")
def _():
    class Residual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(4, 4), nn.Linear(4, 3)

        def forward(self, x):
            return self.fc2(x + torch.relu(self.fc1(x)))

    fsd.BGLN(deterministic=True).fit(Residual(), X)


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


@case("EWC on a model with `ReLU(inplace=True)` (was 2.7× too large)")
def _():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    est = fsd.EWC(metric="kl").fit(model, torch.randn(256, 4))
    return f"Fisher of layer 0 sums to {float(est._stored['fisher.0.weight'].sum()):.4g}"


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
    ("`fsd influence uci --cg-iters 0`",
     ["influence", "uci", "--dataset", "boston", "--out", "OUT", "--cg-iters", "0"]),
    ("`fsd influence uci --damping -1`",
     ["influence", "uci", "--dataset", "boston", "--out", "OUT", "--damping", "-1"]),
    ("`fsd influence mislabeled --corrupt 1.5`",
     ["influence", "mislabeled", "--out", "OUT", "--corrupt", "1.5"]),
    ("`fsd toy --lam nan`", ["toy", "--out", "OUT", "--lam", "nan"]),
    ("`fsd compare-estimators --repeats 0`", ["compare-estimators", "--repeats", "0"]),
    ("`fsd cl report` of a missing directory", ["cl", "report", "MISSING"]),
]


def _outcome(fn: Callable[[], object]) -> tuple[str, str]:
    try:
        result = fn()
    except Exception as error:  # what the user sees is the point
        message = (str(error).strip().splitlines() or [""])[0]
        return type(error).__name__, re.sub(r"/\S*/(summary\.fsd|summaries)", r"DIR/\1", message)
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
                             capture_output=True, text=True, timeout=120)
        lines = [line for line in run.stderr.strip().splitlines() if line.strip()]
        message = lines[-1].replace(d, "DIR") if lines else ""
    return f"exit {run.returncode}", message


def main() -> None:
    """Print the table."""
    rows = [(d, *_outcome(fn)) for d, fn in CASES]
    rows += [(d, *_command(args)) for d, args in COMMANDS]
    print("| case | outcome | message |")
    print("|---|---|---|")
    for description, outcome, message in rows:
        print(f"| {description} | {outcome} | {message.replace('|', '/')} |")


if __name__ == "__main__":
    sys.exit(main())
