"""Penalty cost of the corrected BGLN-D moments next to Algorithm 2 and exact moments.

Run:  .venv/bin/python benchmarks/corrected_moments.py [--data-dir D] [--threads 1]

MLP 784-W-W-10 (W = 256, 512), K = 1 and 9 previous tasks' summaries (each fitted at its own
perturbed reference on real MNIST moments, low-rank r = 64 covariance as ``fsd cl`` stores
them), penalty = fsd.combine(summaries).distance + backward, medians in ms. Algorithm 2 and
exact moments are batched by fsd.combine, and so is the corrected recursion
(fsd.moments.corrected), with the whole covariance and with the gates' injections sized
from its top ``--injection-rank`` directions plus the diagonal. The corrected recursion is
differentiated by its hand-written reverse pass (the default); the two "autograd" columns
time the same summaries with autograd recording the forward pass instead
(``adjoint=False``), and the two "one by one" columns the sum of the K summaries' own
distances (what fsd.combine did before it stacked them), for the gains. All eight are timed
interleaved, three rounds, in one process, so drifting load from other jobs hits them alike.
The last columns are the corrected estimates' |est/exact − 1| over the K summaries at the
timed θ. The table is the docs' (:func:`fsd_experiments.result_tables.penalty_timing_table`),
printed a line at a time from the rows ``--json`` writes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from functools import partial
from unittest import mock

import torch

import fsd
from fsd.moments import corrected
from fsd_experiments.ablations import BGLNVariant
from fsd_experiments.compare import mlp
from fsd_experiments.data import TensorBatches
from fsd_experiments.result_tables import penalty_timing_header, penalty_timing_row
from penalty import load_inputs, median_ms, perturbed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--examples", type=int, default=12_000)
    parser.add_argument("--widths", default="256,512")
    parser.add_argument("--injection-rank", type=int, default=8)
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--note", default="", help="what else ran on the machine (for --json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    x, y, source = load_inputs(args.data_dir)
    fit_data = TensorBatches(x[:args.examples], y[:args.examples], 2000)
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s); inputs: {source}")
    # the docs' table, a line per (width, K) as it is measured
    print(penalty_timing_header(args.injection_rank), flush=True)
    rows: list[dict] = []
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
                          for r in references],
            "injections": [BGLNVariant(moments="corrected", injection_rank=args.injection_rank,
                                       **kwargs).fit(r, fit_data) for r in references]}
        with torch.no_grad():
            ratios = {m: [float(c.distance(moved) / e.distance(moved))
                          for c, e in zip(summaries[m], summaries["exact"], strict=True)]
                      for m in ("corrected", "injections")}

        def penalty(summary_set: fsd.SummarySet, moved: torch.nn.Module = moved,
                    adjoint: bool = True, stacked: bool = True) -> None:
            moved.zero_grad()
            if not stacked:
                sum(s.distance(moved) for s in summary_set).backward()
                return
            if adjoint:
                summary_set.distance(moved).backward()
                return
            autograd = partial(corrected.corrected_second_moment, adjoint=False)
            with mock.patch.object(corrected, "corrected_second_moment", autograd):
                summary_set.distance(moved).backward()

        timed = [*summaries, "corrected_autograd", "injections_autograd",
                 "corrected_one_by_one", "injections_one_by_one"]
        times: dict[tuple[str, int], list[float]] = {(m, k): [] for m in timed for k in (1, 9)}
        repeats = max(1, args.repeats // rounds)
        for _ in range(rounds):
            for m in timed:
                for k in (1, 9):
                    base = m.removesuffix("_autograd").removesuffix("_one_by_one")
                    summary_set = fsd.combine(summaries[base][:k])
                    adjoint, stacked = not m.endswith("_autograd"), not m.endswith("_one_by_one")
                    times[m, k].append(median_ms(
                        lambda s=summary_set, a=adjoint, b=stacked: penalty(s, adjoint=a,
                                                                            stacked=b),
                        repeats))
        for k in (1, 9):
            t = {m: statistics.median(times[m, k]) for m in timed}
            error = {m: max(abs(r - 1) for r in ratios[m][:k]) for m in ratios}
            row = {"width": width, "K": k, **{f"{m}_ms": round(t[m], 3) for m in t},
                   **{f"{m}_max_error": float(f"{error[m]:.3g}") for m in error}}
            rows.append(row)
            print(penalty_timing_row(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": "python benchmarks/corrected_moments.py --data-dir DATA_DIR "
                                  f"--threads {args.threads} --injection-rank "
                                  f"{args.injection_rank}",
                       "date": time.strftime("%Y-%m-%d"),
                       "machine": f"{platform.machine()}, {os.cpu_count()} cores",
                       "note": args.note, "covariance": "lowrank r=64", "outputs": 10,
                       "fit_examples": args.examples,
                       "torch": torch.__version__, "threads": torch.get_num_threads(),
                       "inputs": source, "injection_rank": args.injection_rank, "rows": rows},
                      f, indent=1)


if __name__ == "__main__":
    main()
