"""Regenerate every shown output of the README and docs/, and docs/api.md; or check them.

What is generated (the kinds of block are in ``docs/snippets.py``):

* the output of each ``$ vemesh ...`` console block, run in this process through :func:`vemesh.cli.main`;
* the start-up of each ``$ torchrun ...`` / ``$ python ...`` console block: what the command prints
  up to its first ``step`` line (a run that differs only in timings or throughput is left as it is);
* the ``text`` block after each ``python fake:N`` / ``python gloo:N`` snippet: what the snippet
  printed, on every rank in rank order;
* ``docs/api.md``: the public names of vemesh with the first paragraph of each docstring.

Nothing of it is typed by hand.

    python docs/regenerate.py                 # rewrite the blocks that differ
    python docs/regenerate.py --check         # exit 1 and name the blocks that differ (the tests do this)
    python docs/regenerate.py --only vemesh   # one kind: vemesh, run, python, api
    python docs/regenerate.py docs/mesh.md    # one document
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from snippets import ROOT, Block, blocks, documents, masked, run_snippet, startup  # noqa: E402

KINDS = ("vemesh", "run", "python", "api")


def output_of(argv: list[str]) -> str:
    """What ``vemesh ARGV`` prints: stdout, then stderr."""
    from vemesh.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(argv)
    return out.getvalue() + err.getvalue()


def vemesh_argv(block: Block) -> list[str]:
    return shlex.split(block.command)[1:]


def kind_of(block: Block) -> str | None:
    """Which generator owns ``block``: vemesh, run or python; None for a block nothing generates."""
    if block.lang == "console" and block.text.startswith("$ "):
        return "vemesh" if block.command.startswith("vemesh ") else "run"
    if block.lang == "python" and block.mode[0] != "not-run":
        return "python"
    return None


def generated(block: Block) -> tuple[Block, str, str]:
    """``(the block that holds the output, what it shows now, what it should show)``."""
    kind = kind_of(block)
    if kind == "vemesh":
        return block, block.shown, output_of(vemesh_argv(block))
    if kind == "run":
        return block, block.shown, startup(block.command)
    assert kind == "python", block.where
    printed = run_snippet(block)
    return (block.output or block), (block.output.text if block.output else ""), printed


def same(shown: str, now: str) -> bool:
    return masked(shown) == masked(now)


def regenerate(path: Path, check: bool, kinds: tuple[str, ...] = KINDS) -> list[str]:
    """Rewrite (or only compare) the generated blocks of ``path``; return the ones that differed."""
    text = path.read_text()
    stale, edits = [], []
    for block in blocks(path):
        if kind_of(block) not in kinds:
            continue
        if kind_of(block) == "python" and block.missing:
            print(f"{block.where}: left as it is, {', '.join(block.missing)} is not installed", file=sys.stderr)
            continue
        holder, shown, now = generated(block)
        if same(shown, now):
            continue
        stale.append(f"{block.where}: {block.text.splitlines()[0]}")
        if holder is not block:  # a snippet's text block
            edits.append((holder.start, holder.end, f"```text\n{now}```"))
        elif block.lang == "python":  # a snippet that printed, with no text block yet
            edits.append((block.end, block.end, f"\n\n```text\n{now}```"))
        else:
            head = block.text[: len(block.text) - len(block.shown)]
            edits.append((block.start, block.end, f"```{' '.join(block.info)}\n{head}{now}```"))
    if not check and edits:
        for start, end, new in sorted(edits, reverse=True):
            text = text[:start] + new + text[end:]
        path.write_text(text)
    return stale


#: The public modules whose names docs/api.md lists, in this order.
API_MODULES = ["vemesh", "vemesh.mesh", "vemesh.layout", "vemesh.planning.mesh_plan", "vemesh.ddp", "vemesh.optim",
               "vemesh.checkpoint", "vemesh.parallel.context", "vemesh.ft", "vemesh.planning.estimate", "vemesh.planning.fit",
               "vemesh.planning", "vemesh.planning.measure", "vemesh.planning.step_tracker", "vemesh.planning.fusion",
               "vemesh.planning.speedups",
               "vemesh.hangs", "vemesh.parallel", "vemesh.parallel.schedules", "vemesh.check", "vemesh.models.llama3"]


def _summary(obj: object) -> str:
    doc = inspect.getdoc(obj) or ""
    return doc.strip().split("\n\n")[0].replace("\n", " ") if doc else "(no docstring)"


def api_markdown() -> str:
    """docs/api.md: every public name of vemesh with the first paragraph of its docstring; classes with their methods."""
    lines = ["# API reference", "", "Generated from the docstrings by `python docs/regenerate.py`; a test fails when it "
             "drifts. The first paragraph of each docstring; the source has the rest.", ""]
    for name in API_MODULES:
        module = importlib.import_module(name)
        names = [n for n in getattr(module, "__all__", []) if n != "VESCALE_DEVICE_MESH" or name == "vemesh"]
        if name == "vemesh.mesh":
            names = ["VeDeviceMesh"]
        lines += [f"## `{name}`", "", _summary(module), ""]
        for n in names:
            obj = getattr(module, n)
            if inspect.ismodule(obj) or (name == "vemesh" and n in ("VeDeviceMesh",)):
                continue
            lines.append(f"- **`{n}`**: {_summary(obj) if callable(obj) or inspect.isclass(obj) else repr(obj)}")
            if inspect.isclass(obj):
                for m, member in inspect.getmembers(obj):
                    if m.startswith("_") or not (inspect.isfunction(member) or isinstance(member, property)):
                        continue
                    if m in getattr(obj, "__dict__", {}) or any(m in vars(b) for b in obj.__mro__[1:] if
                                                                 b.__module__.startswith("vemesh")):
                        lines.append(f"  - `{m}`: {_summary(member)}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def regenerate_api(check: bool) -> list[str]:
    path = ROOT / "docs" / "api.md"
    now = api_markdown()
    if path.exists() and path.read_text() == now:
        return []
    if not check:
        path.write_text(now)
    return ["docs/api.md"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a shown output is stale")
    parser.add_argument("--only", choices=KINDS, action="append", help="regenerate one kind of block (repeatable)")
    parser.add_argument("documents", nargs="*", type=Path, help="only these (default: README.md and docs/*.md)")
    args = parser.parse_args(argv)
    kinds = tuple(args.only or KINDS)
    paths = [p.resolve() for p in args.documents] or documents()
    for path in set(paths) - set(documents()):
        parser.error(f"{path} is not one of the documents: choose from {[str(d.relative_to(ROOT)) for d in documents()]}")
    stale = [s for path in paths for s in regenerate(path, args.check, kinds)]
    if "api" in kinds and not args.documents:
        stale += regenerate_api(args.check)
    for s in stale:
        print(("stale: " if args.check else "regenerated: ") + s)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
