"""The checksum benchmark must keep running: ``bench/checkpoint_io.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy): only that the script exits 0 and
prints both ratios.
"""

from __future__ import annotations

from pathlib import Path

from bench_run import run_bench


def test_checkpoint_io_bench_quick(tmp_path: Path) -> None:
    stdout, result = run_bench("checkpoint_io.py", "--quick", json_out=tmp_path / "io.json")
    assert "| save |" in stdout and "| load |" in stdout
    assert result["save_ratio"] > 0 and result["load_ratio"] > 0
