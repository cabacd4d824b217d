"""The pipeline benchmark must keep running: ``bench/pipeline_schedules.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy): only that the script exits 0,
prints the table with the bubble prediction, and writes its JSON.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_run import run_bench

pytestmark = pytest.mark.slow  # a bench run end to end


def test_pipeline_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("pipeline_schedules.py", "--quick", json_out=tmp_path / "pipeline.json")
    assert "| PP=2 schedule | m | bubble (p-1)/(m+p-1) |" in stdout
    assert [r["contender"] for r in result["rows"]] == ["pp2_gpipe_m2", "pp2_1f1b_m2"]
    assert all(abs(r["bubble"] - 1 / 3) < 1e-9 and r["measured_ratio"] > 0 for r in result["rows"])
