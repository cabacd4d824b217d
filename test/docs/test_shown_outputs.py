"""Every shown output of the ``vemesh`` command in the README and docs/ is what the command prints now.

``docs/regenerate.py`` writes them; this test fails on any block that drifted (a hand edit, or a
change of the command's output), naming the file, the line and the command.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "docs"))
import regenerate  # noqa: E402

BLOCKS = [b for path in regenerate.documents() for b in regenerate.shown(path)]


def _slow(block: regenerate.Shown) -> bool:
    shaped = any(flag in block.argv for flag in ("--pp", "--tp", "--dp"))
    return "--model" in block.argv and "--device-memory" in block.argv and not shaped  # a search: 25 s


@pytest.mark.parametrize("block", [pytest.param(b, marks=[pytest.mark.slow] if _slow(b) else [],
                                                id=f"{b.path.name}:{b.line}") for b in BLOCKS])
def test_a_shown_output_is_what_the_command_prints(block) -> None:
    assert regenerate.output_of(block.argv) == block.output, (
        f"{block.path.name}:{block.line}: the output shown for `{block.command.splitlines()[0]}` differs from what it "
        "prints now; run python docs/regenerate.py")


def test_there_are_shown_outputs_to_check() -> None:
    assert len(BLOCKS) >= 4


def test_a_hand_edit_is_caught(tmp_path) -> None:
    block = next(b for b in BLOCKS if not _slow(b))
    edited = block.output.replace("\n", " (edited)\n", 1)
    assert regenerate.output_of(block.argv) != edited


TOPICS = ["mesh", "views", "data-parallel", "pipeline", "context-parallel", "moe", "checkpoints", "fault-tolerance",
          "planning", "vescale", "troubleshooting"]


def test_the_front_page_is_short_and_links_every_topic_page() -> None:
    readme = (ROOT / "README.md").read_text()
    assert readme.count("\n") <= 200
    for topic in TOPICS:
        assert (ROOT / "docs" / f"{topic}.md").exists() and f"(docs/{topic}.md)" in readme, topic


def test_the_api_reference_is_the_docstrings_of_today() -> None:
    assert (ROOT / "docs" / "api.md").read_text() == regenerate.api_markdown(), (
        "docs/api.md differs from the docstrings; run python docs/regenerate.py")
