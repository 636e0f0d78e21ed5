"""The CUDA path: every estimator gives on a GPU what it gives on the CPU.

Skipped where ``torch.cuda.is_available()`` is False (CI has no GPU). Deterministic estimators
are compared in float64 against the CPU value and gradient (tolerance 1e-9 relative); Monte
Carlo ones, whose CUDA random streams differ from the CPU's, against their CPU mean within a
tolerance set from the spread of repeated draws. Also checked: a summary fitted on the GPU
loads on the CPU and gives the same distance, and ``fsd cl`` runs on the GPU and its checkpoint
resumes on the CPU.
"""

from __future__ import annotations

import copy
import os
import statistics
from pathlib import Path

import numpy as np
import pytest
import torch

import fsd
from conftest import labelled_batches, mlp, perturbed
from fsd_experiments import continual

# FSD_TEST_DEVICE=cpu runs these comparisons CPU against CPU (a dry run of the test logic on a
# machine without a GPU); any other accelerator torch knows can be named the same way
DEVICE = os.environ.get("FSD_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE == "cuda" and not torch.cuda.is_available(),
                                reason="no CUDA device")
CUDA = torch.device(DEVICE)

DETERMINISTIC = {
    "BGLN-D paper": lambda: fsd.BGLN(deterministic=True),
    "BGLN-D exact": lambda: fsd.BGLN(deterministic=True, moments="exact"),
    "BGLN-D exact lowrank": lambda: fsd.BGLN(deterministic=True, moments="exact",
                                             covariance="lowrank", rank=3),
    "BGLN-D layerwise": lambda: fsd.BGLN(deterministic=True, reference="layerwise"),
    "BGLN-D diag": lambda: fsd.BGLN(deterministic=True, covariance="diag"),
    "BGLN-D classwise": lambda: fsd.BGLN(deterministic=True, classwise=True),
    "LAFTR coreset (all data)": lambda: fsd.LAFTR(inputs="coreset"),
    "NTK": lambda: fsd.NTK(coreset_size=20),
    "EWC (empirical)": lambda: fsd.EWC(),
    "Exact": lambda: fsd.ExactFSD(),
}

STOCHASTIC = {
    "BGLN-S": lambda seed: fsd.BGLN(num_samples=256, seed=seed),
    "LAFTR gaussian": lambda seed: fsd.LAFTR(inputs="gaussian", num_samples=256, seed=seed),
}


def _problem():
    model = mlp([6, 8, 7, 3])
    data = labelled_batches(64, (6,), classes=3)
    return model, perturbed(model, 0.1, seed=3), data


def _on_cuda(model, data):
    return (copy.deepcopy(model).to(CUDA),
            [(x.to(CUDA), y.to(CUDA)) for x, y in data])


def _value_and_grad(estimator, moved):
    moved.zero_grad()
    value = estimator.distance(moved)
    value.backward()
    grads = torch.cat([p.grad.reshape(-1).cpu() for p in moved.parameters()])
    return float(value.detach()), grads


@pytest.mark.parametrize("name", list(DETERMINISTIC))
def test_deterministic_estimators_agree_with_cpu(name):
    model, moved, data = _problem()
    cpu_value, cpu_grad = _value_and_grad(DETERMINISTIC[name]().fit(model, data), moved)
    model_gpu, data_gpu = _on_cuda(model, data)
    moved_gpu = copy.deepcopy(moved).to(CUDA)
    estimator = DETERMINISTIC[name]().fit(model_gpu, data_gpu)
    value = estimator.distance(moved_gpu)
    assert value.device.type == CUDA.type
    gpu_value, gpu_grad = _value_and_grad(estimator, moved_gpu)
    assert gpu_value == pytest.approx(cpu_value, rel=1e-9, abs=1e-12)
    torch.testing.assert_close(gpu_grad, cpu_grad, rtol=1e-8, atol=1e-12)


@pytest.mark.parametrize("name", list(STOCHASTIC))
def test_monte_carlo_estimators_agree_with_cpu_in_distribution(name):
    model, moved, data = _problem()
    model_gpu, data_gpu = _on_cuda(model, data)
    moved_gpu = copy.deepcopy(moved).to(CUDA)
    with torch.no_grad():
        cpu = [float(STOCHASTIC[name](s).fit(model, data).distance(moved)) for s in range(12)]
        gpu = [float(STOCHASTIC[name](s).fit(model_gpu, data_gpu).distance(moved_gpu))
               for s in range(12)]
    # two means of 12 independent estimates each: 5 standard errors of their difference
    spread = statistics.stdev(cpu + gpu) * (2 / 12) ** 0.5
    assert abs(statistics.mean(gpu) - statistics.mean(cpu)) < 5 * spread + 1e-12


