"""Code blocks in the docs run: a worked example that no longer works fails here."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fsd.model import rules

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _python_block_after(page: str, heading: str) -> str:
    text = (DOCS / page).read_text()
    section = text[text.index(heading):]
    match = re.search(r"```python\n(.*?)```", section, flags=re.S)
    assert match is not None, f"no python block after {heading!r} in {page}"
    return match.group(1)


def test_the_user_guides_rule_example_runs(capsys):
    saved = dict(rules.RULES)
    try:
        exec(compile(_python_block_after("user-guide.md", "### Adding a rule"), "user-guide",
                     "exec"), {"__name__": "user_guide_example"})
    finally:  # the example's rules are undone (the registry itself is shared by reference)
        rules.RULES.clear()
        rules.RULES.update(saved)
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == ["LAFTR", "BGLN", "BGLN"]
    values = [float(line.split()[1]) for line in lines]
    assert all(v > 0 for v in values)
    # one perturbed first layer: the three agree in order of magnitude
    assert max(values) / min(values) < 10


def test_the_user_guides_several_inputs_example_runs(capsys):
    exec(compile(_python_block_after("user-guide.md", "### Models with several inputs"),
                 "user-guide", "exec"), {"__name__": "user_guide_example"})
    words = capsys.readouterr().out.split()
    assert words[0] == "distance" and float(words[1]) > 0


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_docs_pages_have_no_unclosed_code_fences(page):
    assert (DOCS / page).read_text().count("```") % 2 == 0


ROOT = DOCS.parent
#: pages whose relative links are checked: the README, the guides and every docs page
LINKED_PAGES = sorted([ROOT / "README.md", ROOT / "DEVELOPERS.md", ROOT / "CHANGELOG.md",
                       *DOCS.glob("*.md")])
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")  # links and images
_FENCE = re.compile(r"```.*?```", re.S)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, code marks and punctuation dropped."""
    text = heading.strip().lower().replace("`", "")
    text = "".join(c for c in text if c.isalpha() or c.isdecimal() or c in " -_")
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for line in _FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        if match := re.match(r"#{1,6} (.*)", line):
            slug = _slug(match[1])
            count = seen.get(slug, 0)
            seen[slug] = count + 1
            anchors.add(slug if count == 0 else f"{slug}-{count}")
    return anchors


@pytest.mark.parametrize("page", LINKED_PAGES, ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(page):
    broken = []
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    for match in _LINK.finditer(text):
        target = match[1]
        if re.match(r"[a-z]+:", target):  # http(s), mailto: not checked offline
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert not broken, f"{page.name}: broken links {broken}"
