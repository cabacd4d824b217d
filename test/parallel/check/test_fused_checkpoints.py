"""A fused weight's strided TP shard (and its AdamW state) through vemesh's checkpoints: torch's DCP describes one
chunk per rank and refuses it ("overlapping chunks"); vemesh writes one chunk per block of rows, so a checkpoint
saved at TP 2 under FSDP2 loads exactly at TP 1 and at TP 2 (4 gloo ranks)."""

from __future__ import annotations

import pytest

from launch import run_ranks
from parallel.check.fused_scenarios import save_then_load


@pytest.mark.parametrize("load_tp", [1, 2])
def test_a_fused_weight_saved_at_tp2_loads_exactly(tmp_path, load_tp: int) -> None:  # type: ignore[no-untyped-def]
    results = run_ranks(save_then_load, 4, str(tmp_path / "ckpt"), 2, load_tp, timeout=120)
    assert all(all(r.values()) for r in results), results
