"""Defaults: each estimator's default summary size, cost and error, and its scale for λ.

On the compare-estimators pair (an MLP trained on MNIST 0/1, fine-tuned on 2/3; the
estimators are fitted on the 0/1 training images) this prints:

(a) for every estimator, a default setting against alternatives: bytes stored, median
    milliseconds of ``distance`` + backward, the estimate, and its relative error against
    the estimator's most accurate setting (all data for coresets, exact moments for BGLN-S
    — its expectation —, the full covariance for BGLN-D);
(b) BGLN-S's sampling error against its number of samples (relative standard deviation of
    the estimate over repeated calls, which falls as 1/√S);
(c) ``fsd.calibrate`` for every estimator: its estimate / true FSD ratio at the fine-tuned
    network and at random perturbations of θ0, and λ rescaled from λ_true = 1.

    python benchmarks/defaults.py --data-dir DATA_DIR [--threads 1]

One process, one thread by default, so the times compare side by side.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import fsd
from fsd.uses.calibration import perturbed_copies
from fsd_experiments.compare import mnist_pair
from fsd_experiments.data import TensorBatches, load_mnist, split_by_classes
from fsd_experiments.printed_report import printed_report


def _timed(estimator: fsd.Estimator, model: torch.nn.Module, repeats: int
           ) -> tuple[float, float]:
    times, value = [], float("nan")
    for i in range(repeats + 1):
        start = time.perf_counter()
        d = estimator.distance(model)
        d.backward()
        if i:  # the first call builds caches
            times.append((time.perf_counter() - start) * 1e3)
        model.zero_grad()
        value = float(d.detach())
    return value, statistics.median(times)


SETTINGS: dict[str, list[tuple[str, object]]] = {
    # estimator: (label, factory) — the first row of each is the most accurate setting
    "LAFTR (coreset)": [
        ("all data", lambda: fsd.LAFTR(coreset_size=None)),
        ("coreset 40", lambda: fsd.LAFTR(coreset_size=40)),
        ("coreset 200", lambda: fsd.LAFTR(coreset_size=200)),
    ],
    "NTK": [
        ("all data", lambda: fsd.NTK(coreset_size=None)),
        ("coreset 40", lambda: fsd.NTK(coreset_size=40)),
        ("coreset 200", lambda: fsd.NTK(coreset_size=200)),
    ],
    "BGLN-S": [
        ("exact moments (= E[BGLN-S])", lambda: fsd.BGLN(deterministic=True, moments="exact",
                                                         covariance="full")),
        ("S = 128", lambda: fsd.BGLN(num_samples=128, covariance="full")),
        ("S = 128, low rank 32", lambda: fsd.BGLN(num_samples=128, covariance="lowrank",
                                                  rank=32)),
        ("S = 32", lambda: fsd.BGLN(num_samples=32, covariance="full")),
    ],
    "BGLN-D (paper)": [
        ("full covariance", lambda: fsd.BGLN(deterministic=True, covariance="full")),
        ("low rank 32", lambda: fsd.BGLN(deterministic=True, covariance="lowrank", rank=32)),
        ("low rank 64", lambda: fsd.BGLN(deterministic=True, covariance="lowrank", rank=64)),
    ],
    "BGLN-D (exact moments)": [
        ("full covariance", lambda: fsd.BGLN(deterministic=True, moments="exact",
                                             covariance="full")),
        ("low rank 32", lambda: fsd.BGLN(deterministic=True, moments="exact",
                                         covariance="lowrank", rank=32)),
        ("low rank 64", lambda: fsd.BGLN(deterministic=True, moments="exact",
                                         covariance="lowrank", rank=64)),
    ],
    "EWC": [("euclidean", lambda: fsd.EWC(metric="euclidean")),
            ("kl", lambda: fsd.EWC(metric="kl"))],
    "KFAC": [("euclidean", lambda: fsd.KFAC())],
}


DEFAULTS = {
    "ExactFSD": fsd.ExactFSD, "LAFTR": fsd.LAFTR, "NTK": fsd.NTK, "BGLN-S": fsd.BGLN,
    "BGLN-D (paper)": lambda: fsd.BGLN(deterministic=True),
    "BGLN-D (exact moments)": lambda: fsd.BGLN(deterministic=True, moments="exact"),
    "EWC": fsd.EWC, "KFAC": fsd.KFAC,
}


def main() -> None:
    """Print tables (a), (b) and (c)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None,
                        help="also write what is printed to OUT.md and its tables to OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with printed_report(args.out):
        run(args)


