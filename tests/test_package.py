"""The library package on its own: what importing it pulls in, and its public names."""

from __future__ import annotations

import subprocess
import sys

import fsd

# the framework integrations (fsd.integrations) are imported by their users only
HEAVY = ("matplotlib", "scipy", "fsd_experiments", "lightning", "transformers",
         "fsd.integrations.lightning", "fsd.integrations.transformers")


def test_importing_fsd_loads_neither_matplotlib_nor_scipy():
    # a fresh interpreter: this test process has imported the experiments already
    code = ("import sys, fsd, fsd.testing, fsd.uses.influence; "
            f"print(','.join(m for m in {HEAVY!r} if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "", f"import fsd loaded {result.stdout.strip()}"


def test_the_check_can_see_a_heavy_import():
    # the same probe reports a module that is loaded, so an empty answer above means something
    code = f"import sys, scipy; print(','.join(m for m in {HEAVY!r} if m in sys.modules))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=True, timeout=120)
    assert result.stdout.strip() == "scipy"


def test_every_public_name_is_exported_and_documented():
    for name in fsd.__all__:
        obj = getattr(fsd, name)
        if callable(obj):
            assert obj.__doc__, f"fsd.{name} has no docstring"
