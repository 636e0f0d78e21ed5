"""Batched PBRF solves (vmap over stacked θ) vs one solve after another (issue: influence).

Run:  .venv/bin/python benchmarks/pbrf.py [--threads 1] [--points 32] [--steps 40]
      [--device cuda] [--width 128]

For each distance term (exact minibatch oracle, EWC, BGLN-D with 30 k-means clusters and the
point term), times in one process:
 (a) a plain autograd SGD loop on the module, one point after another (what ``fsd.uses.influence``
     did before batching: ``fsd.testing.one_point_at_a_time``);
 (b) ``PBRF.self_influence`` on one point at a time (the vmapped solver with P = 1);
 (c) ``PBRF.self_influence`` on P points at once (``pbrf_scores(points_per_solve=P)``);
and prints seconds per point, the ratios (a)/(c) and (b)/(c), and the largest difference
between the scores of (a) and (c) (float32 roundoff only). Fitting the terms is not timed.
Problem: a kin8nm-sized synthetic regression (N = 6636, d = 8, Gaussian inputs, MLP
8-W-W-1 trained for a few epochs), as in ``fsd influence uci``.
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np
import torch

from fsd.testing import one_point_at_a_time
from fsd.uses import influence
from fsd_experiments.compare import mlp
from fsd_experiments.devices import device_name
from fsd_experiments.printed_report import printed_report
from fsd_experiments.stats import kmeans_labels


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--points", type=int, default=32, help="points scored (= P)")
    parser.add_argument("--steps", type=int, default=40, help="SGD steps per solve")
    parser.add_argument("--width", type=int, default=128)
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
          f"{args.threads} thread(s), device {device}, float32")

    g = torch.Generator().manual_seed(0)
    n, d = 6636, 8
    x = torch.randn(n, d, generator=g)
    y = (x[:, :1] * x[:, 1:2] + torch.sin(x[:, 2:3]) + 0.1 * torch.randn(n, 1, generator=g))
    model = mlp(d, args.width, 2, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.03)
    for _ in range(3):
        for index in torch.randperm(n, generator=g).split(128):
            optimizer.zero_grad()
            influence.pointwise_loss("squared", model(x[index]), y[index]).mean().backward()
            optimizer.step()
    model, x, y = model.to(device), x.to(device), y.to(device)
    settings = dict(damping=1e-3, steps=args.steps, lr=0.03)

    print(f"N = {n}, MLP {d}-{args.width}-{args.width}-1, {args.points} points, "
          f"{args.steps} steps per solve")
    print("\n| term | (a) loop s/pt | (b) P=1 s/pt | (c) P s/pt | (a)/(c) | (b)/(c) | "
          "largest difference (a) − (c), relative |\n|---|---:|---:|---:|---:|---:|---:|")
    for method, clusters, point_term in (("exact", None, False), ("ewc", None, True),
                                         ("bgln-d", 30, True)):
        groups = None if clusters is None else kmeans_labels(x, clusters)
        term = influence.make_term(method, model, x, y, "squared", bgln_groups=groups)
        point_term = point_term and method != "exact"
        times = {}
        _sync(device)
        start = time.perf_counter()
        baseline = one_point_at_a_time(model, term, n, x[:args.points], y[:args.points],
                                       point_term=point_term, **settings)
        _sync(device)
        times["a"] = time.perf_counter() - start
        solver = influence.PBRF(model, term, n, loss="squared", point_term=point_term,
                                **settings)
        for key, per_solve in (("b", 1), ("c", args.points)):
            start = time.perf_counter()
            scores = torch.cat([solver.self_influence(x[i:i + per_solve], y[i:i + per_solve])
                                for i in range(0, args.points, per_solve)]).cpu().numpy()
            _sync(device)
            times[key] = time.perf_counter() - start
        name = f"{method}{f' K={clusters}' if clusters else ''}{' +point' if point_term else ''}"
        error = np.abs(baseline - scores).max() / np.abs(baseline).max()
        print(f"| {name} | {times['a'] / args.points:.4f} | {times['b'] / args.points:.4f} | "
              f"{times['c'] / args.points:.4f} | {times['a'] / times['c']:.1f} | "
              f"{times['b'] / times['c']:.1f} | {error:.1e} |", flush=True)


if __name__ == "__main__":
    main()