def run(args: argparse.Namespace) -> None:
    """Print tables (a), (b), (d) and (c)."""
    model, moved, (x01, y01), _ = mnist_pair(args.data_dir, progress=False)
    data = TensorBatches(x01, y01, 1024)
    with torch.no_grad():
        truth = float(fsd.ExactFSD().fit(model, data).distance(moved))
    print(f"true FSD of the pair: {truth:.4g} (12,665 images of 0/1; MLP 784-100-100-2)\n")

    print("(a) defaults: bytes, cost, and error against each estimator's most accurate "
          "setting\n")
    print("| estimator | setting | bytes | ms / call | estimate | error vs first row |")
    print("|---|---|---:|---:|---:|---:|")
    for name, rows in SETTINGS.items():
        best = None
        for label, make in rows:
            estimator = make().fit(model, data)  # type: ignore[operator]
            value, ms = _timed(estimator, moved, args.repeats)
            best = value if best is None else best
            error = abs(value - best) / abs(best) if best else float("nan")
            print(f"| {name} | {label} | {estimator.nbytes:,} | {ms:.1f} | {value:.4g} | "
                  f"{error:.2%} |")

    print("\n(b) BGLN-S: relative standard deviation of the estimate over 30 calls\n")
    print("| samples S | relative std | × √S |")
    print("|---:|---:|---:|")
    for samples in (8, 32, 128, 512):
        estimator = fsd.BGLN(num_samples=samples, covariance="full", seed=1).fit(model, data)
        with torch.no_grad():
            values = torch.tensor([float(estimator.distance(moved)) for _ in range(30)])
        rel = float(values.std() / values.mean())
        print(f"| {samples} | {rel:.3f} | {rel * samples ** 0.5:.2f} |")

    print("\n(d) BGLN-D, low rank 32 against the full covariance, at the fine-tuned network "
          "and 8 random perturbations of θ0 (relative scale 0.05 and 0.5)\n")
    print("| moments | largest relative difference |")
    print("|---|---:|")
    networks = [moved, *perturbed_copies(model, 4, 0.05, seed=2),
                *perturbed_copies(model, 4, 0.5, seed=3)]
    for moments in ("paper", "exact"):
        full = fsd.BGLN(deterministic=True, moments=moments, covariance="full").fit(model, data)
        low = fsd.BGLN(deterministic=True, moments=moments, covariance="lowrank",
                       rank=32).fit(model, data)
        with torch.no_grad():
            worst = max(abs(float(low.distance(n)) / float(full.distance(n)) - 1)
                        for n in networks)
        print(f"| {moments} | {worst:.2%} |")

    print("\n(c) the defaults' scale against the true FSD (fsd.calibrate; held out: the 0/1 "
          "test images)\n")
    print("| estimator | ratio at the fine-tuned network | median ratio, 8 random "
          "perturbations (scale 0.05) | log10 spread | λ for λ_true = 1 |")
    print("|---|---:|---:|---:|---:|")
    x_test, y_test = load_mnist(args.data_dir, "test")
    held_out = split_by_classes(x_test, y_test, [0, 1])[0]
    for name, make in DEFAULTS.items():
        estimator = make().fit(model, data)
        at_moved = fsd.calibrate(estimator, model, held_out, moved=[moved, moved])
        random = fsd.calibrate(estimator, model, held_out)
        print(f"| {name} | {at_moved.median_ratio:.3g} | {random.median_ratio:.3g} | "
              f"{random.spread:.2f} | {at_moved.scale_lambda(1.0):.3g} |")


if __name__ == "__main__":
    main()
