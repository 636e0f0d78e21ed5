"""The docs' results tables equal what the committed result files say.

Every table between ``<!-- fsd cl report ... --rows: begin -->`` markers in docs/ is
regenerated from ``results/cl``, and every table between ``<!-- copied from FILE, table N:
begin -->`` markers is read again from that committed markdown, and compared character for
character, as is every table between ``<!-- rendered from FILES by NAME: begin -->`` markers
(rendered again from those files by :mod:`fsd_experiments.result_tables`); every row folder
under ``results/cl`` is shown by some table, every ``results/moments`` file by a rendered
one, and every committed ``fsd fidelity``, ``fsd toy`` and ``fsd memory`` markdown is what its
JSON renders to; every influence run under ``results/influence`` is shown by a ``fsd
influence report`` block. The generator itself is checked on handmade results files.
"""

import json
import re
from pathlib import Path

import pytest

from fsd_experiments import continual, result_tables
from fsd_experiments.cli import main
from fsd_experiments.continual import reporting
from fsd_experiments.doc_tables import (
    BLOCK,
    COPY,
    INFLUENCE,
    RENDERED,
    block_folders,
    block_paths,
    markdown_tables,
    refreshed,
    stale_tables,
)
from fsd_experiments.doc_tables import main as doc_tables_main
from fsd_experiments.fidelity.study import fidelity_markdown
from fsd_experiments.memory import memory_markdown
from fsd_experiments.toy import toy_markdown

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md"))


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_docs_tables_equal_the_committed_results(doc):
    stale = stale_tables(doc, ROOT)
    assert not stale, (f"{doc.name}: the tables from {stale} differ from the committed "
                       f"results; run python -m fsd_experiments.doc_tables docs/{doc.name}")


FIDELITY = sorted((ROOT / "results" / "fidelity").glob("*/fidelity_*.json"))


@pytest.mark.parametrize("result", FIDELITY, ids=[f.parent.name for f in FIDELITY])
def test_committed_fidelity_markdown_is_what_its_json_renders(result):
    written = result.with_suffix(".md").read_text(encoding="utf-8")
    assert written == fidelity_markdown(json.loads(result.read_text(encoding="utf-8")))


TOY = sorted((ROOT / "results" / "fidelity").glob("*/toy.json"))
MEMORY = sorted((ROOT / "results" / "fidelity").glob("*/memory_*.json"))


@pytest.mark.parametrize("result", TOY + MEMORY, ids=[f.name for f in TOY + MEMORY])
def test_committed_toy_and_memory_markdown_is_what_its_json_renders(result):
    saved = json.loads(result.read_text(encoding="utf-8"))
    written = result.with_suffix(".md").read_text(encoding="utf-8")
    if result.name == "toy.json":
        assert written == toy_markdown(saved)
    else:
        assert written == memory_markdown(saved, result.stem.removeprefix("memory_"))


def test_every_committed_study_markdown_is_copied_from():
    sources = {m["path"] for doc in DOCS for m in COPY.finditer(doc.read_text(encoding="utf-8"))}
    files = {str(f.relative_to(ROOT)) for f in (ROOT / "results").glob("fidelity/**/*.md")}
    assert files, "no study markdown under results/fidelity"
    assert files <= sources, f"committed study tables no docs page copies: " \
                             f"{sorted(files - sources)}"
    # a fidelity study's every table is in the docs, not only some of them
    for name in (f for f in files if "/fidelity_" in f):
        shown = {int(m["number"]) for doc in DOCS
                 for m in COPY.finditer(doc.read_text(encoding="utf-8")) if m["path"] == name}
        count = len(markdown_tables((ROOT / name).read_text(encoding="utf-8")))
        assert shown == set(range(1, count + 1)), f"{name}: tables {shown} of {count} copied"


def test_every_committed_influence_run_is_in_a_docs_table():
    shown = {Path(folder).resolve() for doc in DOCS
             for block in INFLUENCE.finditer(doc.read_text(encoding="utf-8"))
             for folder in block_folders(block["args"], ROOT)}
    # a run folder: results/influence/uci/RUN/<data set>/, results/influence/mislabeled/RUN/
    committed = {p.resolve() for kind in ("uci", "mislabeled")
                 for p in (ROOT / "results" / "influence" / kind).glob("*") if p.is_dir()}
    assert committed <= shown, f"influence runs in results/influence that no docs table shows: " \
                               f"{sorted(str(c.relative_to(ROOT)) for c in committed - shown)}"


