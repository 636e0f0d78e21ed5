"""``fsd influence report``: tables over finished runs, read back from handmade results files."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fsd_experiments.cli import main
from fsd_experiments.doc_tables import refreshed, stale_tables
from fsd_experiments.influence.report import report_tables
from fsd_experiments.stats import correlations


def uci_file(folder: Path, dataset: str, *, seed: int, point_term: bool,
             clusters: int | None, diverged: int = 0, fisher: str = "true") -> dict:
    """A results.json as ``fsd influence uci`` writes it, with scores drawn at random."""
    rng = np.random.default_rng(seed)
    exact = rng.normal(size=12)
    scores = {"exact": exact, "ewc": exact + 0.5 * rng.normal(size=12),
              "bgln-d": exact + 0.1 * rng.normal(size=12)}
    result = {
        "experiment": "uci", "dataset": dataset, "seed": seed, "n_train": 100 + seed,
        "removed_indices": list(range(12)),
        "pbrf": {"lr": 0.03, "steps": 80, "point_term": point_term, "bgln_clusters": clusters,
                 "bgln_moments": "paper", "ewc_fisher": fisher},
        "scores": {m: s.tolist() for m, s in scores.items()},
        "seconds": {"exact": 10.4, "ewc": 5.6, "bgln-d": 20.2},
        "correlation": {m: correlations(scores[m], exact) for m in ("ewc", "bgln-d")},
        "nonfinite": {"exact": 0, "ewc": diverged, "bgln-d": 0},
        "bootstrap": {"pearson": {"ewc": [0.5, 0.9]}, "spearman": {}, "level": 0.95,
                      "difference": {"bgln-d": {"pearson": [-0.01, 0.2],
                                                "spearman": [0.0, 0.3]}}},
    }
    (folder / dataset).mkdir(parents=True)
    (folder / dataset / "results.json").write_text(json.dumps(result))
    return result


def mislabeled_file(folder: Path, seed: int) -> dict:
    result = {
        "experiment": "mislabeled", "seed": seed, "model": "MLP 2x128 ReLU", "device": "cpu",
        "pool": {"size": 1000, "corrupted": 104}, "auc": {"random": 0.503, "bgln-d": 0.9217,
                                                         "ewc": 0.9192},
        "seconds": {"random": 0.01, "bgln-d": 240.2, "ewc": 185.0},
        "bootstrap": {"level": 0.95, "auc": {"random": [0.451, 0.559], "bgln-d": [0.907, 0.935],
                                             "ewc": [0.905, 0.933]},
                      "difference": {"bgln-d": {"auc": [0.001, 0.004]}}},
    }
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(result))
    return result


def table_rows(table: str) -> list[dict[str, str]]:
    lines = table.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    return [dict(zip(head, (c.strip() for c in line.strip("|").split("|")), strict=True))
            for line in lines[2:]]


def test_uci_rows_are_the_results_files_numbers(tmp_path):
    first = {d: uci_file(tmp_path / "U1-a", d, seed=i, point_term=False, clusters=None)
             for i, d in enumerate(["energy", "concrete"])}
    second = uci_file(tmp_path / "U1-b", "concrete", seed=7, point_term=True, clusters=30,
                      diverged=1, fisher="sampled")
    rows = table_rows(report_tables([tmp_path / "U1-a", tmp_path / "U1-b"]))
    # data sets in the paper's order, whatever order they ran in
    assert [(r["run"], r["data set"]) for r in rows] == [
        ("U1-a", "concrete"), ("U1-a", "energy"), ("U1-b", "concrete")]
    for row, result in zip(rows, [first["concrete"], first["energy"], second], strict=True):
        c = result["correlation"]
        assert row["BGLN-D P"] == f"{c['bgln-d']['pearson']:.3f}"  # no interval saved
        assert row["EWC P"] == f"{c['ewc']['pearson']:.3f} [0.50, 0.90]"
        assert row["EWC S"] == f"{c['ewc']['spearman']:.3f}"
        gain = c["bgln-d"]["pearson"] - c["ewc"]["pearson"]
        assert row["BGLN-D − EWC, P"] == f"{gain:+.3f} [-0.010, +0.200]"
        gain = c["bgln-d"]["spearman"] - c["ewc"]["spearman"]
        assert row["BGLN-D − EWC, S"] == f"{gain:+.3f} [+0.000, +0.300]"
        assert row["N"] == str(result["n_train"]) and row["removals"] == "12"
        assert row["seconds: PBRF (exact) / EWC / BGLN-D"] == "10 / 6 / 20"
    # settings that differ between rows get a column; the diverged solve is named
    assert [r["point term"] for r in rows] == ["no", "no", "yes"]
    assert [r["BGLN-D"] for r in rows] == ["1 Gaussian", "1 Gaussian", "30 clusters"]
    assert [r["diverged solves"] for r in rows] == ["–", "–", "EWC 1"]
    assert [r["EWC Fisher"] for r in rows] == ["true", "true", "sampled"]
    # columns nobody has are left out; settings all rows share are not repeated
    only_first = report_tables([tmp_path / "U1-a"])
    assert "point term" not in only_first and "diverged" not in only_first
    assert "Fisher" not in only_first
    assert "CG P" not in only_first


def test_mislabeled_rows_and_both_kinds_in_one_report(tmp_path):
    mislabeled_file(tmp_path / "M1-seed0", 0)
    uci_file(tmp_path / "U3", "energy", seed=0, point_term=False, clusters=None)
    uci_table, mislabeled_table = report_tables([tmp_path / "M1-seed0", tmp_path / "U3"]
                                                ).split("\n\n")
    assert table_rows(uci_table)[0]["run"] == "U3"
    (row,) = table_rows(mislabeled_table)
    assert row["BGLN-D"] == "0.922 [0.907, 0.935]" and row["EWC"] == "0.919 [0.905, 0.933]"
    assert row["BGLN-D − EWC (95%)"] == "[+0.001, +0.004]"
    assert row["pool (corrupted)"] == "1000 (104)" and row["seed"] == "0"
    assert row["seconds: random / BGLN-D / EWC"] == "0 / 240 / 185"


def test_report_command_prints_the_tables_and_refuses_an_empty_folder(tmp_path, capsys):
    uci_file(tmp_path / "run", "energy", seed=0, point_term=False, clusters=None)
    assert main(["influence", "report", str(tmp_path / "run")]) == 0
    assert capsys.readouterr().out.strip() == report_tables([tmp_path / "run"])
    (tmp_path / "empty").mkdir()
    assert main(["influence", "report", str(tmp_path / "empty")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "holds no influence results" in err


@pytest.mark.parametrize("damage", ["drop pbrf", "drop correlation", "not json", "a list"])
def test_a_damaged_results_file_is_one_line_naming_it(tmp_path, capsys, damage):
    """A results.json that is not the command's gives one line naming the file, no traceback,
    and the good run beside it is not needed to tell."""
    uci_file(tmp_path / "good", "energy", seed=0, point_term=False, clusters=None)
    result = uci_file(tmp_path / "bad", "concrete", seed=1, point_term=False, clusters=None)
    path = tmp_path / "bad" / "concrete" / "results.json"
    if damage == "not json":
        path.write_text("{\"experiment\": ")
    elif damage == "a list":
        path.write_text("[]")
    else:
        del result[damage.split()[1]]
        path.write_text(json.dumps(result))
    assert main(["influence", "report", str(tmp_path / "good"), str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and str(path) in err and "Traceback" not in err
    mislabeled = mislabeled_file(tmp_path / "m", seed=0)
    del mislabeled["auc"]
    (tmp_path / "m" / "results.json").write_text(json.dumps(mislabeled))
    assert main(["influence", "report", str(tmp_path / "m")]) == 2
    assert "fsd influence mislabeled" in capsys.readouterr().err


def test_an_influence_block_in_a_page_is_regenerated_from_its_folders(tmp_path):
    uci_file(tmp_path / "results" / "U6-x", "energy", seed=0, point_term=False, clusters=None)
    page = ("prose\n\n<!-- fsd influence report results/U6-*: begin -->\n| stale |\n"
            "<!-- fsd influence report: end -->\n\nmore prose\n")
    doc = tmp_path / "page.md"
    doc.write_text(page)
    assert stale_tables(doc, tmp_path) == ["results/U6-*"]
    new = refreshed(page, tmp_path)
    assert report_tables([tmp_path / "results" / "U6-x"]) in new
    assert new.startswith("prose\n\n") and new.endswith("\n\nmore prose\n")
    doc.write_text(new)
    assert stale_tables(doc, tmp_path) == []
    with pytest.raises(ValueError, match="matches no folder"):
        refreshed(page.replace("U6-*", "U9-*"), tmp_path)
