"""The context-parallel benchmark must keep running: ``bench/context_parallel.py --quick`` as a user would run it.

Timings and sizes are not asserted (this machine is shared and noisy): only that the script exits 0,
prints its tables and writes its JSON with every (seq, CP, sharding) figure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_run import run_bench

pytestmark = pytest.mark.slow


def test_context_parallel_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("context_parallel.py", "--quick", json_out=tmp_path / "cp.json")
    assert "peak MemTracker bytes per rank" in stdout and "CP=2 / CP=1 =" in stdout
    assert set(result["memory_peak_bytes"]) == {"seq256_cp1", "seq256_cp2", "seq256_cp2_balanced"}
    assert all(v > 0 for v in result["memory_peak_bytes"].values()) and result["step"]["ratio_cp2_over_cp1"] > 0
