"""Which estimators take which models: the table of docs/user-guide.md.

Run:  .venv/bin/python benchmarks/model_zoo.py [--markdown]

Fits each of the nine estimator configurations on each model of the zoo (``tests/zoo_models.py``: a
torchvision-style ResNet-18, a pre-activation ResNet, a multi-head CL ResNet, a ViT, an
``nn.TransformerEncoder``, an MLP-Mixer, LSTM and GRU text classifiers on token ids, a
Conv1d net, a dict-output model, weight_norm / spectral_norm MLPs, a compiled MLP and a
DDP-wrapped CNN); a cell is ✓ when ``fit`` accepts the model and ``distance(...).backward()``
runs, else the one-line refusal. ``tests/test_model_zoo.py`` checks every ✓ cell against a
brute force and that docs/user-guide.md holds what ``--markdown`` prints.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import zoo_models as zoo


def cell(name: str, estimator: str) -> str:
    """"✓" or "refused: <message>" for one model and estimator."""
    model, x = zoo.build(name)
    moved = zoo.moved(model)
    with zoo.wrapped(name, model, moved) as (wrapped_model, wrapped_moved):
        est, error = zoo.fit(estimator, wrapped_model, name, x)
        if est is not None:
            est.distance(wrapped_moved).backward()
    return zoo.outcome(error)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--markdown", action="store_true",
                        help="print the docs table (else one line per cell)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    table: dict[str, dict[str, str]] = {}
    for name in zoo.MODELS:
        table[name] = {}
        for estimator in zoo.ESTIMATORS:
            table[name][estimator] = cell(name, estimator)
            if not args.markdown:
                print(f"{name:20s} {estimator:13s} {table[name][estimator]}", flush=True)
    if args.markdown:
        print(zoo.markdown(table), end="")


if __name__ == "__main__":
    main()
