"""BGLN-D with exact moments on a residual MLP, beside the chain recursion on a plain one.

Run:  .venv/bin/python benchmarks/graph_moments.py [--threads 1] [--repeats 5] [--width 256]

Models (float32, at initialisation, MNIST-sized: 784 inputs, 10 outputs): the plain MLP
784-W-W-10 of the paper's Split MNIST, and the same with a skip connection around the second
hidden layer (h ← h + ReLU(W2 h)). Inputs: 2,000 random 784-vectors with a rank-64
covariance plus noise (the cost depends on the shapes, not the values). Prints, side by side
in one process, medians of distance + backward for BGLN-D with exact moments:

- the plain MLP through the chain recursion (:mod:`fsd.moments.exact`, what ``fit`` picks);
- the same plain MLP through the graph walk (:mod:`fsd.moments.exact_graph`) — the same number,
  to show what the general walk costs;
- the residual MLP (graph walk; the chain recursion cannot take it);

each with a low-rank (r = 32) input covariance, one component and ten (class-wise), and peak
memory of one call beyond what was allocated before it.
"""

from __future__ import annotations

import argparse
import os
import platform

import torch
from torch import nn

import fsd
from conv_moments import peak_mib
from fsd.model.signature import model_state
from fsd.moments.exact_graph import graph_plan, graph_second_moment
from fsd_experiments.printed_report import printed_report
from penalty import median_ms, perturbed


class ResidualMLP(nn.Module):
    """784 → W → (+ ReLU(W → W)) → 10."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(784, width), nn.Linear(width, width), \
            nn.Linear(width, 10)
        self.act1, self.act2 = nn.ReLU(), nn.ReLU()

    def forward(self, x):
        h = self.act1(self.inp(x))
        return self.out(h + self.act2(self.hidden(h)))


def _inputs(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    basis = torch.randn(784, 64, generator=g) / 8
    x = torch.randn(n, 64, generator=g) @ basis.T + 0.3 * torch.randn(n, 784, generator=g)
    return x, torch.randint(0, 10, (n,), generator=g)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--out", default=None,
                        help="also write what is printed to OUT.md and its tables to OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with printed_report(args.out):
        run(args, torch.device("cpu"))


def run(args: argparse.Namespace, device: torch.device) -> None:
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), width {args.width}")
    torch.manual_seed(0)
    w = args.width
    plain = nn.Sequential(nn.Linear(784, w), nn.ReLU(), nn.Linear(w, w), nn.ReLU(),
                          nn.Linear(w, 10)).eval()
    torch.manual_seed(0)
    residual = ResidualMLP(w).eval()
    x, y = _inputs(2000, 2)
    rows = []
    for classwise in (False, True):
        groups = "10 components" if classwise else "1 component"
        options = dict(deterministic=True, moments="exact", covariance="lowrank", rank=32,
                       classwise=classwise)
        chain = fsd.BGLN(**options).fit(plain, [(x, y)], progress=False)
        moved_plain = perturbed(plain, 1e-2, seed=1)
        plan = graph_plan(plain, chain.reference_state(), 784, torch.float32)

        def chain_call(e=chain, m=moved_plain) -> None:
            e.distance(m).backward()

        def walk_call(e=chain, m=moved_plain, p=plan) -> None:
            per_group = 0.5 * graph_second_moment(
                p, m, e.reference_state(), model_state(m), e._state["input.mean"],
                e.input_covariance(), e._gate_means(), torch.eye(10))
            (e._state["weights"] * per_group).sum().backward()

        graph = fsd.BGLN(**options).fit(residual, [(x, y)], progress=False)
        moved_residual = perturbed(residual, 1e-2, seed=1)

        def residual_call(e=graph, m=moved_residual) -> None:
            e.distance(m).backward()

        for name, call in ((f"plain MLP, chain recursion, {groups}", chain_call),
                           (f"plain MLP, graph walk, {groups}", walk_call),
                           (f"residual MLP, graph walk, {groups}", residual_call)):
            rows.append((name, median_ms(call, args.repeats, warmup=1), peak_mib(call, device)))
    print("\n| call | ms (median) | peak MiB |\n|---|---:|---:|")
    for name, ms, peak in rows:
        print(f"| {name} | {ms:,.1f} | {peak:,.1f} |")


if __name__ == "__main__":
    main()
