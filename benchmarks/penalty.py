"""How much an FSD penalty costs next to a training step (issue: performance).

Run:  .venv/bin/python benchmarks/penalty.py [--data-dir D] [--threads 1] [--repeats 30]
      [--device cuda]

Prints, in one process, medians of repeated timings:
 (a) step-with-penalty / plain-step at batch 32 and 128 for each estimator (width 256), and
     for BGLN-D with Algorithm 2 (moments="paper") and exact moments at width 512;
 (b) one BGLN-D distance vs one ExactFSD over the 60k MNIST training inputs;
 (c) K = 1, 3, 9 previous tasks' BGLN-D summaries (full and low-rank r = 64; Algorithm 2
     and exact moments; widths 256 and 512) in one fsd.combine call: the penalty alone
     (distance + backward), its ratio to Algorithm 2's, and a whole penalized step at
     batch 128 against a plain step;
 (d) the library's BGLN-D vs a dense float64 transcription of paper Algorithm 2 (value, speed);
 (e) low-rank (r = 16, 64, 128) vs full-covariance BGLN-D on MNIST-trained networks;
 (f) K BGLN-D summaries (Algorithm 2 and exact moments, full and low-rank r = 64, widths
     256 and 512): fsd.combine's one stacked pass vs the sum of K separate distance calls
     (distance + backward);
 (g) exact moments by the adjoint recursion (what BGLN uses) vs the forward recursion it
     replaced (fsd.moments.exact.delta_second_moment), one summary, distance + backward;
 (h) K class-wise Algorithm 2 summaries (10 classes, full covariance, width 512) in one
     fsd.combine call: reference parameters stacked once per summary (what fsd.combine does)
     against one copy per class, distance + backward and, at K = 9,
     the input layer's tr(P C Pᵀ) alone;
 (i) K fsd.KFAC summaries (the OSLA baseline, width 512), distance + backward: the
     library's backward, which reuses the forward's G ΔW̄ A, against plain autograd through
     ½ Σ (G ΔW̄) ⊙ (ΔW̄ A).
Model: MLP 784-256-256-10 (and 784-512-512-10 where said), Adam. `--sections a,c` runs only
those sections. Moments are real MNIST moments when the data is found
(--data-dir / $FSD_DATA_DIR), else random inputs (said in the output).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import statistics
import time

import torch
from torch import nn

import fsd
from fsd.moments import evaluators
from fsd.testing import dense_algorithm2
from fsd_experiments.compare import mlp
from fsd_experiments.data import DataNotFoundError, TensorBatches, load_mnist, split_by_classes
from fsd_experiments.devices import cpu_name, device_name
from fsd_experiments.printed_report import printed_report
from fsd_experiments.training import cross_entropy, train

DEVICE = torch.device("cpu")


def _sync() -> None:
    # GPU work is asynchronous: wait for it, or the timer measures only the kernel launches
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)


def median_ms(fn, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        _sync()
        start = time.perf_counter()
        fn()
        _sync()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def load_inputs(data_dir: str | None) -> tuple[torch.Tensor, torch.Tensor, str]:
    try:
        x, y = load_mnist(data_dir, "train")
        return x, y, "real MNIST (60,000 training images)"
    except DataNotFoundError:
        g = torch.Generator().manual_seed(0)
        return (torch.rand(60_000, 1, 28, 28, generator=g),
                torch.randint(0, 10, (60_000,), generator=g), "random inputs (MNIST not found)")


def perturbed(model: nn.Module, scale: float, seed: int) -> nn.Module:
    g = torch.Generator().manual_seed(seed)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for p in moved.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype).to(p.device))
    return moved


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (data and models there)")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--fit-examples", type=int, default=10_000,
                        help="examples used to fit the summaries in (a)")
    parser.add_argument("--sections", default="abcdefghi",
                        help="which sections to run, e.g. 'ac' (default: all)")
    parser.add_argument("--out", default=None,
                        help="also write what is printed to OUT.md and its tables to OUT.json")
    args = parser.parse_args()
    global DEVICE
    DEVICE = torch.device(args.device)
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda, but torch.cuda.is_available() is False here")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y, source = load_inputs(args.data_dir)
    x, y = x.to(DEVICE), y.to(DEVICE)
    where = torch.cuda.get_device_name(DEVICE) if DEVICE.type == "cuda" else "CPU"
    with printed_report(args.out, device=device_name(DEVICE)):
        run_sections(args, x, y, source, where)


def run_sections(args, x, y, source: str, where: str) -> None:
    print(f"# machine: {platform.machine()} ({cpu_name()}), {os.cpu_count()} cores, "
          f"torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), device {where}; inputs: {source}; "
          f"load average at start {os.getloadavg()[0]:.1f} (other processes share the CPU: "
          f"compare ratios measured side by side, not absolute times)")
    model = mlp(784, 256, 2, 10).to(DEVICE)
    fit_data = TensorBatches(x[: args.fit_examples], y[: args.fit_examples], 1000)
    moved = perturbed(model, 0.01, 1)
    if "a" in args.sections:
        section_a(args, model, moved, x, y, fit_data)
    if "b" in args.sections:
        section_b(args, model, moved, x, y)
    if "c" in args.sections:
        section_c(args, x, y, fit_data)
    if "d" in args.sections:
        section_d(args, model, moved, x, y)
    if "e" in args.sections:
        section_e(args, x, y)
    if "f" in args.sections:
        section_f(args, fit_data)
    if "g" in args.sections:
        section_g(args, x, y, fit_data)
    if "h" in args.sections:
        section_h(args, x, y, fit_data)
    if "i" in args.sections:
        section_i(args, fit_data)
    print(f"\n# load average at the end {os.getloadavg()[0]:.1f}")


def _estimators_a(width: int) -> dict[str, fsd.Estimator]:
    bgln_d = {
        "BGLN-D full (Algorithm 2)": fsd.BGLN(deterministic=True, covariance="full"),
        "BGLN-D full (exact moments)": fsd.BGLN(deterministic=True, moments="exact",
                                                covariance="full"),
        "BGLN-D lowrank r=64 (Algorithm 2)": fsd.BGLN(deterministic=True, covariance="lowrank",
                                                      rank=64),
        "BGLN-D lowrank r=64 (exact moments)": fsd.BGLN(deterministic=True, moments="exact",
                                                        covariance="lowrank", rank=64),
    }
    if width != 256:
        return bgln_d
    return {
        **bgln_d,
        "BGLN-D diag (Algorithm 2)": fsd.BGLN(deterministic=True, covariance="diag"),
        "BGLN-S (128 samples)": fsd.BGLN(num_samples=128),
        "LAFTR gaussian (128)": fsd.LAFTR(inputs="gaussian", num_samples=128),
        "NTK (coreset 40)": fsd.NTK(coreset_size=40),
        "EWC": fsd.EWC(),
    }


def section_a(args, model, moved, x, y, fit_data) -> None:

    # (a) penalty cost relative to a plain Adam step
    print("\n## (a) step with penalty / plain step (MLP 784-w-w-10, Adam)")
    print("| width | penalty | batch 32: ms | ratio | batch 128: ms | ratio |")
    print("|---:|---|---:|---:|---:|---:|")
    for width in (256, 512):
        if width != 256:
            torch.manual_seed(0)
            model = mlp(784, width, 2, 10).to(DEVICE)
            moved = perturbed(model, 0.01, 1)
        _section_a_width(args, width, model, moved, x, y, fit_data)


def _section_a_width(args, width, model, moved, x, y, fit_data) -> None:
    estimators = _estimators_a(width)
    for est in estimators.values():
        est.fit(model, fit_data)
    optimizer = torch.optim.Adam(moved.parameters(), lr=1e-4)
    results = {}
    for batch in (32, 128):
        xb, yb = x[:batch], y[:batch]

        def step(est=None, xb=xb, yb=yb):
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(moved(xb), yb)
            if est is not None:
                loss = loss + est.distance(moved)
            loss.backward()
            optimizer.step()

        # interleave plain and penalized runs so drifting machine load hits both alike
        plain, penal = [], {name: [] for name in estimators}
        for _ in range(3):
            plain.append(median_ms(step, args.repeats // 3 or 1))
            for name, est in estimators.items():
                penal[name].append(median_ms(lambda e=est: step(e), args.repeats // 3 or 1))
        results[batch] = (statistics.median(plain),
                          {k: statistics.median(v) for k, v in penal.items()})
    print(f"| {width} | none (plain step) | {results[32][0]:.2f} | 1.00 | "
          f"{results[128][0]:.2f} | 1.00 |")
    for name in estimators:
        a, b = results[32][1][name], results[128][1][name]
        print(f"| {width} | {name} | {a:.2f} | {a / results[32][0]:.2f} | {b:.2f} | "
              f"{b / results[128][0]:.2f} |")


def section_b(args, model, moved, x, y) -> None:
    # (b) one BGLN-D evaluation vs ExactFSD over all 60k training inputs
    all_data = TensorBatches(x, y, 2000)
    bgln_d = fsd.BGLN(deterministic=True, covariance="full").fit(model, all_data)
    exact = fsd.ExactFSD().fit(model, all_data)
    with torch.no_grad():
        exact.distance(moved)  # caches f(x, θ0), as a user's repeated calls would
        t_exact = median_ms(lambda: exact.distance(moved), 5, warmup=1)
        t_bgln = median_ms(lambda: bgln_d.distance(moved), args.repeats)
    print("\n## (b) one distance call (no backward), 60k MNIST training inputs")
    print(f"ExactFSD: {t_exact:.1f} ms, BGLN-D (full covariance): {t_bgln:.3f} ms, "
          f"ratio {t_exact / t_bgln:.0f}x")

def _timed_steps(moved, xb, yb):
    """(penalty(s): distance + backward, step(s=None): an Adam step with penalty s)."""
    optimizer = torch.optim.Adam(moved.parameters(), lr=1e-4)

    def penalty(summary_set):
        moved.zero_grad()
        summary_set.distance(moved).backward()

    def step(summary_set=None):
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(moved(xb), yb)
        if summary_set is not None:
            loss = loss + summary_set.distance(moved)
        loss.backward()
        optimizer.step()

    return penalty, step


def section_c(args, x, y, fit_data) -> None:
    # (c) K previous tasks in one call: the penalty alone (distance + backward), and a whole
    # Adam step at batch 128 with that penalty (what a continual learner pays per step).
    # Algorithm 2 and exact moments are timed interleaved, three rounds, so drifting load
    # from other processes hits both alike.
    print("\n## (c) K previous tasks' BGLN-D summaries in one fsd.combine call "
          "(10 outputs each)")
    print("| width | summaries | moments | K | penalty (distance+backward): ms | "
          "ratio to K=1 | ratio to Algorithm 2 | step at batch 128 with penalty: ms | "
          "ratio to plain step |")
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    xb, yb = x[:128], y[:128]
    rounds = 3
    for width in (256, 512):
        torch.manual_seed(0)
        model = mlp(784, width, 2, 10).to(DEVICE)
        moved = perturbed(model, 0.01, 1)
        penalty, step = _timed_steps(moved, xb, yb)
        for label, kwargs in (("full", {"covariance": "full"}),
                              ("lowrank r=64", {"covariance": "lowrank", "rank": 64})):
            summaries = {moments: [fsd.BGLN(deterministic=True, moments=moments, **kwargs).fit(
                perturbed(model, 0.02, 10 + k), fit_data) for k in range(9)]
                for moments in ("paper", "exact")}
            times = {(m, k): [] for m in summaries for k in (1, 3, 9)}
            steps = {(m, k): [] for m in summaries for k in (1, 3, 9)}
            plain = []
            repeats = max(1, args.repeats // rounds)
            for _ in range(rounds):
                plain.append(median_ms(step, repeats))
                for m in summaries:
                    for k in (1, 3, 9):
                        summary_set = fsd.combine(summaries[m][:k])
                        times[m, k].append(median_ms(
                            lambda s=summary_set, f=penalty: f(s), repeats))
                        steps[m, k].append(median_ms(lambda s=summary_set, f=step: f(s), repeats))
            plain_ms = statistics.median(plain)
            times = {key: statistics.median(v) for key, v in times.items()}
            steps = {key: statistics.median(v) for key, v in steps.items()}
            for m in summaries:
                name = "Algorithm 2" if m == "paper" else "exact"
                for k in (1, 3, 9):
                    t = times[m, k]
                    print(f"| {width} | {label} | {name} | {k} | {t:.2f} | "
                          f"{t / times[m, 1]:.2f} | {t / times['paper', k]:.2f} | "
                          f"{steps[m, k]:.2f} | {steps[m, k] / plain_ms:.2f} |")
        print(f"| {width} | plain step, no penalty | | | | | | {plain_ms:.2f} | 1.00 |")


def section_d(args, model, moved, x, y) -> None:
    # (d) the library vs a dense float64 transcription of Algorithm 2
    model64, moved64 = copy.deepcopy(model).double(), copy.deepcopy(moved).double()
    est64 = fsd.BGLN(deterministic=True, covariance="full").fit(model64, TensorBatches(
        x[: args.fit_examples].double(), y[: args.fit_examples], 1000))
    mean, cov = est64._state["input.mean"][0], est64._state["input.cov"][0]
    gates = [est64._state[f"gate.{p}"][0] for p in ("2", "4")]
    with torch.no_grad():
        dense_value = dense_algorithm2(model64[1:], moved64[1:], mean, cov, gates)
    with torch.no_grad():
        lib_value = est64.distance(moved64)
    t_dense = median_ms(lambda: dense_algorithm2(model64[1:], moved64[1:], mean, cov, gates),
                        max(5, args.repeats // 3))
    t_lib = median_ms(lambda: est64.distance(moved64), args.repeats)
    rel = abs(float(lib_value) - float(dense_value)) / abs(float(dense_value))
    print("\n## (d) library BGLN-D vs dense float64 Algorithm 2 (forward only)")
    print(f"dense {float(dense_value):.10g}, library {float(lib_value):.10g}, relative "
          f"difference {rel:.1e}; dense {t_dense:.2f} ms, library {t_lib:.2f} ms, "
          f"speed-up {t_dense / t_lib:.1f}x")


def section_e(args, x, y) -> None:
    # (e) low rank vs full on MNIST-trained networks
    print("\n## (e) low-rank vs full-covariance BGLN-D on networks trained on MNIST 0/1 -> 2/3")
    x01, y01 = split_by_classes(x, y, [0, 1])
    x23, y23 = split_by_classes(x, y, [2, 3])
    g = torch.Generator().manual_seed(0)
    trained = mlp(784, 256, 2, 2).to(DEVICE)
    train(trained, TensorBatches(x01, y01, 64, shuffle=True, generator=g), cross_entropy,
          torch.optim.Adam(trained.parameters(), lr=1e-3))
    data01 = TensorBatches(x01, y01, 2000)
    full = fsd.BGLN(deterministic=True, covariance="full").fit(trained, data01)
    lowrank = {r: fsd.BGLN(deterministic=True, covariance="lowrank", rank=r).fit(trained, data01)
               for r in (16, 64, 128)}
    finetuned = copy.deepcopy(trained)
    print("| fine-tuning steps on 2/3 | full | r=16 | r=64 | r=128 |")
    print("|---:|---:|---:|---:|---:|")
    def endless(batches):
        while True:
            yield from batches

    batches = endless(TensorBatches(x23, y23, 64, shuffle=True, generator=g))
    optimizer = torch.optim.Adam(finetuned.parameters(), lr=1e-3)
    done = 0
    for target in (10, 50, 200):
        while done < target:
            xb, yb = next(batches)
            optimizer.zero_grad()
            nn.functional.cross_entropy(finetuned(xb), yb).backward()
            optimizer.step()
            done += 1
        with torch.no_grad():
            f = float(full.distance(finetuned))
            rels = [abs(float(lowrank[r].distance(finetuned)) - f) / f for r in (16, 64, 128)]
        print(f"| {target} | {f:.4g} | " + " | ".join(f"{e:.2%}" for e in rels) + " |")
    print(f"\nbytes: full {full.nbytes:,}, " + ", ".join(
        f"r={r} {lowrank[r].nbytes:,}" for r in (16, 64, 128)))


def section_f(args, fit_data) -> None:
    # (f) fsd.combine's one stacked pass against one call per summary, interleaved
    print("\n## (f) K BGLN-D summaries (10 outputs each) in one fsd.combine call vs one call "
          "per summary, distance + backward")
    print("| width | summaries | moments | K | one by one: ms | fsd.combine: ms | speed-up | "
          "relative difference |")
    print("|---:|---|---|---:|---:|---:|---:|---:|")
    for width in (256, 512):
        torch.manual_seed(0)
        model = mlp(784, width, 2, 10).to(DEVICE)
        moved = perturbed(model, 0.01, 1)
        penalty, _ = _timed_steps(moved, None, None)

        def separately(summaries, moved=moved):
            moved.zero_grad()
            sum(e.distance(moved) for e in summaries).backward()

        for label, kwargs in (("full", {"covariance": "full"}),
                              ("lowrank r=64", {"covariance": "lowrank", "rank": 64})):
            for moments in ("paper", "exact"):
                summaries = [fsd.BGLN(deterministic=True, moments=moments, **kwargs).fit(
                    perturbed(model, 0.02, 10 + k), fit_data) for k in range(9)]
                for k in (3, 9):
                    summary_set = fsd.combine(summaries[:k])
                    with torch.no_grad():
                        value = float(summary_set.distance(moved))
                        single = float(sum(e.distance(moved) for e in summaries[:k]))
                    one, batched = [], []
                    for _ in range(3):
                        one.append(median_ms(lambda k=k, s=summaries: separately(s[:k]),
                                             args.repeats // 3 or 1))
                        batched.append(median_ms(lambda s=summary_set, p=penalty: p(s),
                                                 args.repeats // 3 or 1))
                    a, b = statistics.median(one), statistics.median(batched)
                    name = "Algorithm 2" if moments == "paper" else "exact"
                    print(f"| {width} | {label} | {name} | {k} | {a:.2f} | {b:.2f} | "
                          f"{a / b:.2f} | {abs(value - single) / single:.1e} |")


def section_g(args, x, y, fit_data) -> None:
    # (g) the adjoint recursion against the forward one on the same cached blocks
    from fsd.moments.exact import delta_second_moment

    print("\n## (g) exact moments: adjoint recursion vs the forward recursion "
          "(one summary, 10 outputs, distance + backward)")
    print("| width | summaries | forward: ms | adjoint: ms | speed-up | relative difference |")
    print("|---:|---|---:|---:|---:|---:|")
    rounds = 3
    for width in (256, 512):
        torch.manual_seed(0)
        model = mlp(784, width, 2, 10).to(DEVICE)
        moved = perturbed(model, 0.01, 1)
        layers = fsd.trace(moved)
        for label, kwargs in (("full", {"covariance": "full"}),
                              ("lowrank r=64", {"covariance": "lowrank", "rank": 64})):
            est = fsd.BGLN(deterministic=True, moments="exact", **kwargs).fit(
                perturbed(model, 0.02, 10), fit_data)
            theta0 = est.reference_parameters()
            parts = est.moment_parts(layers, theta0)

            def forward(theta0=theta0, parts=parts, moved=moved, layers=layers):
                value = delta_second_moment(layers, theta0, dict(moved.named_parameters()),
                                            parts["reference"], parts["gate_means"],
                                            parts["output_rows"])
                return 0.5 * (parts["weights"] * value).sum()

            def run(fn, moved=moved):
                moved.zero_grad()
                fn().backward()

            with torch.no_grad():
                a, b = float(forward()), float(est.distance(moved))
            old, new = [], []
            repeats = max(1, args.repeats // rounds)
            for _ in range(rounds):
                old.append(median_ms(lambda f=forward: run(f), repeats))
                new.append(median_ms(lambda e=est, m=moved: run(lambda: e.distance(m)), repeats))
            t_old, t_new = statistics.median(old), statistics.median(new)
            print(f"| {width} | {label} | {t_old:.2f} | {t_new:.2f} | {t_old / t_new:.1f} | "
                  f"{abs(a - b) / abs(a):.1e} |")



def section_h(args, x, y, fit_data) -> None:
    # (h) class-wise summaries: the components of one summary share its reference network.
    # The per-class layout is rebuilt here from fsd.combine's own stacked parts, so both
    # layouts run the same delta_moments on the same numbers, interleaved.
    from fsd.covariance import quadratic_trace
    from fsd.model.plan import trace
    from fsd.model.signature import model_state
    from fsd.moments.algorithm2 import delta_moments

    print("\n## (h) K class-wise Algorithm 2 summaries (full covariance, 10 classes, width 512)"
          " in one fsd.combine call: reference stacked per summary vs per class")
    print("| K | per class: ms | per summary: ms | speed-up | relative difference |")
    print("|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    model = mlp(784, 512, 2, 10).to(DEVICE)
    moved = perturbed(model, 0.01, 1)
    # full input covariances, as `fsd cl --method bgln-d-cw` fits them (BGLN's own default
    # is a rank-32 factor)
    summaries = [fsd.BGLN(deterministic=True, classwise=True, covariance="full").fit(
        perturbed(model, 0.02, 10 + k), fit_data) for k in range(9)]
    layers = trace(moved)

    def penalty(stacked):
        moved.zero_grad()
        mean_d, trace_d = delta_moments(layers, stacked["params0"], model_state(moved),
                                        stacked["reference"], stacked["gate_means"],
                                        stacked["output_rows"])
        value = (stacked["weights"] * (0.5 * mean_d.pow(2).sum(-1) + 0.5 * trace_d)).sum()
        value.backward()
        return float(value.detach())

    for k in (1, 3, 9):
        members = summaries[:k]
        per_summary = evaluators.get("algorithm2").stack(
            [e.moment_parts(layers, e.reference_state()) for e in members],
            [e.reference_state() for e in members], [1.0] * k)
        classes = per_summary["weights"].shape[0] // k
        per_class = dict(per_summary, params0={
            name: p.repeat_interleave(classes, dim=0) for name, p in
            per_summary["params0"].items()})
        a_value, b_value = penalty(per_class), penalty(per_summary)
        a, b = [], []
        for _ in range(3):
            a.append(median_ms(lambda s=per_class: penalty(s), max(1, args.repeats // 3)))
            b.append(median_ms(lambda s=per_summary: penalty(s), max(1, args.repeats // 3)))
        a_ms, b_ms = statistics.median(a), statistics.median(b)
        print(f"| {k} | {a_ms:.1f} | {b_ms:.1f} | {a_ms / b_ms:.2f} | "
              f"{abs(a_value - b_value) / abs(a_value):.1e} |")
    # where the K = 9 penalty's time goes: the input layer's tr(P C Pᵀ) against the 90 class
    # covariances alone (forward and backward, P of the penalty's shape)
    covariances = per_summary["reference"][0][1]
    rows = torch.randn(covariances.shape[0], 10, covariances.shape[-1], device=DEVICE,
                       requires_grad=True)

    def input_trace():
        quadratic_trace(rows, covariances).sum().backward()

    whole = median_ms(lambda s=per_summary: penalty(s), args.repeats)
    alone = median_ms(input_trace, args.repeats)
    print(f"\nK = 9: penalty {whole:.1f} ms, of which the input layer's tr(P C Pᵀ) against "
          f"{covariances.shape[0]} covariances of {covariances.shape[-1]}² "
          f"({covariances.numel() * covariances.element_size() / 1e6:.0f} MB) is "
          f"{alone:.1f} ms ({alone / whole:.0%})")


def section_i(args, fit_data) -> None:
    # (i) the K-FAC penalty of fsd cl's OSLA rows: one term per earlier task, each
    # multiplying ΔW̄ by a (out × out) and an (in+1 × in+1) factor per layer
    print("\n## (i) K fsd.KFAC summaries (width 512), distance + backward: plain autograd vs "
          "the library's backward that reuses G ΔW̄ A")
    print("| K | plain autograd: ms | library: ms | speed-up | relative difference |")
    print("|---:|---:|---:|---:|---:|")
    torch.manual_seed(0)
    model = mlp(784, 512, 2, 10).to(DEVICE)
    moved = perturbed(model, 0.01, 1)
    summaries = [fsd.KFAC().fit(perturbed(model, 0.02, 10 + k), fit_data) for k in range(9)]

    def plain(estimator: fsd.KFAC) -> torch.Tensor:
        theta0 = estimator.reference_parameters()
        current = dict(moved.named_parameters())
        total = torch.zeros((), device=DEVICE)
        for path, _ in estimator._meta["layers"]:
            key = f"{path}." if path else ""
            delta = torch.cat([current[f"{key}weight"] - theta0[f"{key}weight"],
                               (current[f"{key}bias"] - theta0[f"{key}bias"]).unsqueeze(1)], 1)
            g, a = estimator._state[f"kfac.{key}G"], estimator._state[f"kfac.{key}A"]
            total = total + ((g @ delta) * (delta @ a)).sum()
        return 0.5 * total

    def penalty(distance, k: int) -> float:
        moved.zero_grad()
        value = sum(distance(e) for e in summaries[:k])
        value.backward()
        return float(value.detach())

    def library(estimator: fsd.KFAC) -> torch.Tensor:
        return estimator.distance(moved)

    for k in (1, 3, 9):
        a_value, b_value = penalty(plain, k), penalty(library, k)
        a, b = [], []
        for _ in range(3):
            a.append(median_ms(lambda k=k: penalty(plain, k), max(1, args.repeats // 3)))
            b.append(median_ms(lambda k=k: penalty(library, k), max(1, args.repeats // 3)))
        a_ms, b_ms = statistics.median(a), statistics.median(b)
        print(f"| {k} | {a_ms:.1f} | {b_ms:.1f} | {a_ms / b_ms:.2f} | "
              f"{abs(a_value - b_value) / abs(a_value):.1e} |")


if __name__ == "__main__":
    main()