#: summary tables that quote continual-learning accuracies outside a generated block
QUOTING = [("user-guide.md", "## Choosing an estimator", "Rules of thumb"),
           ("moments.md", "**Where the corrected recursion stands**", "Shared 2-core")]


@pytest.mark.parametrize("page, start, end", QUOTING, ids=[q[0] for q in QUOTING])
def test_accuracies_quoted_in_summary_tables_are_committed_rows(page, start, end):
    # "mean ± sd" of three seeds: each must be some committed row's, as fsd cl report gives it
    text = (ROOT / "docs" / page).read_text(encoding="utf-8")
    section = text[text.index(start):text.index(end, text.index(start))]
    quoted = set(re.findall(r"\b(\d{2}\.\d\d ± \d\.\d\d)\b", section))
    assert quoted, f"no accuracies quoted in {page} {start!r}"
    rows = reporting.row_tables(sorted(str(p.parent) for p in
                                       (ROOT / "results" / "cl").glob("*/*/results.json")))
    reported = set(re.findall(r"\| (\d{2}\.\d\d ± \d\.\d\d)", rows))
    assert quoted <= reported, f"{page}: accuracies no committed row gives: " \
                               f"{sorted(quoted - reported)}"


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


@pytest.mark.parametrize(("kind", "file"), [("tune", "tune.json"), ("gap", "gap.md")])
def test_every_committed_tuning_and_gap_is_in_a_docs_table_of_its_kind(kind, file):
    shown = set()
    for doc in DOCS:
        for block in BLOCK.finditer(doc.read_text(encoding="utf-8")):
            if block["kind"] == kind:
                shown |= {line.split("|")[1].strip() for line in block["table"].splitlines()
                          if line.startswith("| ") and not line.startswith("| row ")}
    committed = {p.parent.name.split("-")[0] for p in (ROOT / "results" / "cl").glob(f"*/*/{file}")}
    assert committed, f"no {file} under results/cl"
    assert committed <= shown, f"{file} files in results/cl that no docs --{kind} table " \
                               f"shows: {sorted(committed - shown)}"


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
    # a row of the first tasks only is not set beside the paper's whole stream
    _write(tmp_path / "S3-bgln-d-two", _results("bgln-d", [99.0], tasks=2))
    assert "| S3 | bgln-d | 0.1 | tasks 2 | 1 | 99.00 | – | 0.00 | – |" in \
        continual.row_tables([str(tmp_path)])
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


def test_a_copied_block_is_read_again_from_its_file(tmp_path):
    (tmp_path / "study.md").write_text("## study\n\n| a | b |\n|---|---|\n| 1 | 2 |\n\n"
                                      "text\n| c |\n|---|\n| 3 |\n")
    page = ("prose\n\n<!-- copied from study.md, table 2: begin -->\n\n| c |\n|---|\n| 4 |\n\n"
            "<!-- copied: end -->\n")
    doc = tmp_path / "page.md"
    doc.write_text(page)
    assert stale_tables(doc, tmp_path) == ["study.md, table 2"]
    new = refreshed(page, tmp_path)
    assert new == page.replace("| 4 |", "| 3 |")
    doc.write_text(new)
    assert stale_tables(doc, tmp_path) == []
    with pytest.raises(ValueError, match="has 2 tables, not a table 3"):
        refreshed(page.replace("table 2", "table 3"), tmp_path)
    with pytest.raises(ValueError, match="is not a file"):
        refreshed(page.replace("study.md", "other.md"), tmp_path)


def test_the_rewriting_command_names_a_bad_block_in_one_line(tmp_path, monkeypatch, capsys):
    page = "<!-- copied from missing.md, table 1: begin -->\n| x |\n<!-- copied: end -->\n"
    (tmp_path / "page.md").write_text(page)
    monkeypatch.chdir(tmp_path)
    assert doc_tables_main(["page.md"]) == 2
    err = capsys.readouterr().err
    assert err == "page.md: missing.md is not a file under .\n"
    assert (tmp_path / "page.md").read_text() == page  # nothing written


