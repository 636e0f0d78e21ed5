"""Old code against new, bit for bit: distances, gradients and stored summaries.

Run each checkout on the same cases, then compare (a refactor must change no bit):

    PYTHONPATH=OLD/src .venv/bin/python benchmarks/bit_identity.py --save old.pt
    PYTHONPATH=NEW/src .venv/bin/python benchmarks/bit_identity.py --save new.pt
    .venv/bin/python benchmarks/bit_identity.py --compare old.pt new.pt

Cases (float32 and float64, CPU, 1 thread): every BGLN-D evaluator — Algorithm 2 on an MLP
chain (full, diagonal and low-rank covariances, class-wise, layer-wise reference, an output
slice), on a CNN chain with BatchNorm and max-pools; exact moments on the chain and on a
residual graph; the corrected recursion and its two ablations — plus BGLN-S and LAFTR on the
chain and the graph, and :class:`fsd.SummarySet` batches of three summaries (Algorithm 2 and
exact moments, one class-wise). Each case stores the distance at a moved model, its gradient
with respect to every parameter and the summary's tensors; ``--compare`` prints the cases
that differ in any bit and exits 1 if one does.
"""

from __future__ import annotations

import argparse
import copy
import sys
from typing import Any, Callable

import torch
from torch import nn

import fsd


class Residual(nn.Module):
    """6 → 8 → (+ ReLU(8 → 8)) → 3."""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.hidden, self.out = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.inp(x))
        return self.out(h + torch.relu(self.hidden(h)))


def _mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 4))


def _cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                         nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                         nn.Linear(16, 5), nn.ReLU(), nn.Linear(5, 3))


def _data(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> list:
    gen = torch.Generator().manual_seed(seed)
    batches = []
    for _ in range(8):
        y = torch.randint(0, 3, (16,), generator=gen)
        x = torch.randn(16, *shape, generator=gen, dtype=dtype) + y.view(-1, *[1] * len(shape))
        batches.append((x, y))
    return batches


def _moved(model: nn.Module, seed: int) -> nn.Module:
    other = copy.deepcopy(model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return other


def _case(build: Callable[[], nn.Module], shape: tuple[int, ...], dtype: torch.dtype,
          estimators: list[Any], seed: int, batch: bool = False, **fit: Any
          ) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = build().to(dtype).eval()
    fitted = [e.fit(model, _data(shape, dtype, seed + i), progress=False, **fit)
              for i, e in enumerate(estimators)]
    moved = _moved(model, seed + 100)
    target = fsd.combine(fitted) if batch else fitted[0]
    value = target.distance(moved)
    value.backward()
    out: dict[str, Any] = {"distance": value.detach(),
                           "grad": {n: p.grad.clone() for n, p in moved.named_parameters()}}
    for i, e in enumerate(fitted):
        out[f"summary{i}"] = {k: v.clone() for k, v in e._stored.items()}
    return out


def cases() -> dict[str, dict[str, Any]]:
    """Every case, by name."""
    try:
        from fsd_experiments.ablations import BGLNVariant
    except ImportError:  # the layouts before the ablations left the library
        try:
            from fsd.estimators.variants import BGLNVariant  # type: ignore[no-redef]
        except ImportError:  # before fsd.moments.evaluators
            from fsd.moments.corrected import BGLNVariant  # type: ignore[no-redef]
    results: dict[str, dict[str, Any]] = {}
    flat, image = (6,), (2, 8, 8)
    for dtype in (torch.float32, torch.float64):
        tag = str(dtype).split(".")[-1]

        def d(**k: Any) -> fsd.BGLN:
            return fsd.BGLN(deterministic=True, **k)
        chain = {
            "alg2-full": lambda: d(covariance="full"),
            "alg2-diag": lambda: d(covariance="diag"),
            "alg2-lowrank": lambda: d(covariance="lowrank", rank=3),
            "alg2-classwise": lambda: d(covariance="full", classwise=True),
            "alg2-layerwise": lambda: d(covariance="full", reference="layerwise"),
            "exact-full": lambda: d(covariance="full", moments="exact"),
            "exact-lowrank-classwise": lambda: d(covariance="lowrank", rank=3,
                                                 moments="exact", classwise=True),
            "corrected": lambda: BGLNVariant(moments="corrected", covariance="full"),
            "no-gate-variance": lambda: BGLNVariant(moments="no-gate-variance",
                                                    covariance="full"),
            "no-cross-covariance": lambda: BGLNVariant(moments="no-cross-covariance",
                                                       covariance="full"),
            "bgln-s": lambda: fsd.BGLN(num_samples=16),
            "laftr": lambda: fsd.LAFTR(),
        }
        for name, make in chain.items():
            results[f"mlp/{name}/{tag}"] = _case(_mlp, flat, dtype, [make()], 1)
        results[f"mlp/alg2-outputs/{tag}"] = _case(
            _mlp, flat, dtype, [d(covariance="full")], 2, outputs=slice(1, 3))
        results[f"cnn/alg2/{tag}"] = _case(_cnn, image, dtype, [d(covariance="lowrank", rank=4)],
                                           3)
        results[f"cnn/alg2-classwise/{tag}"] = _case(
            _cnn, image, dtype, [d(covariance="diag", classwise=True)], 4)
        results[f"graph/exact/{tag}"] = _case(Residual, flat, dtype,
                                              [d(covariance="full", moments="exact")], 5)
        results[f"graph/bgln-s/{tag}"] = _case(Residual, flat, dtype, [fsd.BGLN(num_samples=16)],
                                               6)
        results[f"graph/laftr/{tag}"] = _case(Residual, flat, dtype, [fsd.LAFTR()], 7)
        results[f"set/alg2/{tag}"] = _case(
            _mlp, flat, dtype, [d(covariance="lowrank", rank=3), d(covariance="lowrank", rank=2),
                                d(covariance="lowrank", rank=3, classwise=True)], 8, batch=True)
        results[f"set/alg2-same-counts/{tag}"] = _case(
            _mlp, flat, dtype, [d(covariance="full"), d(covariance="full")], 9, batch=True)
        results[f"set/exact/{tag}"] = _case(
            _mlp, flat, dtype, [d(covariance="full", moments="exact"),
                                d(covariance="full", moments="exact", classwise=True),
                                d(covariance="full", moments="exact")], 10, batch=True)
    return results


def _differences(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict):
        if not isinstance(b, dict) or set(a) != set(b):
            return [f"{where}: keys {sorted(a) if isinstance(a, dict) else a} vs "
                    f"{sorted(b) if isinstance(b, dict) else b}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{where}/{k}")]
    if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
        return [f"{where}: differs (max |Δ| {float((a.double() - b.double()).abs().max()):.3g})"
                if a.shape == b.shape else f"{where}: shape {tuple(a.shape)} vs {tuple(b.shape)}"]
    return []


def main() -> int:
    """Save the cases, or compare two saved files."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", help="write every case's tensors here")
    parser.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.save:
        torch.save(cases(), args.save)
        print(f"wrote {args.save}")
    if args.compare:
        old, new = (torch.load(p, weights_only=True) for p in args.compare)
        differences = _differences(old, new, "")
        for line in differences:
            print(line)
        print(f"{len(old)} cases, {len(differences)} differences")
        return 1 if differences else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
