"""``fsd toy``: the 1-D regression of paper Fig. 1.

Two regression tasks on disjoint input ranges are learned one after the other by a small
ReLU MLP.

- Left panel: f1 (after task 1), f2 (after task 2, unregularized) and two approximations of
  f2 built around f1: LAFTR (the network at θ2 with every ReLU gate frozen at θ1's gate for
  that input) and NTK (f1 + J_θ f1 · (θ2 − θ1)).
- Right panel: task 2 trained from θ1 with ``λ · FSD-estimate`` added to the loss, for
  BGLN-D, EWC and NTK, against unregularized training.

The library's estimators return only the averaged distance, not per-input outputs, so the
left panel's curves are computed here directly: :func:`laftr_outputs` is a small
frozen-gate forward pass, :func:`ntk_outputs` uses ``torch.func.jvp``. Their mean
½(approx − f1)² over the inputs equals ``fsd.LAFTR`` / ``fsd.NTK``'s ``distance`` with those
inputs as the coreset (checked in tests/test_toy.py). The right panel uses the library's
estimators through the public API.
"""

from __future__ import annotations

import argparse
import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp

from fsd.estimators.base import Estimator

from . import argtypes
from .argtypes import add_threads_option, apply_threads
from .io import atomic_write_text, claim_output, earlier_output, versioned, write_json
from .models import mlp
from .plotting import pyplot, write_figure
from .presets import PRESETS
from .training import squared_error, train

#: the regularizers of the right panel, by display name ("NTK": over all task-1 inputs)
REGULARIZERS: dict[str, Callable[[], Estimator]] = {
    "BGLN-D": PRESETS["bgln-d"].make,
    "EWC": PRESETS["ewc"].make,
    "NTK": PRESETS["ntk"].make,
}


@dataclass
class ToyData:
    """Inputs (n, 1) and targets (n, 1) of the two tasks."""

    x1: Tensor
    y1: Tensor
    x2: Tensor
    y2: Tensor


def target(x: Tensor) -> Tensor:
    """The function both tasks sample: a slow sine wave."""
    return torch.sin(1.5 * x)


def make_data(n: int = 40, noise: float = 0.05, seed: int = 0,
              dtype: torch.dtype = torch.float64) -> ToyData:
    """Task 1 on x ∈ [−4, −1], task 2 on x ∈ [1, 4], y = sin(1.5x) + noise."""
    g = torch.Generator().manual_seed(seed)

    def task(lo: float, hi: float) -> tuple[Tensor, Tensor]:
        x = lo + (hi - lo) * torch.rand(n, 1, generator=g, dtype=dtype)
        return x, target(x) + noise * torch.randn(n, 1, generator=g, dtype=dtype)

    return ToyData(*task(-4.0, -1.0), *task(1.0, 4.0))


def fit_regression(model: nn.Module, x: Tensor, y: Tensor, *, steps: int, lr: float,
                   penalty: Callable[[nn.Module], Tensor] | None = None,
                   lam: float = 0.0) -> None:
    """Full-batch Adam on mean squared error (+ ``lam * penalty(model)``), ``steps`` steps."""
    train(model, [(x, y)], squared_error, torch.optim.Adam(model.parameters(), lr=lr),
          epochs=steps, penalty=penalty, weight=lam, bar=None)


def laftr_outputs(reference: nn.Sequential, model: nn.Sequential, x: Tensor) -> Tensor:
    """LAFTR's approximation of ``model`` around ``reference`` at each input.

    Linearizing ReLU(s) at the reference pre-activation s0 gives ReLU(s0) + 1{s0>0}(s − s0)
    = 1{s0>0}·s: the network at θ with the gates frozen to the reference's. Supports
    Sequentials of Linear / ReLU / Flatten (the MLPs of this module).
    """
    a0, a1 = x, x
    for m0, m1 in zip(reference, model, strict=True):
        if isinstance(m0, nn.ReLU):
            gate = (a0 > 0).to(a0.dtype)
            a0, a1 = a0 * gate, a1 * gate
        elif isinstance(m0, (nn.Linear, nn.Flatten)):
            a0, a1 = m0(a0), m1(a1)
        else:
            raise TypeError(f"laftr_outputs supports Linear/ReLU/Flatten, not {type(m0).__name__}")
    return a1


def ntk_outputs(reference: nn.Module, model: nn.Module, x: Tensor) -> Tensor:
    """f(x, θ0) + J(x, θ0)(θ − θ0): the parameter-space linearization at each input."""
    theta0 = {k: v.detach() for k, v in reference.named_parameters()}
    names = list(theta0)
    theta1 = dict(model.named_parameters())

    def f(*params: Tensor) -> Tensor:
        return functional_call(reference, dict(zip(names, params, strict=True)), (x,))

    f0, jv = jvp(f, tuple(theta0[n] for n in names),
                 tuple(theta1[n].detach() - theta0[n] for n in names))[:2]
    return f0 + jv


