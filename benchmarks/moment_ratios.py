"""Each estimator of an ``fsd fidelity`` pairs result against BGLN-D (exact) and the truth.

Run:  .venv/bin/python benchmarks/moment_ratios.py OUT/fidelity_split-mnist.json [...] \
          [--json ratios.json]

Per estimator over the pairs: median and max |estimate / exact moments − 1|, median
estimate / exact, median and min estimate / true FSD (markdown; the numbers also as JSON).
"""

from __future__ import annotations

import argparse
import json
import statistics


def ratios(path: str) -> tuple[str, int, dict[str, dict[str, float]]]:
    """(benchmark, number of pairs, per-estimator ratios) of one pairs result file."""
    with open(path) as f:
        result = json.load(f)
    pairs = result["pairs"]["pairs"]
    rows = {}
    for name in result["config"]["estimators"]:
        to_exact = [p["estimates"][name] / p["estimates"]["BGLN-D (exact)"] for p in pairs]
        to_true = [p["estimates"][name] / p["true"] for p in pairs]
        rows[name] = {"median_abs_rel_to_exact": statistics.median(abs(r - 1) for r in to_exact),
                      "max_abs_rel_to_exact": max(abs(r - 1) for r in to_exact),
                      "median_est_over_exact": statistics.median(to_exact),
                      "median_est_over_true": statistics.median(to_true),
                      "min_est_over_true": min(to_true)}
    return result["benchmark"], len(pairs), rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    out = {}
    for path in args.results:
        benchmark, n, rows = ratios(path)
        out[benchmark] = {"pairs": n, "rows": rows}
        print(f"\n{benchmark} ({n} pairs)\n")
        print("| estimator | median \\|est/exact − 1\\| | max \\|est/exact − 1\\| | "
              "median est/exact | median est/true | min est/true |")
        print("|---|---:|---:|---:|---:|---:|")
        for name, v in rows.items():
            print(f"| {name} | {v['median_abs_rel_to_exact']:.3g} | "
                  f"{v['max_abs_rel_to_exact']:.3g} | {v['median_est_over_exact']:.3g} | "
                  f"{v['median_est_over_true']:.3g} | {v['min_est_over_true']:.3g} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
