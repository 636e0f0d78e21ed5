"""How much of the true FSD independent gates lose, and how much gate-pattern clusters recover.

Run:  .venv/bin/python benchmarks/gate_clusters.py RUN_DIR --seed S [--tasks 1] \
          [--clusters 1,4,16,64,256] [--examples 2000] [--data-dir D] [--json F]

RUN_DIR is an ``fsd cl`` run with BGLN summaries, of an MLP or a CNN (every ReLU module's
firing counts). For the seed's final network θ and every earlier task t (reference θ_t, the
summary's), on the task's first ``--examples`` training inputs x and the summary's outputs:

- ``true``: the FSD, ½ E‖z_θ(x) − z_θt(x)‖²;
- ``laftr_data``: LAFTR on x, every input with the reference's own gates (one cluster per
  input, the limit of the columns below);
- per M in ``--clusters`` (``classes``: one cluster per class label, the paper's class-wise
  components, for comparison): x split into M clusters by k-means on the reference's gate
  patterns (every hidden ReLU's 0/1 firing on each input;
  :func:`fsd_experiments.stats.kmeans_labels`, seeded), then
  - ``bgln_s_data``: BGLN-S on x whose gates are Bernoulli with their cluster's firing
    frequencies (``fsd.BGLN(inputs="coreset", classwise=True)`` with the cluster as label);
  - ``corrected``: the corrected recursion with one Gaussian component per cluster (its
    mean, a rank-64-plus-diagonal covariance and its gate frequencies, mixed by cluster size:
    ``BGLNVariant(moments="corrected", classwise=True)``), the deterministic estimate of the
    same mixture with Gaussian inputs.

M = 1 is BGLN-S on the data and the corrected recursion as ``fsd cl`` stores them (up to the
statistics being refitted on x). The question: how many components a mixture needs before
independent gates within each stop losing the changes that the optimiser found.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import torch
from torch import nn

import fsd
from cnn_gap_chain import TrainedRun, run_arguments
from fsd.estimators.exact_fsd import ExactFSD
from fsd_experiments.ablations import BGLNVariant
from fsd_experiments.continual.runner import summary_outputs
from fsd_experiments.data import TensorBatches
from fsd_experiments.stats import kmeans_labels


def gate_patterns(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Every ReLU module's 0/1 firing on each input, concatenated: (N, units)."""
    fired: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _i, out: fired.append((out > 0).flatten(1)))
             for m in model.modules() if isinstance(m, nn.ReLU)]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(fired, dim=1).to(torch.float32)


def main() -> None:
    parser = run_arguments(__doc__)
    parser.add_argument("--clusters", default="1,4,16,64,256")
    args = parser.parse_args()
    loaded = TrainedRun.from_arguments(args)
    run, method, hp, tasks, final = (loaded.run, loaded.method, loaded.hp, loaded.tasks,
                                     loaded.final)
    machine = loaded.announce()
    rows = []
    for t in loaded.chosen:
        reference = loaded.reference(t)[1]
        x = tasks[t].x_train[:args.examples]
        outputs = summary_outputs(tasks[t], hp)
        patterns = gate_patterns(reference, x)
        with torch.no_grad():
            true = float(ExactFSD().fit(reference, x, outputs=outputs).distance(final))
            laftr = float(fsd.LAFTR(inputs="coreset", coreset_size=None).fit(
                reference, x, outputs=outputs, progress=False).distance(final))
        print(f"task {t + 1}: true {true:.4g}, LAFTR on x {laftr / true:.4g} of it", flush=True)
        for m in args.clusters.split(","):
            began = time.perf_counter()
            if m == "classes":  # the paper's class-wise components, for comparison
                labels = torch.unique(tasks[t].y_train[:args.examples], return_inverse=True)[1]
            else:
                labels = kmeans_labels(patterns, int(m), seed=args.seed)
            labels = torch.unique(labels, return_inverse=True)[1]  # an emptied cluster: gone
            many = int(labels.max()) > 0
            data = TensorBatches(x, labels, 500)
            with torch.no_grad():
                sampled = fsd.BGLN(inputs="coreset", coreset_size=None, classwise=many).fit(
                    reference, data, outputs=outputs, progress=False)
                draws = []
                for c in range(args.mc_calls):
                    torch.manual_seed(1000 + c)
                    draws.append(float(sampled.distance(final)))
                values = torch.tensor(draws, dtype=torch.float64)
                corrected = float(BGLNVariant(
                    moments="corrected", covariance="lowrank", rank=64,
                    classwise=many).fit(reference, data, outputs=outputs,
                                         progress=False).distance(final))
            row = {"run": run.name, "method": method, "fsd_scale": hp.fsd_scale,
                   "seed": args.seed, "task": t + 1, "after_task": loaded.trained,
                   "clusters": "classes" if m == "classes" else int(labels.max()) + 1,
                   "true": true, "laftr_data": laftr,
                   "bgln_s_data": float(values.mean()),
                   "bgln_s_data_standard_error": float(values.std() / len(draws) ** 0.5),
                   "corrected": corrected, "seconds": time.perf_counter() - began}
            print(json.dumps(row), flush=True)
            rows.append(row)
    if args.json:
        path = Path(args.json)
        existing = json.loads(path.read_text()) if path.exists() else {
            "machine": machine, "note": args.note, "examples": args.examples,
            "mc_calls": args.mc_calls, "rows": []}
        done = {(r["run"], r["seed"], r["task"], r["clusters"]) for r in rows}
        existing["rows"] = [r for r in existing["rows"] if
                            (r["run"], r["seed"], r["task"], r["clusters"]) not in done] + rows
        path.write_text(json.dumps(existing, indent=1) + "\n")


if __name__ == "__main__":
    main()
