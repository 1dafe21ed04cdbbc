"""Generated figures: every block in README.md and docs/*.md is what its function renders
from the recorded results now (``python tools/figures.py --write`` rewrites them)."""

from __future__ import annotations

import pytest

from conftest import figures_module

figures = figures_module()


def test_every_block_is_what_its_data_renders():
    diffs = figures.check()
    assert not diffs, "run: python tools/figures.py --write\n" + "".join(diffs)


def test_every_registered_figure_is_on_a_page():
    used = {
        block.name
        for page in figures.pages()
        for block in figures.find_blocks(page.read_text().splitlines())
    }
    assert set(figures.REGISTRY) == used


@pytest.fixture
def demo(monkeypatch):
    """A registered figure whose text the test sets."""
    text = {"now": "fresh figure"}
    monkeypatch.setitem(figures.REGISTRY, "demo", lambda: text["now"])
    figures.render.cache_clear()
    yield text
    figures.render.cache_clear()


def test_a_hand_edit_inside_a_block_is_found_and_rewritten(tmp_path, demo):
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\nBefore.\n<!-- figures: demo -->\nfresh figure\n<!-- /figures -->\nAfter.\n"
    )
    assert figures.check([page]) == []
    edited = page.read_text().replace("fresh figure", "fresh figure, edited by hand")
    page.write_text(edited)
    (diff,) = figures.check([page])
    assert "-fresh figure, edited by hand" in diff and "+fresh figure" in diff
    assert figures.write([page]) == [page]
    assert "edited" not in page.read_text() and page.read_text().endswith("After.\n")


def test_data_that_moves_changes_the_block(tmp_path, demo):
    page = tmp_path / "page.md"
    page.write_text("<!-- figures: demo -->\nfresh figure\n<!-- /figures -->\n")
    demo["now"] = "new numbers"
    figures.render.cache_clear()
    assert len(figures.check([page])) == 1
    figures.write([page])
    assert page.read_text() == "<!-- figures: demo -->\nnew numbers\n<!-- /figures -->\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("<!-- figures: demo -->\nx\n", "not closed"),
        ("x\n<!-- /figures -->\n", "without an opening marker"),
        ("<!-- figures: demo -->\n<!-- figures: demo -->\n<!-- /figures -->\n", "inside"),
        ("<!-- figures: nothing-renders-this -->\n<!-- /figures -->\n", "no figure"),
    ],
)
def test_markers_that_do_not_pair_up_are_errors(tmp_path, demo, text, message):
    page = tmp_path / "page.md"
    page.write_text(text)
    with pytest.raises(figures.FigureError, match=message):
        figures.check([page])
