"""BGLN-D on the paper's CIFAR CNN: one penalty's cost beside BGLN-S's and a plain step's.

Run:  .venv/bin/python benchmarks/conv_moments.py [--threads 1] [--repeats 5] [--device cpu]

Model: the Split CIFAR-100 CNN (``fsd_experiments.models.cifar_cnn``: conv 32-32, max-pool,
conv 64-64, max-pool, FC 512, six 10-way heads; P = 1,276,508) at initialisation, float32.
Inputs: 2,000 random 3×32×32 images with a rank-64 covariance plus noise — CIFAR is not on
this machine, and the cost depends on the shapes, not the values. Prints, side by side in
one process, medians of distance + backward for BGLN-D (Algorithm 2 on the CNN,
:mod:`fsd.moments.algorithm2_conv`) with low-rank (r = 32, 64) and diagonal input covariances, over
one head (10 logits) and all 60; BGLN-S with 200 samples; and a plain training step (forward,
cross-entropy, backward) at batch 512 (the paper's) and 128. Peak memory of one call after a first
(warm) one, above what was allocated before it (:func:`peak_mib`).
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import os
import platform

import torch
from torch import nn

import fsd
from fsd_experiments.devices import device_name
from fsd_experiments.models import cifar_cnn
from fsd_experiments.printed_report import printed_report
from penalty import median_ms, perturbed

SHAPE = (3, 32, 32)


def _images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    d = 3 * 32 * 32
    basis = torch.randn(d, 64, generator=g) / 8
    return (torch.randn(n, 64, generator=g) @ basis.T
            + 0.3 * torch.randn(n, d, generator=g)).view(n, *SHAPE)


def _model(device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return cifar_cnn(heads=6).to(device).eval()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def peak_mib(fn, device: torch.device) -> float:
    """Memory one call of ``fn`` needs beyond what is allocated before it, in MiB.

    CUDA: ``max_memory_allocated``. CPU (Linux): freed heap memory is returned to the system
    (``malloc_trim``), the peak resident set size is reset (``/proc/self/clear_refs``), and
    the new peak is compared with the resident size before the call.
    """
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        fn()
        torch.cuda.synchronize(device)
        return (torch.cuda.max_memory_allocated(device) - before) / 2**20
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")
    before = _status_kib("VmRSS")
    fn()
    return (_status_kib("VmHWM") - before) / 1024


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None,
                        help="also write what is printed to OUT.md and its tables to OUT.json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    with printed_report(args.out, device=device_name(device)):
        run(args, device)


def run(args: argparse.Namespace, device: torch.device) -> None:
    print(f"# {platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{torch.get_num_threads()} thread(s), device {device}")
    model = _model(device)
    moved = perturbed(model, 1e-2, seed=1)
    data = _images(2000, 2).to(device)
    variants = {
        "BGLN-D lowrank r=32, head": dict(deterministic=True, covariance="lowrank", rank=32,
                                         outputs=range(10)),
        "BGLN-D lowrank r=64, head": dict(deterministic=True, covariance="lowrank", rank=64,
                                         outputs=range(10)),
        "BGLN-D diag, head": dict(deterministic=True, covariance="diag", outputs=range(10)),
        "BGLN-D lowrank r=32, 60 logits": dict(deterministic=True, covariance="lowrank",
                                              rank=32),
        "BGLN-S 200 samples, r=32": dict(covariance="lowrank", rank=32, num_samples=200),
    }
    rows = []
    for name, options in variants.items():
        outputs = options.pop("outputs", None)
        estimator = fsd.BGLN(**options).fit(model, data, outputs=outputs, progress=False)

        def call(e=estimator) -> None:
            e.distance(moved).backward()

        ms = median_ms(call, args.repeats, warmup=1)
        rows.append((name, ms, peak_mib(call, device), estimator.nbytes / 2**20))
    for batch in (512, 128):
        train = _model(device).train()
        x, y = _images(batch, 3).to(device), torch.randint(0, 60, (batch,)).to(device)

        def step(m=train, x=x, y=y) -> None:
            nn.functional.cross_entropy(m(x), y).backward()

        rows.append((f"plain step, batch {batch}", median_ms(step, args.repeats, warmup=1),
                     peak_mib(step, device), 0.0))
    print("\n| call | ms (median) | peak MiB | summary MiB |\n|---|---:|---:|---:|")
    for name, ms, peak, size in rows:
        print(f"| {name} | {ms:,.1f} | {peak:,.1f} | {size:.2f} |")


if __name__ == "__main__":
    main()