@pytest.mark.parametrize("moments", ["paper", "exact"])
def test_combined_summaries_on_cuda_match_cpu(moments):
    model, moved, data = _problem()
    others = [perturbed(model, 0.05, seed=s) for s in (5, 6, 7)]
    cpu_set = fsd.combine([fsd.BGLN(deterministic=True, moments=moments).fit(m, data)
                           for m in others], [0.5, 1.0, 2.0])
    _, data_gpu = _on_cuda(model, data)
    gpu_set = fsd.combine([fsd.BGLN(deterministic=True, moments=moments).fit(
        copy.deepcopy(m).to(CUDA), data_gpu) for m in others], [0.5, 1.0, 2.0])
    cpu_value, cpu_grad = _value_and_grad(cpu_set, moved)
    gpu_value, gpu_grad = _value_and_grad(gpu_set, copy.deepcopy(moved).to(CUDA))
    assert gpu_value == pytest.approx(cpu_value, rel=1e-9)
    torch.testing.assert_close(gpu_grad, cpu_grad, rtol=1e-8, atol=1e-12)


def test_summary_fitted_on_gpu_loads_on_cpu(tmp_path):
    model, moved, data = _problem()
    model_gpu, data_gpu = _on_cuda(model, data)
    estimator = fsd.BGLN(deterministic=True, moments="exact").fit(model_gpu, data_gpu)
    with torch.no_grad():
        expected = float(estimator.distance(copy.deepcopy(moved).to(CUDA)))
    estimator.save(tmp_path / "summary.fsd")
    loaded = fsd.load(tmp_path / "summary.fsd", map_location="cpu")
    with torch.no_grad():
        assert float(loaded.distance(moved)) == pytest.approx(expected, rel=1e-9)


DATA_DIR = Path(os.environ.get("FSD_DATA_DIR",
                               Path(__file__).resolve().parents[2] / "shared" / "data"))


@pytest.mark.skipif(not (DATA_DIR / "mnist").is_dir(), reason=f"no MNIST under {DATA_DIR}")
@pytest.mark.parametrize("method", ["bgln-d", "bgln-s", "bgln-d-exact", "ewc"])
def test_continual_run_on_cuda_resumes_on_cpu(tmp_path, method):
    tiny = dict(epochs=1, train_subset=200, test_subset=100, tasks=3, num_samples=16)
    results = continual.run_continual("split-mnist", method, [0], tmp_path, data_dir=DATA_DIR,
                                      device=DEVICE, progress=False, plots=False, **tiny)
    matrix = results.accuracy_matrix["0"]
    if CUDA.type == "cuda":
        assert results.device == torch.cuda.get_device_name(CUDA)
    assert len(matrix) == 3
    hp = continual.Hyperparameters.paper("split-mnist", method).with_overrides(**tiny)
    # the finished run's checkpoint (written from CUDA tensors) is read back on the CPU
    again = continual.run_seed("split-mnist", method, hp, 0, tmp_path, str(DATA_DIR),
                               device="cpu", progress=False)
    assert again.matrix == matrix


@pytest.mark.skipif(not (DATA_DIR / "mnist").is_dir(), reason=f"no MNIST under {DATA_DIR}")
def test_mislabeled_detection_on_cuda_scores_as_on_cpu():
    from fsd_experiments import influence
    tiny = dict(n_train=200, pool=30, width=16, epochs=1, pbrf_steps=3, cg_iters=3, cg_data=50,
                bgln_rank=4, data_dir=DATA_DIR, progress=False)
    methods = ["bgln-d", "ewc", "cg", "exact"]
    on_device = influence.run_mislabeled(methods, device=DEVICE, **tiny)
    on_cpu = influence.run_mislabeled(methods, device="cpu", **tiny)
    assert on_device["pool"] == on_cpu["pool"]
    for method in methods:
        cpu_scores = np.asarray(on_cpu["scores"][method])
        # float32 kernels differ between devices: agreement to 1e-3 of the scores' scale
        np.testing.assert_allclose(on_device["scores"][method], cpu_scores, rtol=1e-3,
                                   atol=1e-3 * np.abs(cpu_scores).max(), err_msg=method)
