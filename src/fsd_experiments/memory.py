"""``fsd memory``: the memory-cost formulas of the paper's "Memory Cost Analysis" appendix.

Counts are *numbers stored per task* (the paper's unit), with

- P: parameters, p_l: parameters of layer l (for OSLA), A: activations (ReLU outputs of
  one example, i.e. the Bernoulli means BGLN keeps), d: input dimension, N: coreset size,
  C: classes; a_l, g_l: the sides of layer l's Kronecker factors A_l, G_l (for K-FAC).

:func:`memory_gain_table` recomputes the paper's percentage-reduction table
100·(B − L)/B for LAFTR (L = P + d + d²) and LAFTR (coreset) (L = P + Nd) against the
nonparametric baseline B = 2P + Nd + C²N² (FROMP / S-FSVI), for the Split CIFAR100 CNN of
:func:`cifar_cnn` (P = 1,276,508). :func:`measured_counts` fits our estimators and reports
their ``nbytes`` (bytes, so divided by the element size) next to the formulas.
"""

from __future__ import annotations

import argparse
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from torch import nn

from fsd.estimators.base import Estimator

from . import argtypes
from .argtypes import add_threads_option, apply_threads
from .io import atomic_write_text, claim_output, earlier_output, named, versioned, write_json
from .models import cifar_cnn, mlp
from .presets import PRESETS

#: the paper's memory-gain table: (C, N) -> (LAFTR at d = 1000, 2000, 3000; LAFTR (coreset))
PAPER_MEMORY_GAIN: dict[tuple[int, int], tuple[tuple[float, ...], tuple[float, ...]]] = {
    (10, 200): ((66.27, 24.08, -43.71), (78.14, 75.89, 73.77)),
    (10, 250): ((74.84, 43.26, -7.60), (83.14, 80.90, 78.79)),
    (20, 200): ((87.86, 72.15, 46.33), (92.13, 91.15, 90.20)),
    (20, 250): ((91.81, 81.18, 63.68), (94.51, 93.67, 92.84)),
    (50, 200): ((97.78, 94.87, 90.03), (98.56, 98.37, 98.18)),
    (50, 250): ((98.57, 96.69, 93.56), (99.04, 98.88, 98.73)),
}
GAIN_DIMS: tuple[int, ...] = (1000, 2000, 3000)
#: the layout of memory_<arch>.json
MEMORY_SCHEMA = 1
#: parameters of :func:`cifar_cnn` (6 heads of 10): the P that reproduces the paper's table
CIFAR_CNN_P = 1_276_508


@dataclass
class Architecture:
    """The counts the formulas need for one network and input shape."""

    P: int
    A: int
    d: int
    layer_params: list[int] = field(default_factory=list)
    #: (a_l, g_l) per nn.Linear / nn.Conv2d: fan-in + 1 (the bias row ā = [a; 1]) and fan-out
    kfac_factors: list[tuple[int, int]] = field(default_factory=list)

    @property
    def osla_blocks(self) -> int:
        """Σ_l p_l², the block-diagonal Fisher of OSLA."""
        return sum(p * p for p in self.layer_params)

    @property
    def kfac_numbers(self) -> int:
        """Σ_l (a_l² + g_l²), the Kronecker factors ``fsd.KFAC`` stores."""
        return sum(a * a + g * g for a, g in self.kfac_factors)


def count_architecture(model: nn.Module, input_shape: Sequence[int]) -> Architecture:
    """P, A (ReLU outputs per example), d = prod(input_shape), per-layer p_l of ``model``.

    A is measured with one forward pass of a zero input through forward hooks on every
    ``nn.ReLU``; p_l counts each module's own (non-recursive) parameters; the K-FAC factor
    sides are read from every ``nn.Linear`` and ``nn.Conv2d``.
    """
    layer_params = [n for m in model.modules()
                    if (n := sum(p.numel() for p in m.parameters(recurse=False)))]
    kfac_factors = [(m.weight[0].numel() + 1, m.weight.shape[0]) for m in model.modules()
                    if isinstance(m, (nn.Linear, nn.Conv2d))]
    activations: list[int] = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: activations.append(out[0].numel()))
             for m in model.modules() if isinstance(m, nn.ReLU)]
    try:
        dtype = next(model.parameters()).dtype
        with torch.no_grad():
            model(torch.zeros(1, *input_shape, dtype=dtype))
    finally:
        for h in hooks:
            h.remove()
    return Architecture(P=sum(layer_params), A=sum(activations), d=math.prod(input_shape),
                        layer_params=layer_params, kfac_factors=kfac_factors)


