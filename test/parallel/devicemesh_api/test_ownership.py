"""Each piece of state has one owner: no vemesh module reads another module's private attributes.

A name ``obj._x`` where ``_x`` is an attribute some vemesh class assigns to ``self`` is a read of that class's
private state; it is allowed only in the module that assigns it (torch's own private names are not vemesh's).
"""

from __future__ import annotations

import ast
import collections
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[3] / "vemesh"
#: torch's private names that happen to match one of vemesh's (a process group's options keep their timeout).
TORCH_PRIVATE = (".options._timeout",)


def test_no_module_reads_another_modules_private_attributes() -> None:
    owners: dict[str, set[str]] = collections.defaultdict(set)
    reads: list[tuple[str, int, str]] = []
    for path in PACKAGE.rglob("*.py"):
        name = str(path.relative_to(PACKAGE.parent))
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or not node.attr.startswith("_") or node.attr.startswith("__"):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                if isinstance(node.ctx, ast.Store):
                    owners[node.attr].add(name)
            elif not ast.unparse(node).endswith(TORCH_PRIVATE):
                reads.append((name, node.lineno, ast.unparse(node)))
    assert owners  # the scan sees vemesh's classes
    bad = [f"{f}:{n}: {text} (owned by {sorted(owners[text.rsplit('.', 1)[1]])})" for f, n, text in reads
           if text.rsplit(".", 1)[1] in owners and f not in owners[text.rsplit(".", 1)[1]]]
    assert not bad, "\n".join(bad)
