"""The fault-recovery benchmark must keep running: ``bench/fault_recovery.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy). What is exact: the live path lost no process
of replica 0 and logged every step once; the restart path really restarted and resumed from the step
before the failure.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_run import run_bench

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow


def test_fault_recovery_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("fault_recovery.py", "--quick", json_out=tmp_path / "fr.json", timeout=400)
    assert "restart / live:" in stdout
    live, restart = result["live"], result["restart"]
    assert len(live["pids"]) == 1 and live["steps_logged"] == result["steps"]
    assert restart["restarted"]
    assert live["recovery_s"] > 0 and restart["recovery_s"] > 0 and result["ratio"] > 0
