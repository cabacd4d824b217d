"""``bench/mesh_titan.py`` must keep running (timings are not asserted: the machine is shared)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_mesh_titan_bench_runs(tmp_path: Path) -> None:
    out = tmp_path / "titan.json"
    proc = subprocess.run([sys.executable, "bench/mesh_titan.py", "--world", "64", "--repeats", "1", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "init + 3 flattens + 4 views" in proc.stdout
    assert json.loads(out.read_text())["ratio"] > 0
