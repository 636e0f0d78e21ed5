"""Memory-cost formulas on hand-counted networks, the paper's table, measured nbytes."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fsd_experiments
from fsd_experiments.cli import main
from fsd_experiments.memory import (
    CIFAR_CNN_P,
    PAPER_MEMORY_GAIN,
    count_architecture,
    measured_counts,
    memory_costs,
    memory_gain_table,
    percentage_reduction,
)
from fsd_experiments.models import cifar_cnn


def small_mlp() -> nn.Sequential:
    # 3 → 4 → 2: p_1 = 3·4 + 4 = 16, p_2 = 4·2 + 2 = 10, P = 26, A = 4 ReLU units, d = 3
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))


def test_counts_of_hand_counted_mlp():
    arch = count_architecture(small_mlp(), (3,))
    assert (arch.P, arch.A, arch.d) == (26, 4, 3)
    assert arch.layer_params == [16, 10]
    assert arch.osla_blocks == 16 ** 2 + 10 ** 2
    # K-FAC: A_l is (fan-in + 1)², with the bias row; G_l is fan-out²
    assert arch.kfac_factors == [(4, 4), (5, 2)]
    assert arch.kfac_numbers == 4 ** 2 + 4 ** 2 + 5 ** 2 + 2 ** 2


def test_counts_of_hand_counted_cnn():
    # conv 1→2 (3×3, pad 1) on 1×4×4: 2·9 + 2 = 20 params, 2·4·4 = 32 ReLU outputs;
    # linear 32 → 3: 99 params
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32, 3))
    arch = count_architecture(model, (1, 4, 4))
    assert (arch.P, arch.A, arch.d) == (119, 32, 16)
    # the convolution's A is over patches: 1 channel · 3 · 3 + 1
    assert arch.kfac_factors == [(10, 2), (33, 3)]


def test_formulas_on_hand_counted_mlp():
    P, A, d, N, C = 26, 4, 3, 5, 2
    costs = memory_costs(P, A, d, N, C, layer_params=[16, 10],
                         kfac_factors=[(4, 4), (5, 2)])
    assert costs["EWC"] == 52
    assert costs["NTK (coreset)"] == 52 + 15
    assert costs["FROMP (coreset)"] == 52 + 15 + 4 * 25
    assert costs["LAFTR (coreset)"] == 26 + 15
    assert costs["BGLN-S (coreset)"] == 26 + 4 + 15
    assert costs["LAFTR"] == 26 + 3 + 9
    assert costs["LAFTR-CW"] == 26 + 2 * 12
    assert costs["BGLN-S / BGLN-D"] == 26 + 4 + 12
    assert costs["BGLN-S-CW / BGLN-D-CW"] == 26 + 2 * 16
    assert costs["BGLN-S-Var / BGLN-D-Var"] == 26 + 4 + 6
    assert costs["OSLA"] == 26 + 356
    assert costs["OSLA (K-FAC factors)"] == 26 + 61
    assert "OSLA (K-FAC factors)" not in memory_costs(P, A, d, N, C)
    assert percentage_reduction(200, 50) == 75.0


def test_cifar_cnn_reproduces_paper_table():
    assert count_architecture(cifar_cnn(), (3, 32, 32)).P == CIFAR_CNN_P
    rows = memory_gain_table(CIFAR_CNN_P)
    assert len(rows) == len(PAPER_MEMORY_GAIN)
    for r in rows:
        assert r["laftr"] == pytest.approx(r["paper_laftr"], abs=0.006)
        assert r["laftr_coreset"] == pytest.approx(r["paper_laftr_coreset"], abs=0.006)


def test_measured_nbytes_match_formulas_on_small_mlp():
    rows = {r.estimator: r for r in measured_counts(small_mlp(), (3,), N=5, C=2)}
    P, A, d, N, C, K = 26, 4, 3, 5, 2, 2
    assert rows["LAFTR (coreset)"].measured_count == P + N * d
    # EWC and KFAC keep f(x, θ0) on 4 synthetic inputs (4 inputs of d, 4 outputs of K) for
    # distance's check of the function
    probe = 4 * (d + K)
    assert rows["EWC"].measured_count == 2 * P + probe
    # NTK recomputes J(θ−θ0): it stores P fewer numbers than the paper's 2P + Nd, and keeps
    # f(x, θ0) on its coreset (N·K) to check that the model it measures is the one fitted
    assert rows["NTK (coreset)"].measured_count == P + N * d + N * K
    # moment summaries also keep the mixture weight(s)
    assert rows["BGLN-S"].measured_count == P + A + d + d * d + 1
    assert rows["BGLN-D"].measured_count == P + A + d + d * d + 1
    assert rows["BGLN-S-Var"].measured_count == P + A + 2 * d + 1
    assert rows["BGLN-S-CW"].measured_count == P + C * (A + d + d * d) + C
    assert rows["BGLN-S (coreset)"].measured_count == P + A + N * d + 1
    assert rows["OSLA (K-FAC)"].measured_count == P + 61 + probe
    assert rows["OSLA (K-FAC)"].formula_count == P + 61


def test_measured_kfac_factors_of_a_cnn():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32, 3))
    rows = {r.estimator: r for r in measured_counts(model, (1, 4, 4), N=5, C=3,
                                                     classwise=False, deterministic=False)}
    probe = 4 * (16 + 3)  # f(x, θ0) on 4 synthetic 1×4×4 inputs, 3 outputs each
    assert rows["OSLA (K-FAC)"].measured_count == (119 + 10 ** 2 + 2 ** 2 + 33 ** 2 + 3 ** 2
                                                   + probe)


def test_cli_memory(tmp_path, capsys):
    assert main(["memory", "--arch", "mnist-mlp", "--no-measure", "--out", str(tmp_path)]) == 0
    text = (tmp_path / "memory_mnist-mlp.md").read_text()
    assert "P = 89,610" in text and "66.27" in text
    saved = json.loads((tmp_path / "memory_mnist-mlp.json").read_text())
    assert saved["architecture"]["P"] == 89_610
    assert saved["schema_version"] == 1 and saved["fsd_version"] == fsd_experiments.__version__
    assert saved["torch_version"] == torch.__version__ and saved["torch_threads"] >= 1
