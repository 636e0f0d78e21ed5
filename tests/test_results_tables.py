"""The docs' continual-learning tables equal what the committed result files say.

Every table between ``<!-- fsd cl report ... --rows: begin -->`` markers in docs/ is
regenerated from ``results/cl`` and compared character for character; every row folder there
is shown by some table. The generator itself is checked on handmade results files.
"""

import json
from pathlib import Path

import pytest

from fsd_experiments import continual
from fsd_experiments.cli import main
from fsd_experiments.continual.doc_tables import BLOCK, refreshed, stale_tables

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_tables_equal_the_committed_results(doc):
    stale = stale_tables(doc, ROOT)
    assert not stale, (f"{doc.name}: the tables of `fsd cl report {stale} --rows` differ from "
                       f"results/cl; run python -m fsd_experiments.continual.doc_tables "
                       f"docs/{doc.name}")


def test_every_committed_row_is_in_a_docs_table():
    shown = set()
    for doc in DOCS:
        for block in BLOCK.finditer(doc.read_text(encoding="utf-8")):
            if block["kind"] != "rows":
                continue
            shown |= {line.split("|")[1].strip() + "/" + line.split("|")[2].strip()
                      for line in block["table"].splitlines() if line.startswith("| ")
                      and not line.startswith("| row ")}
    committed = {f"{p.parent.name.split('-')[0]}/{json.loads(p.read_text())['method']}"
                 for p in (ROOT / "results" / "cl").glob("*/*/results.json")}
    assert committed, "no result files under results/cl"
    assert committed <= shown, f"rows in results/cl that no docs table shows: " \
                               f"{sorted(committed - shown)}"


def test_every_committed_tuning_is_in_a_docs_tune_table():
    shown = set()
    for doc in DOCS:
        for block in BLOCK.finditer(doc.read_text(encoding="utf-8")):
            if block["kind"] == "tune":
                shown |= {line.split("|")[1].strip() for line in block["table"].splitlines()
                          if line.startswith("| ") and not line.startswith("| row ")}
    committed = {p.parent.name.split("-")[0]
                 for p in (ROOT / "results" / "cl").glob("*/*/tune.json")}
    assert committed, "no tune.json under results/cl"
    assert committed <= shown, f"tunings in results/cl that no docs table shows: " \
                               f"{sorted(committed - shown)}"


def _results(method: str, per_seed: list[float], **settings) -> dict:
    hp = continual.default_hyperparameters("split-mnist", method) | settings
    seeds = list(range(1, len(per_seed) + 1))
    return {"benchmark": "split-mnist", "method": method, "seeds": seeds,
            "seeds_requested": seeds, "complete": True,
            "accuracy_matrix": {str(s): [[a, 50.0], [a, a]]
                                for s, a in zip(seeds, per_seed, strict=True)},
            "avg_accuracy": continual.accuracy_summary(per_seed),
            "backward_transfer": continual.accuracy_summary([0.0] * len(per_seed)),
            "wall_seconds": {"per_seed": [90.0] * len(seeds), "total": 90.0 * len(seeds)},
            "summary_bytes_per_task": 1234.0, "hyperparameters": hp, "torch_threads": 1,
            "device": "cpu"}


def _write(folder: Path, raw: dict) -> None:
    folder.mkdir(parents=True)
    (folder / "results.json").write_text(json.dumps(raw))


def test_row_tables_order_rows_and_name_what_differs(tmp_path, capsys):
    _write(tmp_path / "S10-osla", _results("osla", [99.0, 98.0]))
    _write(tmp_path / "S2-bgln-d-head", _results("bgln-d", [97.0, 99.0, 98.0],
                                                  penalty_outputs="head", fsd_scale=3.2))
    _write(tmp_path / "S2b-bgln-s", _results("bgln-s", [99.5]))
    lines = continual.row_tables([str(tmp_path)]).splitlines()
    rows = [line.split(" | ")[0] for line in lines[2:]]
    assert rows == ["| S2", "| S2b", "| S10"]  # by number, not as text
    assert lines[2] == ("| S2 | bgln-d | 3.2 | λ 3.2, penalty outputs head | 1 2 3 | "
                        "98.00 ± 0.82 (97.00, 99.00, 98.00) | 99.72 ± 0.03 | 0.00 ± 0.00 | "
                        "-0.09 ± 0.04 | 1,234 | 1.5 | cpu, 1 thread |")
    assert "| S2b | bgln-s | 5 | – | 1 | 99.50 | 99.64 ± 0.04 |" in lines[3]
    # the command prints the same
    capsys.readouterr()
    assert main(["cl", "report", str(tmp_path), "--rows"]) == 0
    assert capsys.readouterr().out == continual.row_tables([str(tmp_path)]) + "\n"
    # two folders with one row id are refused
    _write(tmp_path / "S10-again", _results("osla", [99.0]))
    with pytest.raises(ValueError, match="S10"):
        continual.row_tables([str(tmp_path)])


def test_row_tables_refuse_a_folder_without_a_row_id(tmp_path, capsys):
    _write(tmp_path / "bgln-s", _results("bgln-s", [99.5]))
    with pytest.raises(ValueError, match="not a row folder"):
        continual.row_tables([str(tmp_path)])
    assert main(["cl", "report", str(tmp_path), "--rows"]) == 2
    assert "not a row folder" in capsys.readouterr().err


