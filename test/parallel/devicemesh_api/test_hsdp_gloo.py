"""torchtitan's HSDP mesh on 4 real gloo ranks: FSDP2 ``fully_shard`` on
``VESCALE_DEVICE_MESH["dp_replicate", "dp_shard_cp"]`` trains like one process, and a split dim
runs its own collectives."""

from __future__ import annotations

from hsdp_scenario import worker

from launch import run_ranks


def test_fsdp2_on_the_hsdp_view_matches_one_process():
    results = run_ranks(worker, 4, timeout=180, env={"OMP_NUM_THREADS": "1"})
    for rank, r in enumerate(results):
        assert r["hsdp_mesh"] == [[0, 1], [2, 3]], r
        assert r["max_diff"] < 1e-5, (rank, r["max_diff"])  # 3 AdamW steps
        assert r["dp_shard_group"] == [rank - rank % 2, rank - rank % 2 + 1]
        assert r["dp_shard_sum"] == sum(r["dp_shard_group"])