def memory_costs(P: int, A: int, d: int, N: int, C: int,
                 layer_params: Sequence[int] | None = None,
                 kfac_factors: Sequence[tuple[int, int]] | None = None) -> dict[str, int]:
    """Numbers stored per task by each method (the paper's memory-cost column).

    OSLA needs ``layer_params`` (the paper's count, a dense p_l × p_l block per layer);
    without it OSLA is left out. ``kfac_factors`` ((a_l, g_l) per layer) adds the row of what
    ``fsd.KFAC``, our OSLA, stores: θ0 and the factors A_l (a_l²) and G_l (g_l²).
    """
    costs = {
        "VCL (coreset)": 2 * P + N * d,
        "VAR-GP (coreset)": 2 * P + N * d + C * C * N * N,
        "FROMP (coreset)": 2 * P + N * d + C * C * N * N,
        "S-FSVI (coreset)": 2 * P + N * d + C * C * N * N,
        "NTK (coreset)": 2 * P + N * d,
        "LAFTR (coreset)": P + N * d,
        "BGLN-S (coreset)": P + A + N * d,
        "EWC": 2 * P,
        "VCL": 2 * P,
        "LAFTR": P + d + d * d,
        "LAFTR-CW": P + C * (d + d * d),
        "BGLN-S / BGLN-D": P + A + d + d * d,
        "BGLN-S-CW / BGLN-D-CW": P + C * (A + d + d * d),
        # the appendix prints "P + A 2d": mean and variance, d numbers each
        "BGLN-S-Var / BGLN-D-Var": P + A + 2 * d,
    }
    if layer_params is not None:
        costs["OSLA"] = P + sum(p * p for p in layer_params)
    if kfac_factors is not None:
        costs["OSLA (K-FAC factors)"] = P + sum(a * a + g * g for a, g in kfac_factors)
    return costs


def percentage_reduction(baseline: float, ours: float) -> float:
    """100 · (B − L) / B: how much less memory than the baseline (negative: more)."""
    return 100.0 * (baseline - ours) / baseline


def memory_gain_table(P: int = CIFAR_CNN_P, Cs: Sequence[int] = (10, 20, 50),
                      Ns: Sequence[int] = (200, 250), ds: Sequence[int] = GAIN_DIMS
                      ) -> list[dict[str, Any]]:
    """The paper's percentage-reduction table for a network with P parameters.

    Rows (C, N) with, per d, the reduction of LAFTR (P + d + d²) and LAFTR (coreset)
    (P + Nd) relative to B = 2P + Nd + C²N², and the paper's value where it has one (only
    for the paper's network, P = :data:`CIFAR_CNN_P`).
    """
    rows = []
    for C in Cs:
        for N in Ns:
            laftr, coreset = [], []
            for d in ds:
                costs = memory_costs(P, 0, d, N, C)
                base = costs["FROMP (coreset)"]
                laftr.append(percentage_reduction(base, costs["LAFTR"]))
                coreset.append(percentage_reduction(base, costs["LAFTR (coreset)"]))
            paper = PAPER_MEMORY_GAIN.get((C, N)) \
                if tuple(ds) == GAIN_DIMS and P == CIFAR_CNN_P else None
            rows.append({"C": C, "N": N, "d": list(ds), "laftr": laftr,
                         "laftr_coreset": coreset,
                         "paper_laftr": list(paper[0]) if paper else None,
                         "paper_laftr_coreset": list(paper[1]) if paper else None})
    return rows


