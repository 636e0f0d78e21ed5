"""Every numeric option of every subcommand refuses bad values: exit 2, one line on stderr.

Nothing is read or trained first: each bad value is refused while the arguments are parsed
(or, for report paths, before any file is opened), so the data directory here is empty.
"""

from __future__ import annotations

import pytest
import torch

from fsd_experiments.argtypes import apply_threads
from fsd_experiments.cli import build_parser, main

CL = ["cl", "--benchmark", "split-mnist", "--method", "finetune", "--out", "{out}"]
UCI = ["influence", "uci", "--dataset", "boston", "--out", "{out}"]
MISLABELED = ["influence", "mislabeled", "--out", "{out}"]
FIDELITY = ["fidelity", "--out", "{out}"]
TOY = ["toy", "--out", "{out}"]

BAD = {
    **{f"cl {option} {value}": [*CL, option, value] for option, value in [
        ("--tasks", "-1"), ("--tasks", "0"), ("--train-subset", "-5"), ("--test-subset", "0"),
        ("--epochs", "0"), ("--first-epochs", "0"), ("--model", "resnet"), ("--width", "0"),
        ("--batch-size", "0"), ("--lr", "0"),
        ("--lr", "inf"), ("--fsd-scale", "nan"), ("--fsd-scale", "-5"), ("--momentum", "1"),
        ("--coreset-size", "0"), ("--num-samples", "0"), ("--rank", "0"), ("--threads", "0"),
        ("--device", "bogus"), ("--width", "ten")]},
    "cl --seeds 3 3": [*CL, "--seeds", "3", "3"],
    "cl gap --examples -5": ["cl", "gap", "{out}", "--examples", "-5"],
    "cl report of a missing directory": ["cl", "report", "{out}/missing"],
    **{f"influence uci {option} {value}": [*UCI, option, value] for option, value in [
        ("--removals", "-3"), ("--removals", "0"), ("--removals", "2"), ("--cg-iters", "0"),
        ("--damping", "-1"),
        ("--subset", "0"), ("--epochs", "0"), ("--pbrf-lr", "0"), ("--lrs", "-0.1"),
        ("--bgln-clusters", "0"), ("--threads", "0"), ("--points-per-solve", "0")]},
    **{f"influence mislabeled {option} {value}": [*MISLABELED, option, value]
       for option, value in [("--corrupt", "0"), ("--corrupt", "1.5"), ("--corrupt", "-0.1"),
                             ("--n-train", "0"), ("--pool", "0"), ("--device", "bogus"),
                             ("--pbrf-steps", "0"), ("--lr", "-1")]},
    **{f"fidelity {option} {value}": [*FIDELITY, option, value] for option, value in [
        ("--width", "0"), ("--epochs", "0"), ("--repeats", "0"), ("--max-train", "-1"),
        ("--minimize-samples", "0"), ("--metric", "logits")]},
    **{f"toy {option} {value}": [*TOY, option, value] for option, value in [
        ("--lam", "nan"), ("--lam", "-1"), ("--steps", "0"), ("--width", "0")]},
    "compare-estimators --repeats 0": ["compare-estimators", "--repeats", "0"],
    "compare-estimators --threads 0": ["compare-estimators", "--threads", "0"],
    "memory --N 0": ["memory", "--N", "0"],
    "memory --threads 0": ["memory", "--threads", "0"],
}


@pytest.mark.parametrize("argv", list(BAD.values()), ids=list(BAD))
def test_bad_values_exit_2_with_one_line(argv, tmp_path, capsys):
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in argv]
    if argv[0] not in ("memory",) and argv[:2] != ["cl", "report"]:
        argv += ["--data-dir", str(tmp_path / "no-data")]
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    # the refusal names what was wrong, not a later failure (the data directory is empty)
    options = [a for a in argv if a.startswith("--") and a not in ("--out", "--data-dir",
                                                                    "--benchmark", "--method",
                                                                    "--dataset")]
    assert (f"argument {options[-1]}" in lines[0]) if options else ("missing" in lines[0])
    assert "not found" not in lines[0]
    assert not (tmp_path / "out").exists()  # nothing written


# every command that computes, with only what it requires
COMPUTING = {
    "cl": CL, "cl tune": ["cl", "tune", *CL[1:], "--grid", "1"], "cl gap": ["cl", "gap", "{out}"],
    "influence uci": UCI, "influence mislabeled": MISLABELED, "fidelity": FIDELITY, "toy": TOY,
    "compare-estimators": ["compare-estimators"], "memory": ["memory"],
}


@pytest.mark.parametrize("argv", list(COMPUTING.values()), ids=list(COMPUTING))
def test_threads_default_to_torchs_own(argv):
    parser = build_parser()
    assert parser.parse_args(argv).threads is None  # torch's default is left alone
    assert parser.parse_args([*argv, "--threads", "3"]).threads == 3


def test_apply_threads_keeps_torchs_default_unless_given():
    before = torch.get_num_threads()
    try:
        assert apply_threads(None) == before
        assert torch.get_num_threads() == before
        assert apply_threads(1) == 1 == torch.get_num_threads()
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("argv, named", [
    (["cl", "tune", "--method", "ewc", "--out", "{out}", "--grid", "1"], "--benchmark"),
    (["cl", "tune", "--benchmark", "split-mnist", "--method", "ewc", "--out", "{out}"], "--grid"),
    (["cl", "--benchmark", "split-mnist", "--method", "ewc"], "--out"),
    (["cl", "merge", "{out}"], "--out"),
    (["fidelity"], "--out"),
], ids=["cl tune without --benchmark", "cl tune without --grid", "cl without --out",
        "cl merge without --out", "fidelity without --out"])
def test_missing_required_options_exit_2_with_one_line(argv, named, tmp_path, capsys):
    argv = [a.replace("{out}", str(tmp_path / "out")) for a in argv]
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2
    assert len(lines) == 1 and named in lines[0], lines
    assert not (tmp_path / "out").exists()


def test_help_marks_the_required_options(capsys):
    for argv in (["cl", "--help"], ["cl", "tune", "--help"]):
        with pytest.raises(SystemExit):
            main(argv)
        text = capsys.readouterr().out
        usage = text.split("\n\n")[0]
        # required options appear in the usage line without brackets
        for option in ("--benchmark", "--method", "--out"):
            assert f"[{option}" not in usage and option in usage, usage
        assert text.count("(required)") == 3
