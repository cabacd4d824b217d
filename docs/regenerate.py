"""Regenerate every shown output of the ``vemesh`` command in the README and docs/, and docs/api.md; or check them.

A fenced ``console`` block whose first line is ``$ vemesh ...`` (continued with ``\\`` over several
lines if long) is generated: the rest of the block is what that command prints now, stdout then
stderr, run in this process through :func:`vemesh.cli.main`. Nothing of it is typed by hand.
``docs/api.md`` is the public names of vemesh with the first paragraph of each docstring.

    python docs/regenerate.py            # rewrite the blocks that differ
    python docs/regenerate.py --check    # exit 1 and name the blocks that differ (the tests do this)
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import io
import re
import shlex
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: a console block that starts with a vemesh command
BLOCK = re.compile(r"```console\n(\$ vemesh (?:[^\n]*\\\n)*[^\n]*)\n(.*?)```", re.S)


@dataclass(frozen=True)
class Shown:
    """One generated block: where it is, its command and the output shown."""

    path: Path
    line: int
    command: str  #: as written, continuation lines included
    output: str

    @property
    def argv(self) -> list[str]:
        return shlex.split(self.command[2:].replace("\\\n", " "))[1:]  # after "$ vemesh"


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def shown(path: Path) -> Iterator[Shown]:
    text = path.read_text()
    for m in BLOCK.finditer(text):
        yield Shown(path, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))


def output_of(argv: list[str]) -> str:
    """What ``vemesh ARGV`` prints: stdout, then stderr."""
    from vemesh.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        main(argv)
    return out.getvalue() + err.getvalue()


def regenerate(path: Path, check: bool) -> list[str]:
    """Rewrite (or only compare) the generated blocks of ``path``; return the ones that differed."""
    text = path.read_text()
    stale = []

    def replace(m: re.Match[str]) -> str:
        block = Shown(path, text.count("\n", 0, m.start()) + 1, m.group(1), m.group(2))
        now = output_of(block.argv)
        if now != block.output:
            stale.append(f"{path.relative_to(ROOT)}:{block.line}: {block.command.splitlines()[0]}")
        return f"```console\n{block.command}\n{now}```"

    new = BLOCK.sub(replace, text)
    if not check and new != text:
        path.write_text(new)
    return stale


#: The public modules whose names docs/api.md lists, in this order.
API_MODULES = ["vemesh", "vemesh.mesh", "vemesh.layout", "vemesh.plan", "vemesh.ddp", "vemesh.optim",
               "vemesh.checkpoint", "vemesh.context_parallel", "vemesh.ft", "vemesh.estimate", "vemesh.fit",
               "vemesh.measure"]


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
    args = parser.parse_args(argv)
    stale = [s for path in documents() if path.name != "api.md" for s in regenerate(path, args.check)]
    stale += regenerate_api(args.check)
    for s in stale:
        print(("stale: " if args.check else "regenerated: ") + s)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
