"""Draw ``cnn_gap_chain.py``'s rows: each approximation's estimate over the true FSD.

Run:  .venv/bin/python benchmarks/cnn_gap_chain_plot.py RESULTS.json OUT.png

One line per (λ, earlier task) across the chain from the truth to the stored summary, on a
log axis, so the factor each approximation loses is the drop between two columns.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # after choosing the backend

#: the chain's columns in order, with their labels on the axis
STAGES: tuple[tuple[str, str], ...] = (
    ("true", "true FSD"),
    ("laftr_data", "LAFTR,\ndata"),
    ("bgln_s_data", "BGLN-S,\ndata"),
    ("bgln_s_gaussian", "BGLN-S,\nGaussian"),
    ("bgln_fired_routing", "fired pools\n(MC)"),
    ("bgln_random_routing", "random routing\n(corrected)"),
    ("stored", "stored\nsummary"),
)


def ratios(row: dict) -> list[float]:
    """Each stage's value over the row's true FSD (NaN, not drawn, where it has none)."""
    return [float("nan") if row.get(key) is None else row[key] / row["true"]
            for key, _ in STAGES]


def plot(rows: list[dict], out: Path) -> None:
    """Write the figure for ``rows`` (the JSON file's ``"rows"``) to ``out``."""
    scales = sorted({row["fsd_scale"] for row in rows})
    colours = dict(zip(scales, plt.get_cmap("tab10").colors, strict=False))
    markers = "osD^v<>p"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    positions = range(len(STAGES))
    for row in rows:
        ax.plot(positions, ratios(row), color=colours[row["fsd_scale"]],
                marker=markers[(row["task"] - 1) % len(markers)], alpha=0.8,
                label=f"λ {row['fsd_scale']:g}, task {row['task']}")
    ax.set_yscale("log")
    ax.axhline(1.0, color="grey", lw=0.8, ls=":")
    ax.set_xticks(list(positions), [label for _, label in STAGES], fontsize=8)
    ax.set_ylabel("estimate / true FSD")
    seeds = sorted({row["seed"] for row in rows})
    ax.set_title(f"Split Fashion-MNIST CNN after task {rows[0]['after_task']}, seed "
                 f"{', '.join(map(str, seeds))}: each approximation's estimate", fontsize=9)
    ax.legend(fontsize=7, ncol=2, loc="lower left")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results", type=Path, help="cnn_gap_chain.py's --json file")
    parser.add_argument("out", type=Path, help="the PNG to write")
    args = parser.parse_args()
    rows = json.loads(args.results.read_text())["rows"]
    if not rows:
        parser.error(f"{args.results} has no rows")
    plot(rows, args.out)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
