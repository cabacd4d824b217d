"""The pipeline benchmark must keep running: ``bench/pipeline.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy): only that the script exits 0,
prints the table with the bubble prediction, and writes its JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_pipeline_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "pipeline.json"
    proc = subprocess.run([sys.executable, "bench/pipeline.py", "--quick", "--json", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "| PP=2 schedule | m | bubble (p-1)/(m+p-1) |" in proc.stdout
    result = json.loads(out.read_text())
    assert [r["contender"] for r in result["rows"]] == ["pp2_gpipe_m2", "pp2_1f1b_m2"]
    assert all(abs(r["bubble"] - 1 / 3) < 1e-9 and r["measured_ratio"] > 0 for r in result["rows"])
