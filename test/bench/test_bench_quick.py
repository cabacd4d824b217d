"""The benchmarks must keep running: ``bench/mesh_scale.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy); only that the
script exits 0, prints every table, and writes its JSON (and its plot, when
matplotlib is installed).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

HEADERS = [
    "Mesh init + views PP, DP, TP, DPxTP",
    "Per call: vemesh cached m[view] vs torch slicing",
    "Per call: vemesh get_strategy_coordinate(r) vs (grid == r).nonzero",
    "Per call: vemesh get_global_rank(c) vs int(grid[c])",
    "Per call: vemesh get_strategy_coordinate() vs torch get_coordinate()",
    "Growth per call",
    "Core issue: rank arithmetic vs (grid == r).nonzero() on 16x64x8",
]


def test_mesh_scale_quick(tmp_path: Path) -> None:
    out_json, out_png = tmp_path / "mesh_scale.json", tmp_path / "mesh_scale.png"
    proc = subprocess.run(
        [sys.executable, "bench/mesh_scale.py", "--quick", "--json", str(out_json), "--plot", str(out_png)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for header in HEADERS:
        assert header in proc.stdout, f"missing table {header!r} in:\n{proc.stdout}"
    assert "PASS" in proc.stdout or "MISS" in proc.stdout

    results = json.loads(out_json.read_text())
    assert {c["world"] for c in results["cases"]} == {64, 1024}
    assert {c["family"] for c in results["cases"]} == {"3-D", "4-D"}
    for case in results["cases"]:
        assert set(case["queries"]) == {"view", "coord", "rank", "mine"}

    if importlib.util.find_spec("matplotlib") is not None:
        assert out_png.read_bytes().startswith(b"\x89PNG")
    else:
        assert "matplotlib is not installed" in proc.stdout
