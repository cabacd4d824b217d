"""Keep bench/train_step.py runnable: its --quick smoke run must finish and print every ratio."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[3] / "bench" / "train_step.py"


def test_train_step_quick() -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick"], capture_output=True, text=True, timeout=240, env=env, check=False
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for line in ["vemesh DDP / torch DDP", "ZeroRedundancyOptimizer", "vemesh grad sync", "state bytes / rank",
                 "reduce_scatter+all_gather / all_reduce"]:
        assert line in proc.stdout, f"missing {line!r} in:\n{proc.stdout}"