@dataclass(frozen=True)
class ToyConfig:
    """Settings of :func:`run_toy` (the ``fsd toy`` options map onto it)."""

    width: int = 64
    depth: int = 1  # "an MLP with two fully connected layers" (paper, regression)
    steps: int = 2000
    lr: float = 1e-2
    lam: float = 10.0
    n: int = 40
    seed: int = 0

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ToyConfig:
        """The settings the ``fsd toy`` options ask for (``lr`` and ``n`` keep the defaults)."""
        return cls(width=args.width, depth=args.depth, steps=args.steps, lam=args.lam,
                   seed=args.seed)


#: the layout of toy.json (config, approximation, errors, seeds)
TOY_SCHEMA = 1


def run_toy(config: ToyConfig | None = None) -> dict[str, Any]:
    """Train f1, f2 and the regularized runs; returns models, grid outputs and errors."""
    cfg = config or ToyConfig()
    data = make_data(cfg.n, seed=cfg.seed)
    torch.manual_seed(cfg.seed)
    f1 = mlp(1, cfg.width, cfg.depth, 1).to(torch.float64)
    fit_regression(f1, data.x1, data.y1, steps=cfg.steps, lr=cfg.lr)
    f2 = copy.deepcopy(f1)
    fit_regression(f2, data.x2, data.y2, steps=cfg.steps, lr=cfg.lr)

    grid = torch.linspace(-5, 5, 401, dtype=torch.float64).unsqueeze(1)
    with torch.no_grad():
        curves = {"f1": f1(grid), "f2": f2(grid), "LAFTR": laftr_outputs(f1, f2, grid)}
    curves["NTK"] = ntk_outputs(f1, f2, grid).detach()
    task1 = (grid >= -4) & (grid <= -1)

    def mse(a: Tensor, b: Tensor, mask: Tensor | None = None) -> float:
        d = (a - b).pow(2)
        return float(d[mask].mean() if mask is not None else d.mean())

    approx = {name: {"mse_vs_f2_all": mse(curves[name], curves["f2"]),
                     "mse_vs_f2_task1_range": mse(curves[name], curves["f2"], task1)}
              for name in ("LAFTR", "NTK")}

    runs: dict[str, nn.Module] = {"none": f2}
    for name, make in REGULARIZERS.items():
        # every regularizer sees only task 1's data at θ1
        est = make().fit(f1, [(data.x1, data.y1)])
        model = copy.deepcopy(f1)
        fit_regression(model, data.x2, data.y2, steps=cfg.steps, lr=cfg.lr,
                       penalty=est.distance, lam=cfg.lam)
        runs[name] = model
    with torch.no_grad():
        errors = {name: {"task1_mse": mse(m(data.x1), data.y1),
                         "task2_mse": mse(m(data.x2), data.y2)} for name, m in runs.items()}
        errors["f1 (before task 2)"] = {"task1_mse": mse(f1(data.x1), data.y1),
                                        "task2_mse": mse(f1(data.x2), data.y2)}
        run_curves = {name: m(grid) for name, m in runs.items()}
    return {"config": cfg.__dict__, "data": data, "grid": grid, "curves": curves,
            "approximation": approx, "runs": run_curves, "errors": errors}


def toy_plot(result: dict[str, Any], path: Path) -> None:
    """The two-panel figure (paper Fig. 1)."""
    plt = pyplot()
    data, grid = result["data"], result["grid"].squeeze(1).numpy()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax in axes:
        ax.scatter(data.x1.squeeze(1), data.y1.squeeze(1), s=12, color="tab:blue",
                   label="task 1 data")
        ax.scatter(data.x2.squeeze(1), data.y2.squeeze(1), s=12, color="goldenrod",
                   label="task 2 data")
    c = result["curves"]
    styles = {"f1": ("tab:blue", "-"), "f2": ("goldenrod", "-"), "LAFTR": ("tab:green", "--"),
              "NTK": ("tab:red", ":")}
    labels = {"f1": "f1 (after task 1)", "f2": "f2 (after task 2)",
              "LAFTR": "LAFTR approx. of f2 around f1", "NTK": "NTK approx. of f2 around f1"}
    for name, (colour, style) in styles.items():
        axes[0].plot(grid, c[name].squeeze(1).numpy(), style, color=colour, lw=2,
                     label=labels[name])
    axes[0].set_title("f1, f2 and their linearizations")
    colours = {"none": "goldenrod", "BGLN-D": "tab:green", "EWC": "tab:purple",
               "NTK": "tab:red"}
    for name, out in result["runs"].items():
        e = result["errors"][name]
        axes[1].plot(grid, out.squeeze(1).numpy(), color=colours.get(name, "k"), lw=2,
                     label=f"{'unregularized' if name == 'none' else name} "
                           f"(task-1 MSE {e['task1_mse']:.3f})")
    axes[1].set_title(f"task 2 trained with λ·FSD estimate (λ = {result['config']['lam']:g})")
    for ax in axes:
        ax.set_xlabel("x")
        ax.set_ylim(-3, 3)
        ax.legend(fontsize=8, loc="lower left")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("y")
    fig.tight_layout()
    write_figure(fig, path, dpi=130)  # atomically: a full disk leaves no half PNG


