"""Regenerate every shown output of the ``vemesh`` command in the README and docs/, or check them.

A fenced ``console`` block whose first line is ``$ vemesh ...`` (continued with ``\\`` over several
lines if long) is generated: the rest of the block is what that command prints now, stdout then
stderr, run in this process through :func:`vemesh.cli.main`. Nothing of it is typed by hand.

    python docs/regenerate.py            # rewrite the blocks that differ
    python docs/regenerate.py --check    # exit 1 and name the blocks that differ (the tests do this)
"""

from __future__ import annotations

import argparse
import contextlib
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if a shown output is stale")
    args = parser.parse_args(argv)
    stale = [s for path in documents() for s in regenerate(path, args.check)]
    for s in stale:
        print(("stale: " if args.check else "regenerated: ") + s)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
