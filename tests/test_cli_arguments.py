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
        ("--epochs", "0"), ("--first-epochs", "0"), ("--model", "vgg"), ("--width", "0"),
        ("--batch-size", "0"), ("--lr", "0"),
        ("--lr", "inf"), ("--fsd-scale", "nan"), ("--fsd-scale", "-5"), ("--momentum", "1"),
        ("--coreset-size", "0"), ("--num-samples", "0"), ("--rank", "0"), ("--injection-rank", "0"),
        ("--threads", "0"),
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


# options that were still unvalidated: each refused while parsing, exit 2, one line, the
# option named (a 0 learning rate gave an all-NaN table with exit 0, --epochs 1e30 never
# finished, --C -1 printed a negative size, --iters 0 a KeyError)
UNBOUNDED = {
    **{f"fidelity {option} {value}": [*FIDELITY, option, value] for option, value in [
        ("--lrs", "0"), ("--lrs", "inf"), ("--lrs", "1e-3,nan"), ("--lrs", "1e-3,1e-3"),
        ("--lrs", "1e30"), ("--lrs", ""), ("--lrs", "1e-3,"), ("--depths", "-1"),
        ("--depths", "1,0"), ("--depths", "1000"), ("--iters", "0"), ("--iters", "10,x"),
        ("--iters", "1000000000"), ("--lams", "nan"), ("--lams", "-1"), ("--lams", "1e300"),
        ("--epochs", "1e30"), ("--epochs", "inf"), ("--width", "100000000"),
        ("--depth", "1000"), ("--num-samples", "1000000000"),
        ("--minimize-samples", "1000000000"), ("--minimize-steps", "1000000000"),
        ("--references", "1000000"), ("--depth-references", "1000000"),
        ("--repeats", "1000000"), ("--coreset-size", "1000000000"), ("--seed", "-1"),
        ("--seed", "99999999999999999999"), ("--studies", "pairs,nope"),
        ("--threads", "1000000")]},
    **{f"memory {option} {value}": ["memory", option, value] for option, value in [
        ("--C", "-1"), ("--C", "0"), ("--C", "100000000"), ("--N", "1000000000"),
        ("--P", "1" + "0" * 20), ("--input-shape", "0,0"), ("--input-shape", "3,32,x"),
        ("--input-shape", "3,100000,100000"), ("--input-shape", "1,1,1,1,1"),
        ("--input-shape", "")]},
    **{f"influence uci {option} {value}": [*UCI, option, value] for option, value in [
        ("--pbrf-lr", "1e30"), ("--lrs", "1e30"),
        ("--pbrf-epochs", "1e30"), ("--epochs", "1000000000"), ("--cg-iters", "1000000000"),
        ("--damping", "1e300"), ("--points-per-solve", "1000000000"), ("--seed", "-1")]},
    **{f"influence mislabeled {option} {value}": [*MISLABELED, option, value]
       for option, value in [("--width", "100000000"), ("--lr", "1e30"), ("--pbrf-lr", "1e30"),
                             ("--epochs", "1000000000"), ("--pbrf-steps", "1000000000"),
                             ("--depth", "1000"), ("--seed", "-5")]},
    **{f"cl {option} {value}": [*CL, option, value] for option, value in [
        ("--width", "100000000"), ("--num-samples", "1000000000"), ("--epochs", "1000000000"),
        ("--first-epochs", "1000000000"), ("--lr", "1e30"), ("--fsd-scale", "1e300"),
        ("--coreset-size", "1000000000")]},
    "influence uci --lrs 0.1 0.1": [*UCI, "--lrs", "0.1", "0.1"],
    "cl --seeds -1": [*CL, "--seeds", "-1"],
    "cl --seeds 2**64": [*CL, "--seeds", str(2**64)],
    "cl tune --grid 1e300": ["cl", "tune", *CL[1:], "--grid", "1e300"],
    "cl tune --tuning-seed -1": ["cl", "tune", *CL[1:], "--grid", "1", "--tuning-seed", "-1"],
    **{f"toy {option} {value}": [*TOY, option, value] for option, value in [
        ("--steps", "10000000000"), ("--seeds", "1000000"), ("--lam", "1e300"),
        ("--seed", "-1"), ("--width", "100000000")]},
    **{f"compare-estimators {option} {value}": ["compare-estimators", option, value]
       for option, value in [("--width", "100000000"), ("--epochs", "1000000000"),
                             ("--seed", "-1"), ("--threads", "1000000")]},
}


@pytest.mark.parametrize("argv", list(UNBOUNDED.values()), ids=list(UNBOUNDED))
def test_unbounded_values_exit_2_with_one_line(argv, tmp_path, capsys):
    test_bad_values_exit_2_with_one_line(argv, tmp_path, capsys)


def test_bounds_keep_the_papers_settings():
    # the bounds refuse only what could not run: the paper's and the defaults' values pass
    parser = build_parser()
    args = parser.parse_args([*CL, "--width", "1024", "--epochs", "200", "--lr", "1e-4",
                              "--fsd-scale", "10000", "--num-samples", "2048",
                              "--seeds", "20", "21", "22"])
    assert (args.width, args.epochs, args.seeds) == (1024, 200, [20, 21, 22])
    args = parser.parse_args(["fidelity", "--out", "x", "--lrs", "1e-4,3e-4,1e-2", "--iters",
                              "10,30,300", "--depths", "1,2,3,4,5,6", "--lams", "0,1,10"])
    assert args.lrs == (1e-4, 3e-4, 1e-2) and args.depths == (1, 2, 3, 4, 5, 6)
    assert args.studies == ("pairs", "depth", "minimize")  # the default, parsed too
    args = parser.parse_args(["memory", "--input-shape", "3,32,32", "--C", "100"])
    assert args.input_shape == (3, 32, 32) and args.C == 100


# every command that writes into --out: '' (Path('') is the current directory, where one
# command's results.json overwrote another's) and '/' are refused while parsing, as is an
# existing file
OUT_COMMANDS = {
    "cl": CL, "cl tune": ["cl", "tune", *CL[1:], "--grid", "1"],
    "cl merge": ["cl", "merge", "{runs}", "--out", "{out}"],
    "cl report": ["cl", "report", "{runs}", "--out", "{out}"],
    "fidelity": FIDELITY, "toy": TOY, "influence uci": UCI, "influence mislabeled": MISLABELED,
    "compare-estimators": ["compare-estimators", "--out", "{out}"],
    "memory": ["memory", "--no-measure", "--out", "{out}"],
}


@pytest.mark.parametrize("out", ["", " ", "/", "{file}", "{folder}"],
                         ids=["empty", "blank", "root", "a file", "a folder for a file"])
@pytest.mark.parametrize("argv", list(OUT_COMMANDS.values()), ids=list(OUT_COMMANDS))
def test_unsafe_out_is_refused_while_parsing(argv, out, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # what an empty --out would have written into
    (tmp_path / "runs").mkdir()
    (tmp_path / "a-file").write_text("mine")
    report = argv[:2] == ["cl", "report"]
    if out == "{folder}" and not report:
        return  # a folder is what the other commands take
    if out == "{file}" and report:
        return  # a file is what report's --out takes
    out = out.replace("{file}", str(tmp_path / "a-file")).replace("{folder}", str(tmp_path))
    argv = [out if a == "{out}" else a.replace("{runs}", str(tmp_path / "runs")) for a in argv]
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "argument --out" in lines[0], lines
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file", "runs"]  # nothing written
    assert (tmp_path / "a-file").read_text() == "mine"
