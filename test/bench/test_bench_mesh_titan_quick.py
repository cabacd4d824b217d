"""``bench/mesh_titan.py`` must keep running; its printed verdict must be the one its figures give.

Timings are not asserted (the machine is shared): the verdict is checked against the ratio and target
the bench wrote, so a bench that printed PASS for a miss (or the reverse) fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

from bench_run import run_bench


def test_mesh_titan_bench_runs(tmp_path: Path) -> None:
    stdout, result = run_bench("mesh_titan.py", "--world", "64", "--repeats", "1", json_out=tmp_path / "titan.json", timeout=120)
    row = re.search(r"^\| init \+ 3 flattens \+ 4 views \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| <= 1\.1 \((PASS|MISS)\) \|$",
                    stdout, re.M)
    assert row, stdout
    assert result["target"] == 1.1 and result["met"] == (result["ratio"] <= 1.1)
    assert row[4] == ("PASS" if result["met"] else "MISS")
    assert abs(float(row[3]) - result["vemesh_ms"] / result["torch_ms"]) < 0.5  # the median of ratios, near the ratio of medians
