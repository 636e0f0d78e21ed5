"""benchmarks/cl_run.py: the medians and ratios it reports from whole ``fsd cl`` runs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "cl_run.py"


def _script():
    spec = importlib.util.spec_from_file_location("cl_run", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_medians_and_ratios_per_checkout():
    cl_run = _script()

    def row(src, method, seconds):
        return {"src": src, "method": method, "process_s": seconds, "cpu_s": seconds / 2,
                "training_s": seconds - 5}

    runs = [row("old", "finetune", 20), row("new", "finetune", 18), row("new", "finetune", 22),
            row("new", "finetune", 100), row("new", "osla", 90),
            row("new", "bgln-d-corrected", 45)]
    done = cl_run.summary(runs, "new", ["finetune", "osla", "bgln-d-corrected"])
    assert done["medians"]["finetune"]["process_s"] == 22  # the other checkout's run left out
    ratios = done["ratios"]
    assert ratios["corrected/finetune (process_s)"] == pytest.approx(45 / 22, abs=1e-3)
    assert ratios["corrected/osla (cpu_s)"] == pytest.approx(0.5, abs=1e-3)
    assert ratios["corrected/finetune (training_s)"] == pytest.approx(40 / 17, abs=1e-3)
