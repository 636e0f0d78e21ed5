"""What fitting and using a summary costs against a training step, on a ResNet and a ViT.

Run:  .venv/bin/python benchmarks/model_zoo_costs.py [--threads 1] [--repeats 5]

For the torchvision-style ResNet-18 (16×16 inputs) and the ViT (8×8) of the model zoo
(``tests/zoo_models.py``), in float32, in one process: one plain training step (forward,
cross-entropy, backward at batch 32) is the unit; each of the eight estimators, with its
default settings, is timed fitting on 256 examples (batches of 32) and for one
``distance(model).backward()`` at a moved model. Prints medians of ``--repeats`` runs and
their ratios to the step; a refused estimator is marked so.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import fsd
import zoo_models as zoo

ESTIMATORS: dict[str, Callable[[], fsd.Estimator]] = {
    "ExactFSD": fsd.ExactFSD,
    "LAFTR": fsd.LAFTR,
    "BGLN-S": fsd.BGLN,
    "BGLN-D": lambda: fsd.BGLN(deterministic=True),
    "BGLN-D exact": lambda: fsd.BGLN(deterministic=True, moments="exact"),
    "NTK": fsd.NTK,
    "EWC": fsd.EWC,
    "KFAC": fsd.KFAC,
}
MODELS = {"resnet18": 16, "vit": 8}  # zoo name: image size
EXAMPLES, BATCH = 256, 32


def _median(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {platform.machine()}, {torch.get_num_threads()} "
          f"thread(s), float32, fit on {EXAMPLES} examples, step and distance at batch {BATCH}, "
          f"medians of {args.repeats}")
    print("| model | estimator | fit (ms) | fit / step | distance + backward (ms) "
          "| distance + backward / step |")
    print("|---|---|---|---|---|---|")
    for name, size in MODELS.items():
        _measure(name, size, args.repeats)


def _measure(name: str, size: int, repeats: int) -> None:
    """Print the rows of one model: the plain step, then each estimator."""
    torch.manual_seed(0)
    model = zoo.MODELS[name].build().float().eval()
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(EXAMPLES, 3, size, size, generator=generator)
    y = torch.randint(0, 3, (EXAMPLES,), generator=generator)
    data = [(x[i:i + BATCH], y[i:i + BATCH]) for i in range(0, EXAMPLES, BATCH)]
    moved = zoo.moved(model, 0.05)

    def step() -> None:
        model.zero_grad()
        F.cross_entropy(model(x[:BATCH]), y[:BATCH]).backward()

    step_time = _median(step, repeats)
    print(f"| {name} | plain step (batch {BATCH}) | {1e3 * step_time:.2f} | 1 | | |")
    for label, make in ESTIMATORS.items():
        try:
            est = make().fit(model, data)
        except (ValueError, TypeError, NotImplementedError):
            print(f"| {name} | {label} | refused | | | |")
            continue
        fit_time = _median(lambda make=make: make().fit(model, data), repeats)

        def use(est: fsd.Estimator = est) -> None:
            moved.zero_grad()
            est.distance(moved).backward()

        use_time = _median(use, repeats)
        print(f"| {name} | {label} | {1e3 * fit_time:.1f} | {fit_time / step_time:.1f} | "
              f"{1e3 * use_time:.2f} | {use_time / step_time:.2f} |", flush=True)

if __name__ == "__main__":
    main()
