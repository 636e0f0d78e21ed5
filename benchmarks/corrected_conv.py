"""Penalty cost and value of the corrected recursion on CNNs, beside Algorithm 2 and BGLN-S.

Run:  .venv/bin/python benchmarks/corrected_conv.py [--threads 1] [--repeats 5] [--json F]

Two CNNs at initialisation, float32, each with a reference θ0 and a perturbed θ (noise 0.01
on every parameter): the paper's Split CIFAR-100 CNN (``cifar_cnn``, 60 logits, inputs
3×32×32) and the Split Fashion-MNIST CNN (``conv_net`` on 1×28×28, 10 logits). Inputs: 2,000
random images with a rank-64 covariance plus noise (the cost depends on the shapes, not the
values). Summaries over the first head (10 logits), a low-rank r = 64 input covariance plus its
diagonal (as ``fsd cl`` stores them):

- BGLN-D, Algorithm 2 (:mod:`fsd.moments.algorithm2_conv`);
- the corrected recursion (:mod:`fsd.moments.corrected_conv`), with the whole covariance and
  with the injections sized from its top ``--injection-rank`` directions;
- the mean-gate network alone (the corrected recursion without its injections);
- the corrected recursion with each ReLU → max-pool pair as one draw per window
  (``pool_routing="fired"``, :func:`fsd.model.rules.fired_routing_statistics`).

Penalty = ``distance`` + backward, medians in ms of ``--repeats`` calls, the estimators
interleaved over three rounds in one process so that drifting load hits them alike. Value:
each estimate divided by two Monte-Carlo means, each of ``--mc-calls`` calls of
``--mc-samples`` samples, with their standard errors:

- BGLN-S (``fsd.BGLN()``), whose max-pools route by the argmax of each sampled reference
  activation (LAFTR's linearization), with Bernoulli gates;
- the BGLN the corrected recursion computes, sampled directly (:func:`sampled_bgln`): the same
  gates, and every max-pool window routed by an independent one-hot draw with E = π.

The first ratio compares with BGLN-S; the second isolates the recursion's approximation from
the difference in how the two models route. The last column is each estimate over the true FSD,
½ E‖z_θ(x) − z_θ0(x)‖² on the head over the 2,000 inputs the summaries were fitted on.
The table, printed once both CNNs are measured, is the docs'
(:func:`fsd_experiments.result_tables.corrected_conv_table`, from the rows ``--json`` writes);
each CNN's Monte-Carlo means and standard errors are printed as it finishes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch
import torch.nn.functional as F
from torch import nn

import fsd
from fsd_experiments.ablations import BGLNVariant
from fsd_experiments.models import cifar_cnn, conv_net
from fsd_experiments.result_tables import corrected_conv_table
from penalty import median_ms, perturbed


def _images(n: int, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = 1
    for size in shape:
        d *= size
    basis = torch.randn(d, 64, generator=g) / 8
    return (torch.randn(n, 64, generator=g) @ basis.T
            + 0.3 * torch.randn(n, d, generator=g)).view(n, *shape)


def _routed(pool: nn.MaxPool2d, v: torch.Tensor, pick: torch.Tensor) -> torch.Tensor:
    """Each window of ``v`` (n, C, H, W) routed to its drawn position ``pick`` (n, C, H', W', 1)."""
    samples, channels, out_h, out_w = pick.shape[:4]
    cols = F.unfold(v.flatten(0, 1).unsqueeze(1), pool.kernel_size, stride=pool.stride)
    cols = cols.view(samples, channels, -1, out_h, out_w)
    return cols.permute(0, 1, 3, 4, 2).gather(-1, pick).squeeze(-1)


def sampled_bgln(summary: fsd.BGLN, model0: nn.Sequential, model1: nn.Sequential,
                 outputs: list[int] | None, samples: int, generator: torch.Generator,
                 fired: dict[int, torch.Tensor] | None = None) -> float:
    """One Monte-Carlo estimate of E[½‖PΔz‖²] of BGLN with independently routed max-pools.

    Reads a fitted summary's Gaussian input moments (low rank plus diagonal), firing
    frequencies and routing frequencies; walks a flat ``nn.Sequential`` of Conv2d, Linear, ReLU,
    MaxPool2d, Flatten and Dropout (evaluation), the differences propagated directly, over the
    ``outputs`` (``None``: all). With ``fired`` (by the index of a max-pool that follows a ReLU,
    its P(argmax = p and maximum > 0)), that ReLU is not gated and the pool draws position p with
    that probability, no position (output 0) otherwise: the fired-pools BGLN.
    """
    fired = fired or {}
    moments = summary._moment_summary(summary.reference_state())
    factor, residual = moments.covariance  # (1, d, r), (1, d)
    mean = moments.mean[0]
    z = torch.randn(samples, factor.shape[-1], generator=generator)
    noise = torch.randn(samples, mean.shape[0], generator=generator)
    x = mean + z @ factor[0].T + noise * residual[0].clamp_min(0).sqrt()
    a0 = x.view(samples, *moments.input_shape)
    da: torch.Tensor | None = None
    layers = zip(model0.named_children(), model1.children(), strict=True)
    for index, ((path, m0), m1) in enumerate(layers):
        if isinstance(m0, (nn.Conv2d, nn.Linear)):
            assert isinstance(m1, type(m0))
            def op(v, w, b, m=m0):
                if isinstance(m, nn.Conv2d):
                    return F.conv2d(v, w, b, m.stride, m.padding, m.dilation, m.groups)
                return F.linear(v, w, b)
            step = op(a0, m1.weight - m0.weight, m1.bias - m0.bias)
            da = step if da is None else step + op(da, m1.weight, None)
            a0 = op(a0, m0.weight, m0.bias)
        elif isinstance(m0, nn.ReLU):
            if index + 1 in fired:
                continue  # gated by the pool's draw
            mu = moments.gate_means[path][0]
            gate = torch.bernoulli(mu.expand_as(a0).float(), generator=generator)
            a0 = gate * a0
            da = None if da is None else gate * da
        elif isinstance(m0, nn.MaxPool2d):
            pi = fired[index] if index in fired else moments.routing[path][0].float()
            channels, out_h, out_w, window = pi.shape  # (C, H', W', k·k)
            u = torch.rand(samples, channels, out_h, out_w, 1, generator=generator)
            pick = (u > pi.cumsum(-1)).sum(-1, keepdim=True)
            kept = (pick < window).squeeze(-1).float()  # past the last position: no output
            pick = pick.clamp_max(window - 1)
            a0 = _routed(m0, a0, pick) * kept
            da = None if da is None else _routed(m0, da, pick) * kept
        elif isinstance(m0, nn.Flatten):
            a0 = a0.flatten(1)
            da = None if da is None else da.flatten(1)
        elif not isinstance(m0, nn.Dropout):
            raise TypeError(f"sampled_bgln does not walk {type(m0).__name__}")
    assert da is not None
    chosen = da if outputs is None else da[:, outputs]
    return float(0.5 * chosen.detach().pow(2).sum(-1).mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--injection-rank", type=int, default=8)
    parser.add_argument("--mc-calls", type=int, default=20)
    parser.add_argument("--mc-samples", type=int, default=512)
    parser.add_argument("--models", default="cifar,fashion")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    parser.add_argument("--note", default="", help="what else ran on the machine (for --json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    machine = (f"{platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"{torch.get_num_threads()} thread(s)")
    print(f"# {machine}")
    rank = args.injection_rank
    names = ["Algorithm 2", "corrected", f"corrected, injection rank {rank}", "mean-gate network",
             "corrected, fired pools"]
    rows: list[dict] = []
    for which in args.models.split(","):
        torch.manual_seed(0)
        if which == "cifar":
            model, shape = cifar_cnn(heads=6).eval(), (3, 32, 32)
        else:
            model, shape = conv_net((1, 28, 28), 10).eval(), (1, 28, 28)
        moved = perturbed(model, 1e-2, seed=1)
        data = _images(2000, shape, 2)
        common = dict(covariance="lowrank", rank=64)
        estimators = {
            names[0]: fsd.BGLN(deterministic=True, **common),
            names[1]: BGLNVariant(moments="corrected", **common),
            names[2]: BGLNVariant(moments="corrected", injection_rank=rank, **common),
            names[3]: BGLNVariant(moments="no-gate-variance", **common),
            names[4]: BGLNVariant(moments="corrected", pool_routing="fired", **common),
        }
        for estimator in estimators.values():
            estimator.fit(model, data, outputs=range(10), progress=False)
        sampled = fsd.BGLN(num_samples=args.mc_samples, seed=0, **common).fit(
            model, data, outputs=range(10), progress=False)
        with torch.no_grad():
            draws = torch.stack([sampled.distance(moved) for _ in range(args.mc_calls)])
        mc_mean = float(draws.mean())
        mc_error = float(draws.std() / args.mc_calls ** 0.5)
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            routed = torch.tensor([sampled_bgln(estimators[names[1]], model, moved, list(range(10)),
                                                args.mc_samples, g)
                                   for _ in range(args.mc_calls)])
        routed_mean = float(routed.mean())
        with torch.no_grad():
            true_fsd = float(0.5 * (moved(data)[:, :10] - model(data)[:, :10]).pow(2).sum(-1)
                             .mean())
        routed_error = float(routed.std() / args.mc_calls ** 0.5)
        times: dict[str, list[float]] = {name: [] for name in estimators}
        for _ in range(3):
            for name, estimator in estimators.items():
                def call(e=estimator, m=moved) -> None:
                    e.distance(m).backward()
                times[name].append(median_ms(call, args.repeats, warmup=1))
        base = statistics.median(times[names[0]])
        for name, estimator in estimators.items():
            ms = statistics.median(times[name])
            with torch.no_grad():
                value = float(estimator.distance(moved))
            row = {"cnn": which, "estimator": name, "ms": ms, "ratio": ms / base,
                   "estimate": value, "bgln_s_mean": mc_mean, "bgln_s_standard_error": mc_error,
                   "estimate_over_bgln_s": value / mc_mean,
                   "sampled_routing_mean": routed_mean,
                   "sampled_routing_standard_error": routed_error,
                   "estimate_over_sampled_routing": value / routed_mean,
                   "true_fsd": true_fsd, "estimate_over_true": value / true_fsd}
            rows.append(row)
        for name, mean, error in (("BGLN-S", mc_mean, mc_error),
                                  ("sampled BGLN, random routing", routed_mean, routed_error)):
            rows.append({"cnn": which, "estimator": name, "estimate": mean,
                         "standard_error": error, "estimate_over_bgln_s": mean / mc_mean,
                         "estimate_over_sampled_routing": mean / routed_mean,
                         "true_fsd": true_fsd, "estimate_over_true": mean / true_fsd})
        print(f"# {which}: BGLN-S mean {mc_mean:.4g} ± {mc_error:.2g}, sampled BGLN "
              f"{routed_mean:.4g} ± {routed_error:.2g}, true FSD {true_fsd:.4g}", flush=True)
    print(corrected_conv_table({"rows": rows}))
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine, "note": args.note, "repeats": args.repeats,
                       "injection_rank": rank, "mc_calls": args.mc_calls,
                       "mc_samples": args.mc_samples, "rows": rows}, out, indent=1)


if __name__ == "__main__":
    main()