def format_toy(result: dict[str, Any]) -> str:
    """Markdown tables: approximation errors and the regularized runs' task errors."""
    lines = ["| approximation of f2 around f1 | MSE vs f2 on [−5, 5] | MSE vs f2 on task-1 range |",
             "|---|---:|---:|"]
    for name, a in result["approximation"].items():
        lines.append(f"| {name} | {a['mse_vs_f2_all']:.4g} | {a['mse_vs_f2_task1_range']:.4g} |")
    lines += ["", "| task-2 training | task-1 MSE | task-2 MSE |", "|---|---:|---:|"]
    for name, e in result["errors"].items():
        lines.append(f"| {'unregularized' if name == 'none' else name} | "
                     f"{e['task1_mse']:.4f} | {e['task2_mse']:.4f} |")
    return "\n".join(lines)


def seed_table(config: ToyConfig, seeds: list[int],
               done: dict[int, dict[str, Any]] | None = None) -> tuple[str, dict[int, Any]]:
    """Re-run the toy for other seeds (data and initialization).

    Tabulates the task-1 MSE after task 2 per regularizer and the approximations' MSE vs f2,
    as markdown (:func:`format_seed_table`) and as a dict. ``done`` maps seeds already run to
    their :func:`run_toy` results (not re-run).
    """
    per_seed: dict[int, Any] = {}
    for seed in seeds:
        result = (done or {}).get(seed) or run_toy(ToyConfig(**{**config.__dict__,
                                                                 "seed": seed}))
        per_seed[seed] = {"errors": result["errors"], "approximation": result["approximation"]}
    return format_seed_table(per_seed), per_seed


def format_seed_table(per_seed: dict[Any, Any]) -> str:
    """Markdown: per seed, each regularizer's task-1 MSE and the approximations' MSE vs f2."""
    names = [n for n in next(iter(per_seed.values()))["errors"] if n != "f1 (before task 2)"]
    lines = ["| seed | " + " | ".join(f"{'unregularized' if n == 'none' else n} task-1 MSE"
                                      for n in names)
             + " | LAFTR MSE vs f2 | NTK MSE vs f2 |", "|---:|" + "---:|" * (len(names) + 2)]
    for seed, r in per_seed.items():
        lines.append(f"| {seed} | " + " | ".join(f"{r['errors'][n]['task1_mse']:.3f}"
                                                 for n in names)
                     + f" | {r['approximation']['LAFTR']['mse_vs_f2_all']:.3f}"
                     + f" | {r['approximation']['NTK']['mse_vs_f2_all']:.3f} |")
    return "\n".join(lines)


def toy_markdown(saved: dict[str, Any]) -> str:
    """toy.md from what toy.json holds: :func:`format_toy`, then the seeds' table if any."""
    text = format_toy(saved)
    if "seeds" in saved:
        text += (f"\n\nAcross seeds (λ = {saved['config']['lam']:g}):\n\n"
                 + format_seed_table(saved["seeds"]))
    return text + "\n"


#: the kind of folder ``fsd toy`` writes (see :func:`fsd_experiments.io.claim_directory`)
TOY_FOLDER = "toy run"
#: what ``fsd toy`` writes into its folder (an earlier fsd's folder holds only these)
TOY_FILES = ("toy.png", "toy.md", "toy.json")


def _cmd_toy(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    cfg = ToyConfig.from_args(args)
    # a folder that is not fsd's to write is refused before the training
    out = claim_output(args.out, TOY_FOLDER, earlier_output(lambda name: name in TOY_FILES),
                       TOY_FILES)
    result = run_toy(cfg)
    toy_plot(result, out / "toy.png")
    saved = {k: result[k] for k in ("config", "approximation", "errors")}
    if args.seeds > 1:
        _, saved["seeds"] = seed_table(cfg, [args.seed + k for k in range(args.seeds)],
                                       done={args.seed: result})
    text = toy_markdown(saved)
    atomic_write_text(out / "toy.md", text)
    write_json(out / "toy.json", versioned(saved, TOY_SCHEMA), indent=1)
    print(text, end="")
    print(f"wrote {out / 'toy.png'}, toy.md and toy.json")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``fsd toy`` on the ``fsd`` command's subparsers."""
    p = subparsers.add_parser("toy", help="the 1-D two-task regression figure (paper Fig. 1)")
    p.add_argument("--out", type=argtypes.output_dir, required=True,
                   help="output folder (toy.png, toy.md, toy.json)")
    p.add_argument("--width", type=argtypes.width, default=64)
    p.add_argument("--depth", type=argtypes.depth, default=1, help="hidden layers (default 1)")
    p.add_argument("--steps", type=argtypes.steps, default=2000, help="Adam steps per task")
    p.add_argument("--lam", type=argtypes.weight, default=10.0, help="regularization weight")
    p.add_argument("--seed", type=argtypes.seed, default=0)
    p.add_argument("--seeds", type=argtypes.repeats, default=3,
                   help="also tabulate seeds seed..seed+K-1 (figure: first seed; default 3)")
    add_threads_option(p)
    p.set_defaults(func=_cmd_toy)
