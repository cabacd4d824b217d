"""The checksum benchmark must keep running: ``bench/checkpoint_io.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy). What is asserted is the bench's own
verdict: each row prints PASS exactly when its ratio meets the target, so a wrong verdict fails here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from bench_run import run_bench

pytestmark = pytest.mark.slow  # a bench run end to end


def test_checkpoint_io_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("checkpoint_io.py", "--quick", json_out=tmp_path / "io.json")
    for op in ("save", "load"):
        row = re.search(rf"^\| {op} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| <= 1\.15 \((PASS|MISS)\) \|$", stdout, re.M)
        assert row, f"no {op} row in:\n{stdout}"
        ratio = result[f"{op}_ratio"]
        assert float(row[3]) == round(ratio, 3)
        assert row[4] == ("PASS" if ratio <= 1.15 else "MISS"), row[0]
        # the medians are real timings of both sides (a patched-out side that did nothing would be ~0 ms)
        assert result["median_ms"][f"{op}_with"] > 0.1 and result["median_ms"][f"{op}_without"] > 0.1
