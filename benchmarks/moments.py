"""Cost of each deterministic BGLN variant per distance call, relative to the paper's BGLN-D.

Run:  .venv/bin/python benchmarks/moments.py [--data-dir D] [--threads 1] [--repeats 20]

MLP 784-256-256-{2,10}, moments of real MNIST training images when found, else random
inputs. Times distance+backward (medians), in one process, side by side.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch

import fsd
from fsd_experiments.compare import mlp
from fsd_experiments.data import DataNotFoundError, TensorBatches, load_mnist
from fsd_experiments.printed_report import printed_report
from penalty import median_ms, perturbed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--out", default=None,
                        help="also write what is printed to OUT.md and its tables to OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with printed_report(args.out):
        run(args)


def run(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    try:
        x, y = load_mnist(args.data_dir, "train")
        source = "real MNIST"
    except DataNotFoundError:
        x, y = torch.rand(12_000, 1, 28, 28), torch.randint(0, 10, (12_000,))
        source = "random inputs"
    x, y = x[:12_000], y[:12_000]
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); inputs: {source}")
    variants = {
        "paper (Algorithm 2)": dict(covariance="full"),
        "paper, lowrank r=64": dict(covariance="lowrank", rank=64),
        "exact moments": dict(moments="exact", covariance="full"),
        "exact moments, lowrank r=64": dict(moments="exact", covariance="lowrank", rank=64),
        "exact moments, diag": dict(moments="exact", covariance="diag"),
        "exact + layerwise": dict(moments="exact", covariance="full", reference="layerwise"),
        "paper + layerwise": dict(covariance="full", reference="layerwise"),
    }
    for outputs in (2, 10):
        model = mlp(784, 256, 2, outputs)
        data = TensorBatches(x, y % outputs, 2000)
        moved = perturbed(model, 0.01, 1)
        print(f"\n## outputs = {outputs}\n| variant | ms (distance+backward) | vs paper | bytes |")
        print("|---|---:|---:|---:|")
        base = None
        for name, kwargs in variants.items():
            est = fsd.BGLN(deterministic=True, **kwargs).fit(model, data)

            def call(est=est, moved=moved):
                moved.zero_grad()
                est.distance(moved).backward()

            ms = median_ms(call, args.repeats)
            base = base or ms
            print(f"| {name} | {ms:.2f} | {ms / base:.1f}x | {est.nbytes:,} |")


if __name__ == "__main__":
    main()
