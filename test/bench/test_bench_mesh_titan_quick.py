"""``bench/mesh_titan.py`` must keep running (timings are not asserted: the machine is shared)."""

from __future__ import annotations

from pathlib import Path

from bench_run import run_bench


def test_mesh_titan_bench_runs(tmp_path: Path) -> None:
    stdout, result = run_bench("mesh_titan.py", "--world", "64", "--repeats", "1", json_out=tmp_path / "titan.json", timeout=120)
    assert "init + 3 flattens + 4 views" in stdout
    assert result["ratio"] > 0
