"""Another checkout's fsd against this one, side by side in one process: penalty cost.

Run:  .venv/bin/python benchmarks/old_vs_new.py --old OTHER/src [--threads 1] [--repeats 15]
      [--cases a,b] [--out PREFIX]   (PREFIX.md and PREFIX.json keep the printed table)

``OTHER/src`` holds another checkout's ``fsd`` package (``git worktree add OTHER <commit>``);
it is copied under the name ``fsd_old`` (the package imports itself relatively) and imported
beside this checkout's ``fsd``. Each case fits the same summaries with both on the same
random data, then times distance + backward at a moved model, old and new interleaved
(medians of ``--repeats``). Cases: Algorithm 2 on MLP chains 784-W-W-10 (W = 256, 512;
low-rank r = 64; one summary and ``fsd.combine`` of 9), exact moments on the width-256
chain (one and 9), the residual graph of width 256 (exact moments), the paper's CIFAR
CNN (Algorithm 2, low-rank r = 64), and the linearized pass of LAFTR (coreset; chain and
residual graph) and BGLN-S (chain) at width 256, and the corrected recursion
(``fsd.BGLN(deterministic=True, moments="corrected")``) at widths 256 and 512; then whole
training steps (batch 128, the loss plus the penalty, backward, an Adam step, so that the
parameters change every step)
for Algorithm 2, exact moments with 9 summaries, BGLN-S, LAFTR, EWC, KFAC (also on the CNN)
and NTK. A refactor should leave every ratio near 1.
"""

from __future__ import annotations

import argparse
import copy
import importlib
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any, Callable

import torch
from torch import nn

import fsd
from fsd_experiments.printed_report import printed_report


class Residual(nn.Module):
    """784 → W → (+ ReLU(W → W)) → 10."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.hidden = nn.Linear(784, width), nn.Linear(width, width)
        self.out = nn.Linear(width, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + torch.relu(self.hidden(h)))


def _mlp(width: int) -> nn.Module:
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, 10))


def _cnn() -> nn.Module:
    # the paper's CIFAR CNN: conv-conv-pool-conv-conv-pool-fc-fc
    return nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 32, 3),
                         nn.ReLU(), nn.MaxPool2d(2), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                         nn.Conv2d(64, 64, 3), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64 * 6 * 6, 512), nn.ReLU(), nn.Linear(512, 10))


def _data(shape: tuple[int, ...], n: int = 512) -> list:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, *shape, generator=gen)
    y = torch.randint(0, 10, (n,), generator=gen)
    return [(x[i:i + 128], y[i:i + 128]) for i in range(0, n, 128)]


def _moved(model: nn.Module) -> nn.Module:
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.01 * torch.randn_like(p))
    return other


def _corrected(package: Any, config: dict[str, Any]) -> Any:
    """The corrected recursion's estimator: a BGLN option, or the prototype class before."""
    try:
        return package.BGLN(deterministic=True, moments="corrected", **config)
    except ValueError:  # an fsd before moments="corrected" was public
        return importlib.import_module(
            f"{package.__name__}.estimators.variants").BGLNVariant(moments="corrected", **config)


def _penalty(package: Any, build: Callable[[], nn.Module], shape: tuple[int, ...],
             summaries: int, **config: Any) -> Callable[[], None]:
    torch.manual_seed(0)
    model = build().eval()
    data = _data(shape)
    kind = config.pop("estimator", "bgln-d")
    # a whole training step: the loss on a batch plus the penalty, backward, an Adam step
    # (the parameters change every step, as in training); otherwise distance + backward
    training = config.pop("training_step", False)
    make = {"bgln-d": lambda: package.BGLN(deterministic=True, **config),
            "bgln-s": lambda: package.BGLN(**config),
            "laftr": lambda: package.LAFTR(**config),
            "ewc": lambda: package.EWC(**config),
            "kfac": lambda: package.KFAC(**config),
            "ntk": lambda: package.NTK(**config),
            "corrected": lambda: _corrected(package, config)}[kind]
    fitted = [make().fit(_moved(model), data) for _ in range(summaries)]
    target = package.combine(fitted) if summaries > 1 else fitted[0]
    moved = _moved(model)
    x, y = data[0]
    optimizer = torch.optim.Adam(moved.parameters(), lr=1e-6)

    def step() -> None:
        moved.zero_grad(set_to_none=True)
        penalty = target.distance(moved)
        if training:
            (nn.functional.cross_entropy(moved(x), y) + penalty).backward()
            optimizer.step()
        else:
            penalty.backward()
    return step