def test_a_block_glob_takes_row_folders_not_the_files_beside_them(tmp_path):
    _write(tmp_path / "results" / "T1-bgln-s", _results("bgln-s", [99.5]))
    (tmp_path / "results" / "T-notes.md").write_text("notes, not a run\n")
    page = "<!-- fsd cl report results/T* --rows: begin -->\n<!-- fsd cl report: end -->\n"
    table = refreshed(page, tmp_path)
    assert "| T1 | bgln-s |" in table and "notes" not in table
    with pytest.raises(ValueError, match="matches no folder"):
        refreshed(page.replace("results/T*", "results/*.md"), tmp_path)


def _chain_row(seed: int, task: int, true: float, ratio: float) -> dict:
    return {"run": f"R-s{seed}", "method": "bgln-s", "fsd_scale": 0.1, "seed": seed,
            "task": task, "true": true, "laftr_data": ratio * true, "bgln_s_data": ratio * true,
            "bgln_s_gaussian": ratio * true, "bgln_random_routing": ratio * true,
            "corrected_fired": None, "bgln_fired_routing": None, "stored": ratio * true}


def test_a_rendered_block_is_regenerated_from_its_files(tmp_path):
    result = tmp_path / "results" / "chain.json"
    result.parent.mkdir()
    result.write_text(json.dumps({"rows": [_chain_row(20, 1, 544.0, 0.0117),
                                           _chain_row(21, 1, 3.6018, 1.0)]}))
    page = ("prose\n\n<!-- rendered from results/chain.json by gap-chain: begin -->\n\n"
            "| an old table |\n\n<!-- rendered: end -->\n\nmore prose\n")
    doc = tmp_path / "page.md"
    doc.write_text(page)
    assert stale_tables(doc, tmp_path) == ["results/chain.json by gap-chain"]
    new = refreshed(page, tmp_path)
    table = new.split("begin -->\n\n")[1].split("\n\n<!-- rendered: end")[0]
    assert table == (
        "| seed | task | true FSD | LAFTR, data | BGLN-S, data | BGLN-S, Gaussian | "
        "exact BGLN moments | stored summary |\n"
        "|---:|---:|---:|---:|---:|---:|---:|---:|\n"
        "| 20 | 1 | 544 | 0.012 | 0.012 | 0.012 | 0.012 | 0.012 |\n"
        "| 21 | 1 | 3.6 | 1.000 | 1.000 | 1.000 | 1.000 | 1.000 |")
    assert new.startswith("prose\n\n") and new.endswith("|\n\n<!-- rendered: end -->\n\n"
                                                         "more prose\n")
    assert refreshed(new, tmp_path) == new
    doc.write_text(new)
    assert stale_tables(doc, tmp_path) == []
    # a number changed by hand is caught, and so is one changed in the file
    doc.write_text(new.replace("| 544 |", "| 545 |"))
    assert stale_tables(doc, tmp_path) == ["results/chain.json by gap-chain"]
    doc.write_text(new)
    result.write_text(json.dumps({"rows": [_chain_row(20, 1, 545.0, 0.0117)]}))
    assert stale_tables(doc, tmp_path) == ["results/chain.json by gap-chain"]
    # globs name several files, in the block's order; three significant digits on request
    (tmp_path / "results" / "chain_2.json").write_text(
        json.dumps({"rows": [_chain_row(22, 3, 2.0, 0.00176)]}))
    both = refreshed(page.replace("results/chain.json by gap-chain",
                                  "results/chain*.json by gap-chain-significant"), tmp_path)
    assert "| 20 | 1 | 545 | 0.0117 |" in both and "| 22 | 3 | 2 | 0.00176 |" in both


