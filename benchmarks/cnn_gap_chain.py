"""Where a BGLN estimate loses the true FSD on a trained network: the chain of approximations.

Run:  .venv/bin/python benchmarks/cnn_gap_chain.py RUN_DIR --seed S [--tasks 1,2] \
          [--examples 2000] [--data-dir D] [--json F]

RUN_DIR is an ``fsd cl`` run with BGLN summaries: the CNN's (``--model cnn``,
``bgln-d-corrected``) or an MLP's (then the fired-routing columns are ``null``). For the
seed's final network θ and every earlier task t (reference θ_t, the summary's), on the
task's first ``--examples`` training inputs x and the summary's outputs, one column per step
from the truth to the stored summary, each refitted at θ_t on x unless it says "stored":

- ``true``: the FSD, ½ E‖z_θ(x) − z_θt(x)‖²;
- ``laftr_data``: LAFTR on x (the reference's own gates and max-pool argmax): the
  linearization in the activations alone;
- ``bgln_s_data``: BGLN-S on x: Bernoulli gates with the firing frequencies on x, each
  max-pool routed by the argmax of the gated reference activation;
- ``bgln_s_gaussian``: BGLN-S with Gaussian inputs (x's mean and rank-64-plus-diagonal
  covariance): the paper's BGLN-S;
- ``bgln_random_routing``: the corrected recursion (:mod:`fsd.moments.corrected_conv`),
  exact moments of the BGLN whose max-pool windows route by independent draws with E = π;
- ``bgln_fired_routing``: a Monte-Carlo mean of the BGLN in which a ReLU followed by a
  max-pool is replaced by one draw per window: position p with probability
  P(p is the window's argmax and the pooled value is > 0), no position (output 0) otherwise,
  the ReLU itself not gated (exact for a single input, as ReLU and max commute);
- ``corrected_fired``: the corrected recursion on that BGLN
  (``BGLNVariant(pool_routing="fired")``); both fired columns are ``null`` for a network
  without max-pools, where ``bgln_random_routing`` is then the corrected recursion itself;
- ``stored``: the stored summary's estimate, the penalty the run trained against (its
  statistics are the last epoch's running means, taken with dropout on).

Each Monte-Carlo column is the mean of ``--mc-calls`` calls of ``--mc-samples`` samples,
with its standard error.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

import fsd
from corrected_conv import sampled_bgln
from fsd.estimators.base import Estimator, load
from fsd.estimators.exact_fsd import ExactFSD
from fsd.model.rules import routing_statistics
from fsd_experiments.ablations import BGLNVariant
from fsd_experiments.benchmarks import Task, make_tasks
from fsd_experiments.continual.reporting import _gap_checkpoint, _run_settings
from fsd_experiments.continual.runner import build_model, checked_matrix, summary_outputs
from fsd_experiments.continual.settings import Hyperparameters


def run_arguments(doc: str | None) -> argparse.ArgumentParser:
    """The arguments of a study of one trained run (RUN, --seed, --tasks, --examples and more)."""
    parser = argparse.ArgumentParser(description=(doc or "").split("\n")[0])
    parser.add_argument("run")
    parser.add_argument("--seed", type=int, required=True)
    parser.add_argument("--tasks", default=None, help="earlier tasks, 1-based (default: all)")
    parser.add_argument("--examples", type=int, default=2000)
    parser.add_argument("--mc-calls", type=int, default=6)
    parser.add_argument("--data-dir", default=os.environ.get("FSD_DATA_DIR"))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--json", default=None, help="append the rows to this JSON file")
    parser.add_argument("--note", default="", help="what else ran on the machine (for --json)")
    return parser


@dataclass
class TrainedRun:
    """A seed of an ``fsd cl`` run read back: its final network and the earlier tasks' summaries."""

    run: Path
    seed: int
    method: str
    hp: Hyperparameters
    tasks: list[Task]
    final: nn.Sequential
    trained: int  # tasks trained
    chosen: list[int]  # the earlier tasks to read (0-based)
    outputs: int

    @classmethod
    def load(cls, run: Path, seed: int, data_dir: str | None, tasks: str | None
             ) -> TrainedRun:
        """The run's final network for ``seed``; ``tasks`` "1,2" (1-based) or all earlier ones."""
        benchmark, method, hp, _ = _run_settings(run)
        ckpt = run / "checkpoints" / f"seed{seed}"
        state = _gap_checkpoint(ckpt)
        stream, outputs = make_tasks(benchmark, data_dir, seed, train_subset=hp.train_subset,
                                     test_subset=hp.test_subset, num_tasks=hp.tasks,
                                     validation=hp.validation)
        final = build_model(hp, stream[0].x_train.shape[1:], outputs).eval()
        final.load_state_dict(state["model"])
        trained = len(checked_matrix(state, ckpt / "state.pt", len(stream)))
        chosen = ([int(t) - 1 for t in tasks.split(",")] if tasks
                  else list(range(trained - 1)))
        return cls(run, seed, method, hp, stream, final, trained, chosen, outputs)

    @classmethod
    def from_arguments(cls, args: argparse.Namespace) -> TrainedRun:
        """:meth:`load` from :func:`run_arguments`' parsed arguments (and their threads)."""
        torch.set_num_threads(args.threads)
        return cls.load(Path(args.run), args.seed, args.data_dir, args.tasks)

    def reference(self, task: int) -> tuple[Estimator, nn.Sequential]:
        """Task ``task``'s (0-based) stored summary and its reference network θ_t."""
        summary = load(self.run / "checkpoints" / f"seed{self.seed}" / f"task{task}.fsd")
        reference = build_model(self.hp, self.tasks[0].x_train.shape[1:], self.outputs).eval()
        reference.load_state_dict(summary.reference_state_dict())
        return summary, reference

    def announce(self) -> str:
        """Print and return the machine line with the run read."""
        machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
                   f"{torch.get_num_threads()} thread(s)")
        print(f"# {machine}; {self.run.name} seed {self.seed}, after task {self.trained}")
        return machine


