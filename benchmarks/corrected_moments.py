"""Penalty cost of the corrected BGLN-D moments next to Algorithm 2 and exact moments.

Run:  .venv/bin/python benchmarks/corrected_moments.py [--data-dir D] [--threads 1]

MLP 784-W-W-10 (W = 256, 512), K = 1 and 9 previous tasks' summaries (each fitted at its own
perturbed reference on real MNIST moments, low-rank r = 64 covariance as ``fsd cl`` stores
them), penalty = fsd.combine(summaries).distance + backward, medians in ms. Algorithm 2 and
exact moments are batched by fsd.combine; the corrected prototype
(fsd.moments.corrected) is evaluated summary by summary. The three are timed interleaved,
three rounds, in one process, so drifting load from other jobs hits them alike. The last
column is the corrected estimate's |est/exact − 1| over the K summaries at the timed θ.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics

import torch

import fsd
from fsd.estimators.variants import BGLNVariant
from fsd_experiments.compare import mlp
from fsd_experiments.data import TensorBatches
from penalty import load_inputs, median_ms, perturbed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--examples", type=int, default=12_000)
    parser.add_argument("--widths", default="256,512")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x, y, source = load_inputs(args.data_dir)
    fit_data = TensorBatches(x[:args.examples], y[:args.examples], 2000)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); inputs: {source}")
    print("| width | K | Algorithm 2: ms | exact: ms | corrected: ms | exact / Alg. 2 | "
          "corrected / Alg. 2 | corrected vs exact: max |est/exact − 1| |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    rounds = 3
    for width in (int(w) for w in args.widths.split(",")):
        torch.manual_seed(0)
        model = mlp(784, width, 2, 10)
        moved = perturbed(model, 0.01, 1)
        kwargs = {"covariance": "lowrank", "rank": 64}
        references = [perturbed(model, 0.02, 10 + k) for k in range(9)]
        summaries = {
            "paper": [fsd.BGLN(deterministic=True, **kwargs).fit(r, fit_data)
                      for r in references],
            "exact": [fsd.BGLN(deterministic=True, moments="exact", **kwargs).fit(r, fit_data)
                      for r in references],
            "corrected": [BGLNVariant(moments="corrected", **kwargs).fit(r, fit_data)
                          for r in references]}
        with torch.no_grad():
            ratios = [float(c.distance(moved) / e.distance(moved))
                      for c, e in zip(summaries["corrected"], summaries["exact"], strict=True)]

        def penalty(summary_set: fsd.Estimator, moved: torch.nn.Module = moved) -> None:
            moved.zero_grad()
            summary_set.distance(moved).backward()

        times: dict[tuple[str, int], list[float]] = {(m, k): [] for m in summaries
                                                     for k in (1, 9)}
        repeats = max(1, args.repeats // rounds)
        for _ in range(rounds):
            for m in summaries:
                for k in (1, 9):
                    summary_set = fsd.combine(summaries[m][:k])
                    times[m, k].append(median_ms(lambda s=summary_set: penalty(s), repeats))
        for k in (1, 9):
            t = {m: statistics.median(times[m, k]) for m in summaries}
            error = max(abs(r - 1) for r in ratios[:k])
            print(f"| {width} | {k} | {t['paper']:.2f} | {t['exact']:.2f} | "
                  f"{t['corrected']:.2f} | {t['exact'] / t['paper']:.1f}x | "
                  f"{t['corrected'] / t['paper']:.1f}x | {error:.2e} |", flush=True)


if __name__ == "__main__":
    main()