def test_a_bad_rendered_block_is_one_line_naming_it(tmp_path, monkeypatch, capsys):
    (tmp_path / "chain.json").write_text(json.dumps({"rows": [_chain_row(20, 1, 5.0, 0.5)]}))
    page = "<!-- rendered from chain.json by gap-chain: begin -->\n| x |\n<!-- rendered: end -->\n"
    with pytest.raises(ValueError, match="no renderer named 'chains'"):
        refreshed(page.replace("by gap-chain", "by chains"), tmp_path)
    with pytest.raises(ValueError, match=r"other\.json matches nothing under"):
        refreshed(page.replace("chain.json", "other.json"), tmp_path)
    # a file the renderer cannot read is named, not a KeyError
    (tmp_path / "other.json").write_text(json.dumps({"rows": [{"seed": 1}]}))
    with pytest.raises(ValueError, match=r"renderer gap-chain cannot read .*other\.json"):
        refreshed(page.replace("chain.json", "other.json"), tmp_path)
    monkeypatch.chdir(tmp_path)
    for bad, message in ((page.replace("by gap-chain", "by chains"), "no renderer named"),
                         (page.replace("chain.json", "missing.json"),
                          "missing.json matches nothing under .")):
        (tmp_path / "page.md").write_text(bad)
        assert doc_tables_main(["page.md"]) == 2
        err = capsys.readouterr().err
        assert err.startswith("page.md: ") and message in err and err.count("\n") == 1
        assert (tmp_path / "page.md").read_text() == bad  # nothing written


def test_every_committed_moments_result_is_rendered_in_the_docs():
    shown = {path.resolve() for doc in DOCS
             for block in RENDERED.finditer(doc.read_text(encoding="utf-8"))
             for path in block_paths(block["paths"], ROOT)}
    committed = {p.resolve() for p in (ROOT / "results" / "moments").glob("*.json")}
    # quoted in prose only; the ratios are checked against the pairs they came from below
    elsewhere = {ROOT / "results" / "moments" / name
                 for name in ("gate_clusters_cnn.json", "variants_ratios.json")}
    assert committed - elsewhere <= shown, f"results/moments files no docs table renders: " \
        f"{sorted(str(p.relative_to(ROOT)) for p in committed - elsewhere - shown)}"


def test_the_committed_variant_ratios_are_those_of_their_fidelity_pairs():
    saved = json.loads((ROOT / "results" / "moments" / "variants_ratios.json").read_text())
    for benchmark, ratios in saved.items():
        pairs = json.loads((ROOT / "results" / "moments" /
                            f"variants_fidelity_{benchmark}.json").read_text())
        assert ratios == {"pairs": len(pairs["pairs"]["pairs"]),
                          "rows": result_tables.moment_ratios(pairs)}


def test_the_injections_table_compares_each_pair_with_exact_moments(tmp_path):
    def row(name: str, method: str, per_seed: list[float], truths: list[float], **settings):
        folder = tmp_path / name
        _write(folder, _results(method, per_seed, **settings))
        rows = [{"seed": 1, "task": t, "true_fsd": true, "estimate": 0.5 * true, "ratio": 0.5}
                for t, true in enumerate(truths, 1)]
        (folder / "gap.md").write_text(continual.gap_markdown(rows))
        return folder

    exact = row("Q2-exact", "bgln-d-exact", [95.0, 95.2], [8.0, 4.0, 2.0, 1.0])
    whole = row("Q9-whole", "bgln-d-corrected", [95.0, 95.2], [8.0, 4.0, 2.0, 1.0])
    cut = row("Q17-cut", "bgln-d-corrected-cut", [94.0], [8.0, 8.0, 4.0, 2.0])
    ranked = row("Q18-r16", "bgln-d-corrected", [94.5, 94.7], [16.0, 4.0, 2.0, 1.0],
                 injection_rank=16)
    table = result_tables.injections_against_exact_table([exact, whole, cut, ranked])
    lines = table.splitlines()
    assert "exact moments' (4 pairs) | pairs above 1.5× |" in lines[0]
    assert lines[2] == ("| Q9 | whole covariance | 95.10 ± 0.10 (95.00, 95.20) | 0.00 | "
                        "1.00–1.00× | 0 | 0.50–0.50 |")
    assert lines[3] == "| Q17 | rank 8 (seed 1) | 94.00 | 0.00 | 1.00–2.00× | 3 (tasks 2–4) | " \
                       "0.50–0.50 |"
    assert lines[4].startswith("| Q18 | rank 16 | ") and "| 1 (task 1) |" in lines[4]
    again = row("Q2b-exact", "bgln-d-exact", [95.1], [4.0, 4.0, 2.0, 1.0])  # the reference rerun
    assert result_tables.injections_against_exact_table([exact, again]).splitlines()[2].startswith(
        "| Q2b | none (exact moments) (seed 1) | 95.10 | 0.00 | 0.50–1.00× | 0 |")
    (tmp_path / "Q3-unmeasured").mkdir()
    with pytest.raises(ValueError, match=r"no gap\.md"):
        result_tables.injections_against_exact_table([exact, tmp_path / "Q3-unmeasured"])


