"""``bench/suite_cpu.py``: a test's CPU counts the processes under its worker that a forkserver reaps, not only
the children the worker waits for itself."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import textwrap
import time

from bench_run import ROOT


def _load():
    spec = importlib.util.spec_from_file_location("suite_cpu", ROOT / "bench" / "suite_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_grandchild_reaped_by_a_live_child_is_counted_while_that_child_lives(tmp_path) -> None:
    """A live child (a forkserver's place) starts a grandchild that burns CPU, reaps it, and waits: the
    grandchild's time is in the live child's reaped children's, which ``_under`` counts and ``os.times`` of this
    process cannot see until the child ends."""
    suite_cpu = _load()
    ready = tmp_path / "ready"
    server = textwrap.dedent(f"""
        import pathlib, subprocess, sys, time
        subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.4\\n"
                        "while time.process_time() < end: pass"], check=True)
        pathlib.Path({str(ready)!r}).write_text("done")
        time.sleep(30)
    """)
    before = suite_cpu._under(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", server])
    try:
        for _ in range(600):
            if ready.exists():
                break
            time.sleep(0.05)
        assert ready.exists()
        assert suite_cpu._under(os.getpid()) - before >= 0.35
    finally:
        child.kill()
        child.wait()
