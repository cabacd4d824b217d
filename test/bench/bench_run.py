"""Run a ``bench/`` script as a user would, for the smoke tests beside this file.

Timings are never asserted (the machine is shared and noisy): a smoke test checks that the
script exits 0, prints its tables and writes its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str, json_out: Path | None = None, timeout: float = 240) -> tuple[str, Any]:
    """``python bench/<script> *args`` (plus ``--json json_out``): its stdout, and the JSON it wrote (or None)."""
    cmd = [sys.executable, f"bench/{script}", *args] + (["--json", str(json_out)] if json_out else [])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                          env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, json.loads(json_out.read_text()) if json_out else None