def test_spans_join_consecutive_numbers():
    assert result_tables._spans([9, 4, 5, 6]) == "4–6, 9"
    assert result_tables._spans([3]) == "3"


def test_the_protocol_column_and_the_row_tables_compare_the_same_settings(tmp_path):
    # a coreset size off the defaults is named by both (the report once left it out)
    _write(tmp_path / "R1-ntk", _results("ntk", [99.5], coreset_size=256))
    assert "coreset size 256" in continual.row_tables([str(tmp_path)])
    assert "**not paper protocol**: coreset_size" in continual.report([str(tmp_path)])


def test_wall_tables_time_each_row_against_the_fine_tuning_of_the_same_work(tmp_path, capsys):
    def timed(method, walls, **settings):
        raw = _results(method, [99.0] * len(walls), **settings)
        raw["wall_seconds"] = {"per_seed": walls, "total": sum(walls)}
        return raw

    _write(tmp_path / "S2-finetune", timed("finetune", [60.0, 120.0]))       # 1.5 min
    _write(tmp_path / "S3-finetune", timed("finetune", [600.0]))             # a later one
    _write(tmp_path / "S0-finetune", timed("finetune", [6.0], validation=0.1))  # held out
    _write(tmp_path / "S5-finetune", timed("finetune", [30.0], epochs=2))    # 0.5 min
    _write(tmp_path / "S1-bgln-s", timed("bgln-s", [360.0, 180.0, 270.0]))    # 4.5 min
    _write(tmp_path / "S6-bgln-d", timed("bgln-d", [45.0], epochs=2))        # 0.75 min
    _write(tmp_path / "S7-bgln-d", timed("bgln-d", [90.0], width=100))       # no baseline
    lines = continual.wall_tables([str(tmp_path)]).splitlines()
    assert lines[0] == ("| row | method | differs from the defaults | seeds | min/seed | "
                        "× fine-tuning | machine |")
    by_row = {line.split(" | ")[0][2:]: line for line in lines[2:]}
    assert list(by_row) == ["S0", "S1", "S2", "S3", "S5", "S6", "S7"]
    # the lowest row id of the same work is the baseline: 4.5 / 1.5, not 4.5 / 10
    assert by_row["S1"] == "| S1 | bgln-s | – | 1 2 3 | 4.5 | 3.0× (S2) | cpu, 1 thread |"
    assert by_row["S6"] == "| S6 | bgln-d | epochs 2 | 1 | 0.8 | 1.5× (S5) | cpu, 1 thread |"
    assert by_row["S7"] == "| S7 | bgln-d | width 100 | 1 | 1.5 | – | cpu, 1 thread |"
    assert " | 1.5 | – | " in by_row["S2"]
    # the command prints it; it has no figure
    capsys.readouterr()
    assert main(["cl", "report", str(tmp_path), "--wall"]) == 0
    assert capsys.readouterr().out == continual.wall_tables([str(tmp_path)]) + "\n"
    assert main(["cl", "report", str(tmp_path), "--wall", "--rows"]) == 2
    assert main(["cl", "report", str(tmp_path), "--wall", "--plot",
                 str(tmp_path / "w.png")]) == 2
    assert "no figure" in capsys.readouterr().err


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
    assert "different tables" in capsys.readouterr().err
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


def _gap_rows(seed: int, ratios: list[float], linearized: bool = False) -> list[dict]:
    rows = []
    for task, ratio in enumerate(ratios, 1):
        true = 16.0 / 2**task  # powers of two: every derived ratio prints exactly
        row = {"seed": seed, "task": task, "after_task": len(ratios) + 1, "finished": True,
               "true_fsd": true, "estimate": ratio * true, "ratio": ratio}
        if linearized:
            row["linearized"] = 0.5 * true
        rows.append(row)
    return rows