def test_refreshing_a_page_rewrites_only_its_blocks(tmp_path):
    _write(tmp_path / "results" / "T1-bgln-s", _results("bgln-s", [99.5, 99.7]))
    page = ("# Title\n\nprose 1\n\n<!-- fsd cl report results/* --rows: begin -->\n"
            "| an old table |\n<!-- fsd cl report: end -->\n\nprose 2\n")
    doc = tmp_path / "page.md"
    doc.write_text(page)
    assert stale_tables(doc, tmp_path) == ["results/*"]
    new = refreshed(page, tmp_path)
    assert new.startswith("# Title\n\nprose 1\n\n"
                          "<!-- fsd cl report results/* --rows: begin -->\n\n| row |")
    assert "99.60 ± 0.10 (99.50, 99.70)" in new and "an old table" not in new
    assert new.endswith("|\n\n<!-- fsd cl report: end -->\n\nprose 2\n")
    doc.write_text(new)
    assert stale_tables(doc, tmp_path) == []
    # a number changed by hand is caught
    doc.write_text(new.replace("99.60 ± 0.10", "99.61 ± 0.10"))
    assert stale_tables(doc, tmp_path) == ["results/*"]


def test_a_block_glob_takes_row_folders_not_the_files_beside_them(tmp_path):
    _write(tmp_path / "results" / "T1-bgln-s", _results("bgln-s", [99.5]))
    (tmp_path / "results" / "T-notes.md").write_text("notes, not a run\n")
    page = "<!-- fsd cl report results/T* --rows: begin -->\n<!-- fsd cl report: end -->\n"
    table = refreshed(page, tmp_path)
    assert "| T1 | bgln-s |" in table and "notes" not in table
    with pytest.raises(ValueError, match="matches no folder"):
        refreshed(page.replace("results/T*", "results/*.md"), tmp_path)


def test_the_protocol_column_and_the_row_tables_compare_the_same_settings(tmp_path):
    # a coreset size off the defaults is named by both (the report once left it out)
    _write(tmp_path / "R1-ntk", _results("ntk", [99.5], coreset_size=256))
    assert "coreset size 256" in continual.row_tables([str(tmp_path)])
    assert "**not paper protocol**: coreset_size" in continual.report([str(tmp_path)])


def _tuning(chosen: float, grid: dict[float, float], validation: float | None = 0.1) -> dict:
    return {"tuning_seed": 42, "validation": validation, "chosen": chosen,
            "grid": [{"fsd_scale": k, "avg_accuracy": v, "backward_transfer": -1.0}
                     for k, v in grid.items()], "schema_version": 2}


def test_tune_tables_show_the_grid_the_choice_and_the_final_seeds(tmp_path, capsys):
    _write(tmp_path / "T2-ewc-tuned", _results("ewc", [99.0, 98.0], fsd_scale=10.0))
    (tmp_path / "T2-ewc-tuned" / "tune.json").write_text(
        json.dumps(_tuning(10.0, {0.1: 97.8, 10.0: 99.46, 100.0: 99.03})))
    _write(tmp_path / "T1-bgln-d-tuned", _results("bgln-d", [97.0], fsd_scale=3.0, width=512))
    (tmp_path / "T1-bgln-d-tuned" / "tune.json").write_text(
        json.dumps(_tuning(3.0, {1.0: 90.0, 3.0: 91.5}, validation=None)))
    _write(tmp_path / "T3-osla", _results("osla", [99.0]))  # not a tuning: not shown
    lines = continual.tune_tables([str(tmp_path)]).splitlines()
    assert len(lines) == 4
    assert lines[2] == ("| T1 | split-mnist | bgln-d | width 512 | 42, test sets | "
                        "1: 90.00, **3: 91.50** | 1 | 97.00 | 99.72 ± 0.03 | 0.00 |")
    assert lines[3] == ("| T2 | split-mnist | ewc | – | 42, validation (10 %) | "
                        "0.1: 97.80, **10: 99.46**, 100: 99.03 | 1 2 | 98.50 ± 0.50 (99.00, "
                        "98.00) | 63.10 | 0.00 ± 0.00 |")
    capsys.readouterr()
    assert main(["cl", "report", str(tmp_path), "--tune"]) == 0
    assert capsys.readouterr().out == continual.tune_tables([str(tmp_path)]) + "\n"
    assert main(["cl", "report", str(tmp_path), "--tune", "--rows"]) == 2
    assert "two different tables" in capsys.readouterr().err
    # a docs block of the tune kind is regenerated like a rows block
    page = "<!-- fsd cl report T* --tune: begin -->\n| old |\n<!-- fsd cl report: end -->\n"
    assert "**10: 99.46**" in refreshed(page, tmp_path)
    # a tune.json that does not match the final run beside it is refused
    (tmp_path / "T2-ewc-tuned" / "tune.json").write_text(
        json.dumps(_tuning(100.0, {10.0: 99.0, 100.0: 99.5})))
    with pytest.raises(ValueError, match="chose λ 100, the final run used 10"):
        continual.tune_tables([str(tmp_path)])
    with pytest.raises(ValueError, match="no fsd cl tune output"):
        continual.tune_tables([str(tmp_path / "T3-osla")])