def _median_pair(old: Callable[[], None], new: Callable[[], None], repeats: int
                 ) -> tuple[float, float]:
    for fn in (old, new, old, new):  # warm-up
        fn()
    times: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(repeats):
        for i, fn in enumerate((old, new)):
            start = time.perf_counter()
            fn()
            times[i].append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[0]), statistics.median(times[1])


def _import_old(source: str) -> Any:
    root = tempfile.mkdtemp(prefix="fsd-old-")
    shutil.copytree(os.path.join(source, "fsd"), os.path.join(root, "fsd_old"))
    sys.path.insert(0, root)
    return importlib.import_module("fsd_old")


def main() -> None:
    """Print the old/new table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--old", required=True, help="a checkout's src directory")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--cases", default="", help="comma-separated case names (default all)")
    parser.add_argument("--out", default=None,
                        help="also keep the printed table as OUT.md and OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    old = _import_old(args.old)
    lowrank = {"covariance": "lowrank", "rank": 64}
    cases: dict[str, tuple] = {
        "alg2-w256-K1": (lambda: _mlp(256), (784,), 1, lowrank),
        "alg2-w256-K9": (lambda: _mlp(256), (784,), 9, lowrank),
        "alg2-w512-K1": (lambda: _mlp(512), (784,), 1, lowrank),
        "alg2-w512-K9": (lambda: _mlp(512), (784,), 9, lowrank),
        "exact-w256-K1": (lambda: _mlp(256), (784,), 1, {**lowrank, "moments": "exact"}),
        "exact-w256-K9": (lambda: _mlp(256), (784,), 9, {**lowrank, "moments": "exact"}),
        "graph-w256": (lambda: Residual(256), (784,), 1, {**lowrank, "moments": "exact"}),
        "cifar-cnn": (_cnn, (3, 32, 32), 1, lowrank),
        # LAFTR and BGLN-S: the linearized pass, on a chain and on a graph
        "laftr-w256": (lambda: _mlp(256), (784,), 1, {"estimator": "laftr"}),
        "bgln-s-w256": (lambda: _mlp(256), (784,), 1, {"estimator": "bgln-s"}),
        "laftr-graph-w256": (lambda: Residual(256), (784,), 1, {"estimator": "laftr"}),
        # the corrected recursion (fsd.BGLN(deterministic=True, moments="corrected"))
        "corrected-w256": (lambda: _mlp(256), (784,), 1, {**lowrank, "estimator": "corrected"}),
        "corrected-w512": (lambda: _mlp(512), (784,), 1, {**lowrank, "estimator": "corrected"}),
        # whole training steps (batch 128, Adam): the parameters change every step, so the
        # checks distance runs once per model state run every step
        "step-alg2-w256": (lambda: _mlp(256), (784,), 1, {**lowrank, "training_step": True}),
        "step-exact-w256-K9": (lambda: _mlp(256), (784,), 9,
                               {**lowrank, "moments": "exact", "training_step": True}),
        "step-bgln-s-w256": (lambda: _mlp(256), (784,), 1,
                             {"estimator": "bgln-s", "training_step": True}),
        "step-laftr-w256": (lambda: _mlp(256), (784,), 1,
                            {"estimator": "laftr", "training_step": True}),
        "step-ewc-w256": (lambda: _mlp(256), (784,), 1,
                          {"estimator": "ewc", "training_step": True}),
        "step-kfac-w256": (lambda: _mlp(256), (784,), 1,
                           {"estimator": "kfac", "training_step": True}),
        "step-ntk-w256": (lambda: _mlp(256), (784,), 1,
                          {"estimator": "ntk", "training_step": True}),
        "step-kfac-cifar-cnn": (_cnn, (3, 32, 32), 1, {"estimator": "kfac", "training_step": True}),
    }
    chosen = args.cases.split(",") if args.cases else list(cases)
    with printed_report(args.out):
        _table(old, cases, chosen, args.repeats, args.threads)


def _table(old: Any, cases: dict[str, tuple], chosen: list[str], repeats: int, threads: int
           ) -> None:
    """Time each chosen case, old and new interleaved, and print the table."""
    print(f"torch {torch.__version__}, {platform.machine()}, {threads} thread(s), "
          f"medians of {repeats}, distance + backward (step-*: a whole training step)")
    print("| case | old (ms) | new (ms) | new / old |")
    print("|---|---:|---:|---:|")
    for name in chosen:
        build, shape, k, config = cases[name]
        old_ms, new_ms = _median_pair(_penalty(old, build, shape, k, **dict(config)),
                                      _penalty(fsd, build, shape, k, **dict(config)),
                                      repeats)
        print(f"| {name} | {old_ms:.2f} | {new_ms:.2f} | {new_ms / old_ms:.3f} |", flush=True)


if __name__ == "__main__":
    main()
