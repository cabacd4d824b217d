"""Each test's CPU in a whole run, its rank processes included, and a summary by file.

    PYTHONPATH=bench VEMESH_SUITE_CPU=/tmp/cpu python -m pytest -p suite_cpu    # one TSV per xdist worker
    python bench/suite_cpu.py /tmp/cpu [--top 40]                              # by file, then the costliest tests

A test's CPU is what its worker process and every process under it spent between the test's start and end: the
worker's own time and its reaped children's (``os.times``), and for each live process under it (a forkserver, a
torchrun agent) its own and its reaped children's (``/proc/PID/stat``). A forkserver reaps the ranks it forks, so
their time lands in the server's, which outlives the test: a count of the worker's waited children alone misses them
(a third of the suite's CPU in the twenty-ninth session's run). Processes orphaned to init are not counted. Linux only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest

TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _under(root: int) -> float:
    """CPU seconds of every live process under ``root`` (not ``root``), each with its reaped children's."""
    parent, spent = {}, {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = text[text.rindex(")") + 2:].split()  # after the command: state, ppid, ..., utime at 14 of stat(5)
        parent[int(entry)] = int(fields[1])
        spent[int(entry)] = sum(int(f) for f in fields[11:15]) / TICKS  # utime, stime, cutime, cstime
    children = defaultdict(list)
    for pid, ppid in parent.items():
        children[ppid].append(pid)
    total, todo = 0.0, list(children[root])
    while todo:
        pid = todo.pop()
        total += spent[pid]
        todo.extend(children[pid])
    return total


def _now() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system + _under(os.getpid())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):  # type: ignore[no-untyped-def]
    folder = os.environ.get("VEMESH_SUITE_CPU")
    if not folder:
        yield
        return
    cpu, wall = _now(), time.perf_counter()
    yield
    cpu, wall = _now() - cpu, time.perf_counter() - wall
    Path(folder).mkdir(parents=True, exist_ok=True)
    with open(Path(folder) / f"{os.getpid()}.tsv", "a") as out:
        out.write(f"{item.nodeid}\t{cpu:.2f}\t{wall:.2f}\n")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folder", help="the VEMESH_SUITE_CPU folder of a run")
    parser.add_argument("--top", type=int, default=30, help="how many of the costliest tests to list")
    args = parser.parse_args()
    rows = [line.rstrip("\n").split("\t") for f in sorted(Path(args.folder).glob("*.tsv")) for line in open(f)]
    if not rows:
        print(f"no rows in {args.folder}: run pytest with -p suite_cpu and VEMESH_SUITE_CPU={args.folder}",
              file=sys.stderr)
        return 2
    tests = [(node, float(cpu), float(wall)) for node, cpu, wall in rows]
    by_file: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for node, cpu, _ in tests:
        by_file[node.split("::")[0]][0] += cpu
        by_file[node.split("::")[0]][1] += 1
    total = sum(cpu for _, cpu, _ in tests)
    print(f"{len(tests)} tests, {total:,.0f} core-s")
    for name, (cpu, n) in sorted(by_file.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"{cpu:8.1f} {100 * cpu / total:5.1f}% {n:4d}  {name}")
    print(f"\nthe {args.top} costliest tests (core-s, wall s):")
    for node, cpu, wall in sorted(tests, key=lambda t: -t[1])[:args.top]:
        print(f"{cpu:8.1f} {wall:8.1f}  {node}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
