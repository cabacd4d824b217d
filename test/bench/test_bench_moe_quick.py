"""The MoE benchmark must keep running: ``bench/expert_parallel.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy). What is exact is: the all-to-all bytes
each rank moves per step equal the analytic count (every token slot is sent once each way, forward and
backward), and each rank holds 1/EP of the expert parameters, gradients and AdamW state.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_run import run_bench

pytestmark = pytest.mark.slow


def test_moe_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("expert_parallel.py", "--quick", json_out=tmp_path / "moe.json")
    assert "MoE GPT on 4 gloo ranks" in stdout
    rows = result["ep"]
    cfg = result["config"]
    tokens = cfg["batch"] // 4 * cfg["seq"]
    analytic = 4 * cfg["layers"] * tokens * cfg["top_k"] * cfg["embd"] * 4
    assert rows["1"]["alltoall_bytes_per_rank"] == 0
    for ep in ("2", "4"):
        assert rows[ep]["alltoall_bytes_per_rank"] == analytic
        assert 0 < rows[ep]["off_rank_bytes_per_rank"] < analytic
        assert rows[ep]["expert_bytes_per_rank"] * int(ep) == rows["1"]["expert_bytes_per_rank"]
        assert rows[ep]["ratio_to_ep1"] > 0
