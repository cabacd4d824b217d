"""Every ``vemesh.x.y`` that vemesh's docstrings, error messages, docs and example name resolves.

A dotted name in the text is imported (the longest module prefix) and its attributes looked up, so a
module that moves takes its references with it. Two kinds of text name old paths on purpose and are
left out: the "was" column of docs/architecture.md's table of moves, and a path after "moved from".
File names that start with ``vemesh.`` (the checkpoint's ``vemesh.json`` and ``.vemesh.lock``) are files.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOTTED = re.compile(r"(?<![\w./])vemesh(?:\.[A-Za-z_]\w*)+")
FILES = {"vemesh.json", "vemesh.lock"}  # checkpoint files, not modules


def _texts() -> list[Path]:
    return sorted([*(REPO / "vemesh").rglob("*.py"), *(REPO / "docs").glob("*.md"), REPO / "README.md",
                   *(REPO / "examples").rglob("*.py"), *(REPO / "examples").rglob("*.md")])


def _names(path: Path) -> list[tuple[int, str]]:
    found = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if path.name == "architecture.md" and line.startswith("| `vemesh."):
            line = line.split("|")[2]  # the "is" column only
        line = re.sub(r"moved from `vemesh[\w.]*`", "", line)
        found += [(n, m.rstrip(".")) for m in DOTTED.findall(line) if m.rstrip(".") not in FILES]
    return found


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError:
            continue
        for attr in parts[i:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_every_dotted_vemesh_name_in_the_text_resolves() -> None:
    seen = {(p, n, name) for p in _texts() for n, name in _names(p)}
    assert len(seen) > 100  # the scan finds the references (they are many)
    bad = sorted(f"{p.relative_to(REPO)}:{n}: {name}" for p, n, name in seen if not _resolves(name))
    assert not bad, "names of modules or objects that do not exist:\n" + "\n".join(bad)