def fired_routing(model: nn.Sequential, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per max-pool that follows a ReLU (by index): P(argmax = p and pooled value > 0)."""
    layers = list(model.children())
    joint: dict[int, torch.Tensor] = {}
    with torch.no_grad():
        a = x
        for i, layer in enumerate(layers):
            before, a = a, layer(a)
            if isinstance(layer, nn.MaxPool2d) and i and isinstance(layers[i - 1], nn.ReLU):
                fired = (a > 0).to(torch.float64).unsqueeze(-1)
                joint[i] = (routing_statistics(layer, before) * fired).mean(0).float()
    return joint


def _mc(draw, calls: int) -> tuple[float, float]:
    values = torch.tensor([draw(c) for c in range(calls)], dtype=torch.float64)
    return float(values.mean()), float(values.std() / calls ** 0.5)


def main() -> None:
    parser = run_arguments(__doc__)
    parser.add_argument("--mc-samples", type=int, default=512)
    args = parser.parse_args()
    loaded = TrainedRun.from_arguments(args)
    run, method, hp, tasks, final, trained = (loaded.run, loaded.method, loaded.hp, loaded.tasks,
                                              loaded.final, loaded.trained)
    machine = loaded.announce()
    rows = []
    for t in loaded.chosen:
        began = time.perf_counter()
        summary, reference = loaded.reference(t)
        x = tasks[t].x_train[:args.examples]
        outputs = summary_outputs(tasks[t], hp)
        common = dict(covariance="lowrank", rank=64)
        with torch.no_grad():
            row = {"run": run.name, "method": method, "fsd_scale": hp.fsd_scale,
                   "seed": args.seed, "task": t + 1, "after_task": trained,
                   "true": float(ExactFSD().fit(reference, x, outputs=outputs).distance(final)),
                   "stored": float(summary.distance(final))}
            laftr = fsd.LAFTR(inputs="coreset", coreset_size=None).fit(
                reference, x, outputs=outputs, progress=False)
            row["laftr_data"] = float(laftr.distance(final))
            for name, estimator in (
                    ("bgln_s_data", fsd.BGLN(inputs="coreset", coreset_size=None)),
                    ("bgln_s_gaussian", fsd.BGLN(num_samples=args.mc_samples, **common))):
                estimator.fit(reference, x, outputs=outputs, progress=False)
                def draw(c, e=estimator):
                    torch.manual_seed(1000 + c)
                    return float(e.distance(final))
                row[name], row[name + "_standard_error"] = _mc(draw, args.mc_calls)
            corrected = BGLNVariant(moments="corrected", **common).fit(
                reference, x, outputs=outputs, progress=False)
            row["bgln_random_routing"] = float(corrected.distance(final))
            if any(isinstance(m, nn.MaxPool2d) for m in reference.modules()):
                row["corrected_fired"] = float(BGLNVariant(
                    moments="corrected", pool_routing="fired", **common).fit(
                    reference, x, outputs=outputs, progress=False).distance(final))
                joint = fired_routing(reference, x)
                generator = torch.Generator().manual_seed(0)
                def fired(c, e=corrected, m0=reference, pi=joint, k=outputs, g=generator):
                    return sampled_bgln(e, m0, final, k, args.mc_samples, g, fired=pi)
                row["bgln_fired_routing"], row["bgln_fired_routing_standard_error"] = _mc(
                    fired, args.mc_calls)
            else:  # no max-pool (--model cnn-avgpool): nothing is routed
                row["corrected_fired"] = row["bgln_fired_routing"] = None
        row["seconds"] = time.perf_counter() - began
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.json:
        existing = json.loads(Path(args.json).read_text()) if Path(args.json).exists() else {
            "machine": machine, "note": args.note, "examples": args.examples,
            "mc_calls": args.mc_calls, "mc_samples": args.mc_samples, "rows": []}
        existing["rows"] = [r for r in existing["rows"]
                            if (r["run"], r["seed"], r["task"]) not in
                            {(q["run"], q["seed"], q["task"]) for q in rows}] + rows
        Path(args.json).write_text(json.dumps(existing, indent=1) + "\n")


if __name__ == "__main__":
    main()