@pytest.mark.parametrize("linearized", [False, True])
def test_a_gap_table_reads_back_as_fsd_cl_gap_printed_it(linearized):
    rows = _gap_rows(20, [0.25, 1e-6, 3.5], linearized) + _gap_rows(21, [0.5, 2.0, 7e-3],
                                                                     linearized)
    printed = continual.gap_markdown(rows)
    read = continual.read_gap_markdown(printed)
    assert continual.gap_markdown(read) == printed
    assert [(r["seed"], r["task"]) for r in read] == [(r["seed"], r["task"]) for r in rows]
    assert read[1]["ratio"] == 1e-6 and read[2]["estimate"] == 7.0
    # seeds run apart and joined with blank lines, under one header or one each
    one, two = continual.gap_markdown(rows[:3]), continual.gap_markdown(rows[3:])
    headless = "\n".join(two.splitlines()[2:]) + "\n"
    for joined in (one + "\n" + two, one + "\n" + headless):
        assert continual.gap_markdown(continual.read_gap_markdown(joined)) == printed


def test_reading_a_gap_table_marks_unfinished_seeds_and_skips_the_layer_table():
    rows = _gap_rows(20, [0.1, 0.2])
    rows[0]["layers"] = rows[1]["layers"] = [{"layer": "0", "estimate": 1.0,
                                              "linearized": 2.0}]
    text = ("seed 20 has not finished: compared at its latest checkpoint, after task 3\n\n"
            + continual.gap_markdown(rows) + "\n" + reporting.gap_layers_markdown(rows))
    read = continual.read_gap_markdown(text)
    assert len(read) == 2
    assert all(not r["finished"] and r["after_task"] == 3 for r in read)
    with pytest.raises(ValueError, match=r"x\.md holds no table of fsd cl gap"):
        continual.read_gap_markdown("no table\n", "x.md")
    # a ratio printed to three decimals (older versions) is taken from the two columns
    old = ("| seed | task | true FSD | summary's estimate | estimate / true |\n"
           "|---:|---:|---:|---:|---:|\n| 20 | 1 | 213 | 0.00315 | 0.000 |\n"
           "| 20 | 2 | 8 | 0.246 | 0.0308 |\n")
    assert [r["ratio"] for r in continual.read_gap_markdown(old)] == [0.00315 / 213, 0.0308]
    bad = continual.gap_markdown(rows).replace("| 20 | 2 |", "| 20 | two |")
    with pytest.raises(ValueError, match=r"x\.md, line 4: not a row"):
        continual.read_gap_markdown(bad, "x.md")


def test_gap_tables_show_the_spread_and_task_one_per_seed(tmp_path, capsys):
    bench = tmp_path / "split-mnist"
    _write(bench / "S10-osla", _results("osla", [99.0, 98.0]))
    (bench / "S10-osla" / "gap.md").write_text(
        continual.gap_markdown(_gap_rows(1, [0.5, 0.25]) + _gap_rows(2, [1e-4, 2.0])))
    (bench / "S2-stopped").mkdir()  # a run stopped early: gap.md without results.json
    (bench / "S2-stopped" / "gap.md").write_text(
        "seed 20 has not finished: compared at its latest checkpoint, after task 2\n\n"
        + continual.gap_markdown(_gap_rows(20, [3e-6])))
    _write(bench / "S3-finetune", _results("finetune", [90.0]))  # no gap.md: not shown
    lines = continual.gap_tables([str(tmp_path)]).splitlines()
    assert lines[2:] == [
        "| S2 | – | 20 (after task 2) | 1 | 3e-06, 3e-06, 3e-06 | 8 | 2.4e-05 |",
        # ratios 0.5, 0.25, 1e-4, 2: median (0.25 + 0.5) / 2
        "| S10 | osla | 1 2 | 1–2 | 0.0001, 0.375, 2 | 8, 8 | 4, 0.0008 |"]
    assert main(["cl", "report", str(tmp_path), "--gap"]) == 0
    assert capsys.readouterr().out == continual.gap_tables([str(tmp_path)]) + "\n"
    assert main(["cl", "report", str(tmp_path), "--gap", "--tune"]) == 2
    assert "different tables" in capsys.readouterr().err
    page = ("<!-- fsd cl report split-mnist/S* --gap: begin -->\n| old |\n"
            "<!-- fsd cl report: end -->\n")
    assert "| S10 | osla | 1 2 |" in refreshed(page, tmp_path)
    with pytest.raises(ValueError, match=r"no gap\.md"):
        continual.gap_tables([str(bench / "S3-finetune")])
    (bench / "notarow").mkdir()
    (bench / "notarow" / "gap.md").write_text(continual.gap_markdown(_gap_rows(1, [1.0])))
    with pytest.raises(ValueError, match="not a row folder"):
        continual.gap_tables([str(bench)])


