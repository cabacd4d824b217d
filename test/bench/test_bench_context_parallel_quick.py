"""The context-parallel benchmark must keep running: ``bench/context_parallel.py --quick`` as a user would run it.

Step times are not asserted (this machine is shared and noisy). Memory is: MemTracker's peaks are
the same on every run, so the quick run's CP=2 / CP=1 ratios must be the ones BENCHMARKS.md
publishes (they do not depend on the sequence length), and head-tail balancing never needs more.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bench_run import ROOT, run_bench

pytestmark = pytest.mark.slow


def _published(sharding: str) -> float:
    """BENCHMARKS.md's ``/ CP=1`` figure for CP=2 at seq 1024 with this sharding."""
    row = re.search(rf"^\| 1024 \| 2 \| {sharding} \| [\d.]+ \| ([\d.]+) \|", (ROOT / "BENCHMARKS.md").read_text(), re.M)
    assert row, f"BENCHMARKS.md lost its CP=2 {sharding} row"
    return float(row[1])


def test_context_parallel_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("context_parallel.py", "--quick", json_out=tmp_path / "cp.json")
    assert "peak MemTracker bytes per rank" in stdout and "CP=2 / CP=1 =" in stdout
    peak = result["memory_peak_bytes"]
    assert set(peak) == {"seq256_cp1", "seq256_cp2", "seq256_cp2_balanced"}
    assert round(peak["seq256_cp2"] / peak["seq256_cp1"], 3) == _published("contiguous")
    assert round(peak["seq256_cp2_balanced"] / peak["seq256_cp1"], 3) == _published("head-tail")
    assert peak["seq256_cp2_balanced"] <= peak["seq256_cp2"]
    step = result["step"]
    assert step["ratio_cp2_over_cp1"] == pytest.approx(step["cp2_s"] / step["cp1_s"], rel=0.5)  # a median of ratios
