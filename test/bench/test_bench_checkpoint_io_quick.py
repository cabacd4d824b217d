"""The checksum benchmark must keep running: ``bench/checkpoint_io.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy): only that the script exits 0 and
prints both ratios.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_checkpoint_io_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "io.json"
    proc = subprocess.run([sys.executable, "bench/checkpoint_io.py", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| save |" in proc.stdout and "| load |" in proc.stdout
    result = json.loads(out.read_text())
    assert result["save_ratio"] > 0 and result["load_ratio"] > 0
