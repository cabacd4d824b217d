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


def test_the_mesh_is_composed_and_its_base_classes_read_only_its_public_answers() -> None:
    """``VeDeviceMesh`` owns its state (the layout, this rank's place) and one ``TorchViews`` per epoch (torch's
    meshes and caches); its base classes (the rank arithmetic, veScale's names) hold nothing and read no private
    attribute of the mesh: they ask ``layout``, ``get_rank()`` and the public queries."""
    from vemesh.mesh.manager import VeDeviceMesh

    bases = [b for b in VeDeviceMesh.__mro__[1:] if b.__module__.startswith("vemesh.")]
    assert {b.__name__ for b in bases} == {"LayoutQueries", "VeScaleAliases"}, bases
    for base in bases:
        tree = ast.parse(Path(__import__(base.__module__, fromlist=["_"]).__file__).read_text())
        private = [ast.unparse(n) for n in ast.walk(tree)
                   if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self"
                   and n.attr.startswith("_") and not n.attr.startswith("__")]
        assert not private, (base.__name__, private)
    mesh = VeDeviceMesh()
    assert set(vars(mesh)) == {"_torch", "_layout", "_rank", "_coordinate", "_member", "_timeout", "_epoch",
                               "_entered", "_built_on"}
