"""Each estimator of an ``fsd fidelity`` pairs result against BGLN-D (exact) and the truth.

Run:  .venv/bin/python benchmarks/moment_ratios.py OUT/fidelity_split-mnist.json [...] \
          [--json ratios.json]

Per estimator over the pairs: median and max |estimate / exact moments − 1|, median
estimate / exact, median and min estimate / true FSD, beside the study's rank correlations
and gradient cosine: the docs' variants table (markdown,
:func:`fsd_experiments.result_tables.moment_variants_table`; the ratios also as JSON).
"""

from __future__ import annotations

import argparse
import json

from fsd_experiments.io import read_json
from fsd_experiments.result_tables import moment_ratios, moment_variants_table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", nargs="+")
    parser.add_argument("--json", default=None, help="also write the numbers here")
    args = parser.parse_args()
    results = [read_json(path) for path in args.results]
    print(moment_variants_table(results))
    if args.json:
        out = {r["benchmark"]: {"pairs": len(r["pairs"]["pairs"]), "rows": moment_ratios(r)}
               for r in results}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
