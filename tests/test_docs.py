"""The README and docs/ hold together: every relative link reaches a file, every ``#anchor``
a heading of its target (GitHub's slug rules), and every result file cited exists."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
RESULT_DIRS = (ROOT / "benchmarks" / "results", ROOT / "docs" / "results")

FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
# [text](target) and ![alt](target); the target ends at whitespace or ')'
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
# a result file: a dated name (or one whose prefix is elided with '…'), '*' as a wildcard
RESULT_NAME = re.compile(r"(?:\d{4}-\d\d-\d\d-|…)[\w.*…+-]*\.json")


def _prose(text: str) -> str:
    """The text with fenced code blocks and inline code spans blanked."""
    text = FENCE.sub("", text)
    return CODE_SPAN.sub(" ", text)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: its rendered text lower-cased, punctuation and symbols
    dropped, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = text.replace("`", "").lower()
    kept = []
    for ch in text:
        if ch in " -_" or unicodedata.category(ch)[0] in "LNM":
            kept.append(ch)
    return "".join(kept).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (repeats get -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for match in HEADING.finditer(FENCE.sub("", path.read_text())):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def links(path: Path) -> list[str]:
    """The link targets of a markdown file, outside code."""
    return LINK.findall(_prose(path.read_text()))


def test_slug_follows_github_rules():
    assert slug("Capacity: the largest model one GPU trains") == (
        "capacity-the-largest-model-one-gpu-trains"
    )
    assert slug("The tables at `0b70e4b`") == "the-tables-at-0b70e4b"
    assert slug("Ablation: precision × rounding × resets") == "ablation-precision--rounding--resets"
    assert slug("Checkpoints, resume and export") == "checkpoints-resume-and-export"


def broken_links(path: Path) -> list[str]:
    """The relative links of a markdown file whose file or heading anchor does not exist."""
    broken = []
    for target in links(path):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        dest = (path.parent / file_part).resolve() if file_part else path
        if not dest.exists():
            broken.append(f"{target}: no file {dest}")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading #{anchor} in {dest.name}")
    return broken


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_and_anchors_resolve(path):
    broken = broken_links(path)
    assert not broken, f"{path.name}: " + "; ".join(broken)


def test_broken_links_are_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A: part × two\n")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n[ok](other.md#a-part--two) [self](#page) [web](https://x.org/y)\n"
        "[gone](missing.md) [bad anchor](other.md#a-part-two) [no](#nowhere)\n"
        "`[in code](missing.md)`\n\n```\n[in a fence](missing.md)\n```\n"
    )
    assert [b.split(":")[0] for b in broken_links(page)] == [
        "missing.md",
        "other.md#a-part-two",
        "#nowhere",
    ]
    assert _cited_results(tmp_path / "other.md") == set()


def _cited_results(path: Path) -> set[str]:
    """Result file names cited in code spans or link targets."""
    text = FENCE.sub("", path.read_text())
    spans = [m.group(2) for m in CODE_SPAN.finditer(text)]
    return {name for chunk in spans + LINK.findall(text) for name in RESULT_NAME.findall(chunk)}


def _exists(name: str, files: list[str]) -> bool:
    base = name.rsplit("/", 1)[-1]
    if base.startswith("…"):
        return any(f.endswith(base[1:]) for f in files)
    pattern = re.compile(re.escape(base).replace(r"\*", ".*") + "$")
    return any(pattern.match(f) for f in files)


@pytest.mark.parametrize("path", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_cited_result_files_exist(path):
    files = [p.name for d in RESULT_DIRS for p in d.rglob("*") if p.is_file()]
    missing = sorted(n for n in _cited_results(path) if not _exists(n, files))
    assert not missing, f"{path.name} cites result files that are not there: {missing}"


def test_result_names_are_checked():
    files = ["2026-12-03-h200-capacity-7b.json", "2026-11-30-h200-ab-l2-ahead.json"]
    assert _exists("benchmarks/results/2026-12-03-h200-capacity-*.json", files)
    assert _exists("…-ab-l2-ahead.json", files)
    assert not _exists("2026-12-03-h200-capacity-13b.json", files)
    assert not _exists("…-l2-behind.json", files)
