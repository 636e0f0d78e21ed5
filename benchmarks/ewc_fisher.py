"""EWC's exact Fisher diagonal: the Linear-layer (g²)ᵀ(a²) path vs per-example gradients.

Run:  .venv/bin/python benchmarks/ewc_fisher.py [--threads 1] [--examples 256]
      [--widths 256 1024] [--device cuda]

For an MNIST-shaped MLP 784-W-W-10 and random inputs, fits ``fsd.EWC(fisher="true",
metric="kl")`` twice in one process: through the Linear fast path (the default for models
whose parameters all sit in ``nn.Linear`` layers) and through the generic path (vmapped
per-example, per-class gradients; forced by hiding the Linear layers). Prints seconds, the
ratio generic / fast, and the largest relative difference between the two diagonals.
"""

from __future__ import annotations

import argparse
import platform
import time
from unittest import mock

import torch

import fsd
import fsd.estimators.ewc
from fsd_experiments.compare import mlp
from fsd_experiments.devices import device_name
from fsd_experiments.printed_report import printed_report


def _fit(model: torch.nn.Module, data: list, device: torch.device) -> tuple[float, dict]:
    start = time.perf_counter()
    est = fsd.EWC(fisher="true", metric="kl").fit(model, data, progress=False)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start, {k: v for k, v in est._state.items()
                                         if k.startswith("fisher.")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--examples", type=int, default=256)
    parser.add_argument("--widths", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None,
                        help="also write what is printed to OUT.md and its tables to OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with printed_report(args.out, device=device_name(device)):
        run(args, device)


def run(args: argparse.Namespace, device: torch.device) -> None:
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{args.threads} thread(s), device {device}, float32, {args.examples} examples, "
          f"10 classes")
    print("\n| width | fast: s | generic: s | generic / fast | largest relative difference |\n"
          "|---:|---:|---:|---:|---:|")
    for width in args.widths:
        torch.manual_seed(width)
        model = mlp(784, width, 2, 10).to(device)
        x = torch.rand(args.examples, 784, device=device)
        data = [(x[i:i + 128], None) for i in range(0, args.examples, 128)]
        fast_seconds, fast = _fit(model, data, device)
        with mock.patch.object(fsd.estimators.ewc, "_linear_layers", lambda m: None):
            generic_seconds, generic = _fit(model, data, device)
        diff = max(float((fast[k] - generic[k]).abs().max() / generic[k].abs().max())
                   for k in generic)
        print(f"| {width} | {fast_seconds:.2f} | {generic_seconds:.2f} | "
              f"{generic_seconds / fast_seconds:.1f} | {diff:.1e} |", flush=True)


if __name__ == "__main__":
    main()