def test_gap_plot_draws_every_ratio_of_every_row(tmp_path, capsys):
    bench = tmp_path / "permuted-mnist"
    _write(bench / "Q1-bgln-d", _results("bgln-d", [80.0, 90.0]))
    (bench / "Q1-bgln-d" / "gap.md").write_text(
        continual.gap_markdown(_gap_rows(1, [1e-5, 1e-3]) + _gap_rows(2, [1e-4, 0.0])))
    (bench / "Q2-stopped").mkdir()  # no results.json: labelled without a method
    (bench / "Q2-stopped" / "gap.md").write_text(continual.gap_markdown(_gap_rows(20, [0.5])))
    fig = reporting._gap_figure(reporting.read_gap_folders([str(tmp_path)]))
    (ax,) = fig.axes
    assert [t.get_text() for t in ax.get_yticklabels()] == ["Q1 bgln-d, 85.00 %", "Q2 –"]
    dots = [c.get_offsets() for c in ax.collections]
    # one dot per (seed, task) at its ratio, a ratio below the axis floor (0 here) at it
    assert sorted(dots[0][:, 0]) == pytest.approx([reporting.GAP_AXIS_FLOOR, 1e-5, 1e-4, 1e-3])
    assert list(dots[0][:, 1]) == [0, 0, 0, 0] and list(dots[1][:, 0]) == [0.5]
    medians = [line.get_xdata()[0] for line in ax.lines if line.get_color() == "black"]
    assert medians == pytest.approx([(1e-5 + 1e-4) / 2, 0.5])
    assert main(["cl", "report", str(tmp_path), "--gap", "--plot", str(tmp_path / "g.png")]) == 0
    assert (tmp_path / "g.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| Q1 | bgln-d |" in capsys.readouterr().out


def test_learning_tables_split_each_row_by_task(tmp_path, capsys):
    # _results' matrices: R = [[a, 50], [a, a]] per seed, so each task learns a and keeps a
    _write(tmp_path / "C3-corrected", _results("bgln-d-corrected", [98.0, 96.0],
                                                fsd_scale=10.0))
    raw = _results("osla", [97.0])
    raw["accuracy_matrix"]["1"] = [[99.0, 50.0], [95.0, 99.0]]  # task 1 forgets 4 points
    _write(tmp_path / "C10-osla", raw)
    lines = continual.learning_tables([str(tmp_path)]).splitlines()
    assert lines[2] == ("| C3 | bgln-d-corrected | 10 | 97.00 ± 1.00 (98.00, 96.00) | 97.00 | "
                        "0.00 | 97.00 → 97.00; 97.00 → 97.00 |")  # by row number
    assert lines[3] == "| C10 | osla | 1 | 99.00 | 97.00 | 0.00 | 99.00 → 95.00; 99.00 → 99.00 |"
    assert main(["cl", "report", str(tmp_path), "--learning"]) == 0
    assert capsys.readouterr().out.strip() == "\n".join(lines).strip()
    assert main(["cl", "report", str(tmp_path), "--learning", "--wall"]) == 2
    assert "different tables" in capsys.readouterr().err


def test_estimate_ratios_keep_two_digits_when_collapsed():
    assert result_tables._two_digits(0.246) == "0.25"
    assert result_tables._two_digits(0.00126) == "0.0013"  # not "0.00"