@dataclass
class MeasuredRow:
    """One fitted summary: the paper's formula next to what we store."""

    estimator: str
    formula: str
    formula_count: int
    nbytes: int
    measured_count: float
    note: str


def measured_counts(model: nn.Module, input_shape: Sequence[int], N: int, C: int, *,
                    classwise: bool = True, deterministic: bool = True,
                    seed: int = 0) -> list[MeasuredRow]:
    """Fit our estimators on random data of the given shape and report ``nbytes``.

    The data's values do not change the sizes, so Gaussian noise with C balanced labels
    stands in. ``measured_count`` = ``nbytes`` / element size of the model's dtype.
    BGLN-D rows are skipped for models it does not support (``deterministic=False``), the
    class-wise rows with ``classwise=False`` (C full covariances can be large).
    """
    arch = count_architecture(model, input_shape)
    P, A, d = arch.P, arch.A, arch.d
    dtype = next(model.parameters()).dtype
    element = torch.tensor([], dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(seed)
    n = max(N, 2 * C)
    x = torch.randn(n, *input_shape, generator=generator, dtype=dtype)
    y = torch.arange(n) % C
    data = [(x, y)]
    costs = memory_costs(P, A, d, N, C, kfac_factors=arch.kfac_factors)

    def fitted(method: str) -> Callable[[], Estimator]:
        preset = PRESETS[method]
        if method in ("ewc", "osla"):  # the curvature's size does not depend on how many
            # examples it averages: fit on a few
            options = {"chunk_size": 1} if method == "ewc" else {}
            return lambda: preset.make(**options).fit(model, [(x[:2], y[:2])])
        options = {"coreset_size": N} if preset.coreset else {}
        return lambda: preset.make(**options).fit(model, data)

    # (method, formula key of memory_costs, formula, note)
    rows_wanted: list[tuple[str, str, str, str]] = [
        ("ntk", "NTK (coreset)", "2P + Nd",
         "θ0 + coreset + f(x, θ0) on it (N·K); J(θ−θ0) is recomputed by forward-mode "
         "AD, not stored"),
        ("laftr-coreset", "LAFTR (coreset)", "P + Nd", "θ0 + coreset"),
        ("bgln-s-coreset", "BGLN-S (coreset)", "P + A + Nd", "+1 mixture weight"),
        ("laftr", "LAFTR", "P + d + d²",
         "+1 mixture weight; full d×d covariance stored (not d(d+1)/2)"),
        ("bgln-s", "BGLN-S / BGLN-D", "P + A + d + d²", "+1 mixture weight"),
        ("bgln-s-var", "BGLN-S-Var / BGLN-D-Var", "P + A + 2d", "+1 mixture weight"),
    ]
    if deterministic:
        rows_wanted.append(("bgln-d", "BGLN-S / BGLN-D", "P + A + d + d²", "+1 mixture weight"))
    if classwise:
        rows_wanted.append(("bgln-s-cw", "BGLN-S-CW / BGLN-D-CW", "P + C(A + d + d²)",
                            "+C mixture weights"))
    # EWC and KFAC also keep f(x, θ0) on 4 synthetic inputs, 4(d + K) numbers, by which
    # distance tells another function with the same parameters (fsd.estimators.probe)
    rows_wanted.append(("ewc", "EWC", "2P", "θ0 + diagonal Fisher; + 4(d + K) for the check "
                        "of the function"))
    rows_wanted.append(("osla", "OSLA (K-FAC factors)", "P + Σ (a_l² + g_l²)",
                        "θ0 + A_l, G_l per layer; our formula: the paper counts P + Σ p_l²; "
                        "+ 4(d + K) for the check of the function"))
    specs = [(PRESETS[m].title, key, formula, fitted(m), note)
             for m, key, formula, note in rows_wanted]
    rows = []
    for name, key, formula, make, note in specs:
        est = make()
        rows.append(MeasuredRow(name, formula, costs[key], est.nbytes, est.nbytes / element,
                                note))
        del est
    return rows


# ----- formatting -------------------------------------------------------------------------
def format_costs(arch: Architecture, N: int, C: int) -> str:
    """Markdown table of every formula evaluated for ``arch``."""
    costs = memory_costs(arch.P, arch.A, arch.d, N, C, arch.layer_params, arch.kfac_factors)
    lines = [f"P = {arch.P:,}, A = {arch.A:,}, d = {arch.d:,}, N = {N}, C = {C}, "
             f"Σ p_l² = {arch.osla_blocks:,}, Σ (a_l² + g_l²) = {arch.kfac_numbers:,}\n",
             "| method | numbers stored per task | MB at float32 |", "|---|---:|---:|"]
    for name, count in costs.items():
        lines.append(f"| {name} | {count:,} | {count * 4 / 1e6:.2f} |")
    return "\n".join(lines)


def format_gain_table(rows: list[dict[str, Any]]) -> str:
    """Markdown: our percentage reductions with the paper's in parentheses where they differ."""
    ds = rows[0]["d"]
    head = ("| C | N | " + " | ".join(f"LAFTR d={d}" for d in ds) + " | "
            + " | ".join(f"LAFTR (coreset) d={d}" for d in ds) + " |")
    lines = [head, "|---:|---:|" + "---:|" * (2 * len(ds))]
    max_diff = 0.0
    for r in rows:
        cells = []
        for ours_key, paper_key in (("laftr", "paper_laftr"), ("laftr_coreset",
                                                               "paper_laftr_coreset")):
            for i, v in enumerate(r[ours_key]):
                paper = r[paper_key][i] if r[paper_key] else None
                if paper is not None:
                    max_diff = max(max_diff, abs(round(v, 2) - paper))
                same = paper is None or abs(round(v, 2) - paper) < 0.005
                cells.append(f"{v:.2f}" if same else f"{v:.2f} (paper {paper:.2f})")
        lines.append(f"| {r['C']} | {r['N']} | " + " | ".join(cells) + " |")
    if rows[0]["paper_laftr"] is not None:
        lines.append(f"\nLargest difference from the paper's table (after rounding to 2 "
                     f"decimals): {max_diff:.2f} percentage points.")
    return "\n".join(lines)


def format_measured(rows: list[MeasuredRow]) -> str:
    """Markdown: formula count vs measured ``nbytes`` / element size."""
    lines = ["| estimator | paper formula | formula count | our nbytes | nbytes / 4 "
             "(numbers) | measured − formula | note |", "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| {r.estimator} | {r.formula} | {r.formula_count:,} | {r.nbytes:,} | "
                     f"{r.measured_count:,.0f} | {r.measured_count - r.formula_count:+,.0f} | "
                     f"{r.note} |")
    return "\n".join(lines)


def memory_markdown(result: dict[str, Any], arch_name: str) -> str:
    """memory_<arch>.md from what memory_<arch>.json holds (``arch_name``: the file's arch)."""
    raw = result["architecture"]
    arch = Architecture(P=raw["P"], A=raw["A"], d=raw["d"], layer_params=list(raw["layer_params"]),
                        kfac_factors=[(a, g) for a, g in raw["kfac_factors"]])
    N, C = result["N"], result["C"]
    sections = [f"## Memory formulas: {arch_name}\n", format_costs(arch, N, C), "",
                f"## Percentage reduction vs B = 2P + Nd + C²N², Split CIFAR100 CNN "
                f"(P = {CIFAR_CNN_P:,}; paper's value in parentheses where it differs)\n",
                format_gain_table(result["gain_table"]), ""]
    if arch.P != CIFAR_CNN_P:  # the same table for the chosen network (no paper values)
        sections += [f"## The same reduction table for {arch_name} (P = {arch.P:,})\n",
                     format_gain_table(result["gain_table_this_arch"]), ""]
    if "measured" in result:
        sections += [f"## Measured summaries ({arch_name}, float32, N = {N}, C = {C})\n",
                     format_measured([MeasuredRow(**r) for r in result["measured"]]), ""]
    return "\n".join(sections) + "\n"


# ----- command line -------------------------------------------------------------------------
ARCHITECTURES: dict[str, tuple[Callable[[], nn.Module], tuple[int, ...]]] = {
    "cifar-cnn": (cifar_cnn, (3, 32, 32)),
    "mnist-mlp": (lambda: mlp(784, 100, 2, 10), (784,)),
}


#: the kind of folder ``fsd memory --out`` writes (see :func:`fsd_experiments.io.claim_directory`)
MEMORY_FOLDER = "memory run"


def _cmd_memory(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    if args.out:  # a folder that is not fsd's to write is refused before the counting
        # an earlier fsd memory's folder holds the tables of one or more architectures
        arches = "|".join(map(re.escape, ARCHITECTURES))
        earlier = earlier_output(named(rf"memory_(?:{arches})\.(?:md|json)"))
        claim_output(args.out, MEMORY_FOLDER, earlier,
                     [f"memory_{args.arch}.md", f"memory_{args.arch}.json"])
    model_fn, shape = ARCHITECTURES[args.arch]
    model = model_fn()
    if args.input_shape:
        shape = args.input_shape
    try:
        arch = count_architecture(model, shape)
    except RuntimeError as error:  # a shape the network cannot run on: one line, not torch's
        raise ValueError(f"--input-shape {','.join(map(str, shape))}: {args.arch} cannot run on "
                         f"inputs of this shape ({str(error).splitlines()[0]})") from None
    arch = Architecture(P=args.P if args.P is not None else arch.P,
                        A=args.A if args.A is not None else arch.A,
                        d=args.d if args.d is not None else arch.d,
                        layer_params=arch.layer_params, kfac_factors=arch.kfac_factors)
    result: dict[str, Any] = {"architecture": asdict(arch), "N": args.N, "C": args.C,
                              "costs": memory_costs(arch.P, arch.A, arch.d, args.N, args.C,
                                                    arch.layer_params, arch.kfac_factors),
                              "gain_table": memory_gain_table(CIFAR_CNN_P),
                              "gain_table_this_arch": memory_gain_table(arch.P)}
    if args.measure:
        rows = measured_counts(model, shape, args.N, args.C,
                               classwise=not args.skip_classwise,
                               deterministic=args.arch != "cifar-cnn")
        result["measured"] = [asdict(r) for r in rows]
    text = memory_markdown(result, args.arch)
    print(text, end="")
    if args.out:
        out = Path(args.out)
        atomic_write_text(out / f"memory_{args.arch}.md", text)
        write_json(out / f"memory_{args.arch}.json", versioned(result, MEMORY_SCHEMA), indent=1)
        print(f"wrote {out / f'memory_{args.arch}.md'} and .json")
    return 0


def add_cli(subparsers: Any) -> None:
    """Register ``fsd memory`` on the ``fsd`` command's subparsers."""
    p = subparsers.add_parser(
        "memory", help="memory-cost formulas, the memory-gain table, measured summary sizes")
    p.add_argument("--arch", choices=sorted(ARCHITECTURES), default="cifar-cnn",
                   help="network whose P, A, d are counted (default: the Split CIFAR100 CNN)")
    p.add_argument("--input-shape", type=argtypes.input_shape, default=None,
                   help="comma-separated, e.g. 3,32,32")
    p.add_argument("--P", type=argtypes.count, default=None, help="override the parameter count")
    p.add_argument("--A", type=argtypes.count, default=None, help="override the activation count")
    p.add_argument("--d", type=argtypes.count, default=None, help="override the data dimension")
    p.add_argument("--N", type=argtypes.coreset, default=200, help="coreset size (default 200)")
    p.add_argument("--C", type=argtypes.classes, default=10, help="classes (default 10)")
    p.add_argument("--no-measure", dest="measure", action="store_false",
                   help="skip fitting the estimators to measure nbytes")
    p.add_argument("--skip-classwise", action="store_true",
                   help="skip the class-wise measured row (C full covariances)")
    add_threads_option(p)
    p.add_argument("--out", type=argtypes.output_dir, default=None,
                   help="also write memory_<arch>.md/.json here")
    p.set_defaults(func=_cmd_memory)
