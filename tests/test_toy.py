"""The 1-D toy: per-input LAFTR / NTK curves agree with the library's estimators."""

from __future__ import annotations

import copy
import json

import torch

import fsd_experiments
from fsd import LAFTR, NTK
from fsd_experiments.cli import main
from fsd_experiments.models import mlp
from fsd_experiments.toy import ToyConfig, format_toy, laftr_outputs, ntk_outputs, run_toy, toy_plot


def pair() -> tuple[torch.nn.Module, torch.nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    f1 = mlp(1, 16, 2, 1).to(torch.float64)
    f2 = copy.deepcopy(f1)
    with torch.no_grad():
        for p in f2.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return f1, f2, torch.linspace(-3, 3, 50, dtype=torch.float64).unsqueeze(1)


def test_laftr_curve_matches_library_distance():
    f1, f2, x = pair()
    with torch.no_grad():
        approx = laftr_outputs(f1, f2, x)
        mine = 0.5 * (approx - f1(x)).pow(2).sum(-1).mean()
    library = LAFTR(inputs="coreset", coreset_size=None).fit(f1, x).distance(f2)
    torch.testing.assert_close(mine, library.detach(), rtol=1e-10, atol=1e-12)
    # at the reference itself LAFTR is the network
    torch.testing.assert_close(laftr_outputs(f1, f1, x), f1(x))


def test_ntk_curve_matches_library_distance():
    f1, f2, x = pair()
    approx = ntk_outputs(f1, f2, x)
    with torch.no_grad():
        mine = 0.5 * (approx - f1(x)).pow(2).sum(-1).mean()
    library = NTK(coreset_size=None).fit(f1, x).distance(f2)
    torch.testing.assert_close(mine, library.detach(), rtol=1e-10, atol=1e-12)


def test_small_toy_run_and_plot(tmp_path):
    torch.set_num_threads(1)
    result = run_toy(ToyConfig(width=8, steps=30, n=10))
    assert set(result["runs"]) == {"none", "BGLN-D", "EWC", "NTK"}
    for e in result["errors"].values():
        assert all(torch.isfinite(torch.tensor(v)) for v in e.values())
    toy_plot(result, tmp_path / "toy.png")
    assert (tmp_path / "toy.png").stat().st_size > 1000
    assert "LAFTR" in format_toy(result)


def test_cli_maps_options_onto_the_settings_and_writes_versioned_json(tmp_path):
    assert main(["toy", "--out", str(tmp_path), "--steps", "30", "--seeds", "1", "--width", "16",
                 "--lam", "2"]) == 0
    saved = json.loads((tmp_path / "toy.json").read_text())
    assert saved["config"] == {**ToyConfig().__dict__, "steps": 30, "width": 16, "lam": 2.0}
    assert saved["schema_version"] == 1 and saved["fsd_version"] == fsd_experiments.__version__
    assert saved["torch_version"] == torch.__version__ and saved["torch_threads"] >= 1
    assert set(saved["errors"]) == {"none", "BGLN-D", "EWC", "NTK", "f1 (before task 2)"}
