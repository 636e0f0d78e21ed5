"""Whole ``fsd cl`` runs timed side by side: the corrected BGLN-D against OSLA and fine-tuning.

Run:  .venv/bin/python benchmarks/cl_run.py [--methods finetune,osla,bgln-d-corrected]
      [--repeats 1] [--baseline OTHER/src] [--epochs 2] [--seed 20] [--data-dir D]
      [--json PATH] [--note TEXT]

Each run is one ``fsd cl --benchmark split-mnist --seeds SEED --epochs E --threads 1
--no-progress --no-plots --method M`` in a fresh process (what a user runs), into a fresh
folder. The methods are interleaved, and with ``--baseline`` (another checkout's ``src``, put
first on ``PYTHONPATH``) the baseline's run of each method goes right before this checkout's,
so that both see the same load; all of it ``--repeats`` times. Per run: the process's wall
time and CPU time (user + system: moved less by other work on the machine), the training wall
time of results.json, the average accuracy and the backward transfer;
then, per checkout, the median wall times and the ratios of ``bgln-d-corrected`` to ``osla``
and to ``finetune`` (the goals: ≤ 1 and ≤ 3 at an average accuracy ≥ 99.4), and whether
the baseline's and this checkout's accuracy matrices agree to the bit. ``bgln-d-exact``
(exact moments, several times slower) can be added to ``--methods`` as the reference.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from fsd_experiments.devices import cpu_name

HERE = str(Path(__file__).resolve().parents[1] / "src")


def one_run(src: str, method: str, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    """One ``fsd cl`` run of ``method`` with the ``fsd`` of ``src``: times and results."""
    out = folder / f"{method}-{len(list(folder.iterdir()))}"
    command = [sys.executable, "-m", "fsd_experiments", "cl", "--benchmark", "split-mnist",
               "--seeds", str(args.seed), "--epochs", str(args.epochs), "--threads", "1",
               "--no-progress", "--no-plots", "--method", method, "--out", str(out)]
    if args.data_dir:
        command += ["--data-dir", args.data_dir]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [src, *filter(None, [os.environ.get("PYTHONPATH")])])}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds (user + system): less moved than wall time by what else runs on the machine
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    results = json.loads((out / "results.json").read_text())
    return {"method": method, "src": src, "process_s": round(wall, 2), "cpu_s": round(cpu, 2),
            "training_s": round(float(results["wall_seconds"]["total"]), 2),
            "avg_accuracy": results["avg_accuracy"]["mean"],
            "backward_transfer": results["backward_transfer"]["mean"],
            "matrix": results["accuracy_matrix"]}


def summary(runs: list[dict[str, Any]], src: str, methods: list[str]) -> dict[str, Any]:
    """Median times per method of one checkout, and the corrected method's ratios."""
    medians = {m: {key: statistics.median(r[key] for r in runs
                                          if r["src"] == src and r["method"] == m)
                   for key in ("process_s", "cpu_s", "training_s")} for m in methods}
    ratios: dict[str, float] = {}
    if "bgln-d-corrected" in medians:
        for other in ("osla", "finetune"):
            if other in medians:
                for key in ("process_s", "cpu_s", "training_s"):
                    ratios[f"corrected/{other} ({key})"] = round(
                        medians["bgln-d-corrected"][key] / medians[other][key], 3)
    return {"medians": medians, "ratios": ratios}


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--methods", default="finetune,osla,bgln-d-corrected")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--baseline", default=None, help="another checkout's src folder")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=20)
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--json", default=None, help="also write the runs to this JSON file")
    parser.add_argument("--note", default="", help="what else ran on the machine (for --json)")
    args = parser.parse_args()
    methods = args.methods.split(",")
    sources = [*([args.baseline] if args.baseline else []), HERE]
    machine = (f"{cpu_name()}, {platform.machine()}, {os.cpu_count()} cores, "
               f"torch {torch.__version__}, fsd cl --threads 1")
    print(f"# {machine}")
    runs: list[dict[str, Any]] = []
    folder = Path(tempfile.mkdtemp(prefix="cl_run_"))
    try:
        for repeat in range(args.repeats):
            for method in methods:
                for src in sources:
                    row = one_run(src, method, args, folder)
                    runs.append(row)
                    label = "baseline" if src != HERE else "this"
                    print(f"{repeat} {method:18s} {label:8s} process {row['process_s']:7.1f} s  "
                          f"CPU {row['cpu_s']:7.1f} s  training {row['training_s']:7.1f} s  "
                          f"avg {row['avg_accuracy']:.2f}  BWT {row['backward_transfer']:.2f}",
                          flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    report: dict[str, Any] = {
        "command": "python benchmarks/cl_run.py " + " ".join(sys.argv[1:]),
        "machine": machine, "note": args.note, "runs": runs,
        "this": summary(runs, HERE, methods)}
    if args.baseline:
        report["baseline"] = summary(runs, args.baseline, methods)
        report["bit_identical"] = {
            m: all(a["matrix"] == b["matrix"]
                   for a, b in zip([r for r in runs if r["src"] == args.baseline
                                    and r["method"] == m],
                                   [r for r in runs if r["src"] == HERE and r["method"] == m],
                                   strict=True))
            for m in methods}
    for name in ("baseline", "this"):
        if name in report:
            print(f"{name}: {json.dumps(report[name])}")
    if "bit_identical" in report:
        print(f"accuracy matrices equal to the bit: {json.dumps(report['bit_identical'])}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
