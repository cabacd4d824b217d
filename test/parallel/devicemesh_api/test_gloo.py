"""Layer 3: real gloo collectives over the mesh's groups, 8 and 4 processes.

Each rank computes the expected sums itself from the layout arithmetic, then
checks what the collective actually returned. The cases are grouped so the
whole file spawns three process groups.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed as dist

from launch import RankFailed, run_ranks


def _grid_group(shape, dims, rank):
    grid = np.arange(math.prod(shape)).reshape(shape)
    moved = np.moveaxis(grid, dims, tuple(range(len(shape) - len(dims), len(shape))))
    rows = moved.reshape(-1, math.prod(shape[d] for d in dims)).tolist()
    return next(r for r in rows if rank in r)


def _sum_over(group, rank):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t, group=group)
    return int(t.item())


def _eight_ranks(rank, world):
    from vemesh import VESCALE_DEVICE_MESH as mesh

    shape = (2, 2, 2)
    mesh.init_device_mesh("cpu", shape, mesh_dim_names=("PP", "DP", "TP"))
    checked = []
    for d, name in enumerate(("PP", "DP", "TP")):
        group = _grid_group(shape, (d,), rank)
        assert dist.get_process_group_ranks(mesh.get_group(name)) == group
        assert _sum_over(mesh[name].get_group(), rank) == sum(r + 1 for r in group), name
        checked.append(name)
    # a 2-D view, and its groups through torch's own API
    view = mesh["DP", "TP"]
    assert view.mesh.flatten().tolist() == _grid_group(shape, (1, 2), rank)
    assert _sum_over(view.get_group("TP"), rank) == sum(r + 1 for r in _grid_group(shape, (2,), rank))
    # flattened groups
    for dims in ((1, 2), (0, 1), (0, 2)):
        names = tuple(("PP", "DP", "TP")[d] for d in dims)
        flat = mesh.flatten(names)
        group = _grid_group(shape, dims, rank)
        assert _sum_over(flat.get_group(), rank) == sum(r + 1 for r in group), names
        assert _sum_over(mesh.get_group("_".join(names)), rank) == sum(r + 1 for r in group)
        checked.append("_".join(names))
    # point-to-point along the pipeline: send my rank forward, receive from behind
    nxt, prev = mesh.get_neighbor_rank("PP", 1, wrap=True), mesh.get_neighbor_rank("PP", -1, wrap=True)
    out, inbox = torch.tensor([rank]), torch.tensor([-1])
    reqs = [dist.isend(out, nxt), dist.irecv(inbox, prev)]
    for r in reqs:
        r.wait()
    assert inbox.item() == prev
    # the submesh of the next stage holds the ranks our neighbor sits with
    nb = mesh.get_neighbor_submesh("TP", along="PP", wrap=True)
    assert nb.mesh.tolist() == _grid_group(shape, (2,), nxt)
    # the stage's own submesh carries its real group
    stage = mesh.get_global_pipeline_parallel_meshes()[mesh.lookup_rank("PP")]
    assert stage is mesh["DP", "TP"]
    assert mesh.get_local_rank("TP") == mesh.mesh.get_local_rank("TP") == rank % 2
    with pytest.raises(RuntimeError, match=r"get_local_rank\(\) needs a dim on a mesh of 3 dims"):
        mesh.get_local_rank()  # as torch's mesh of 3 dims; the host's index is LOCAL_RANK, not a mesh query
    checked += _two_half_meshes(rank)
    checked += _experts_beside_context(rank)
    dist.barrier()
    return checked


def _experts_beside_context(rank):
    """(DP, CP, TP) = (2, 2, 2) with EP folded over DP x CP: an all-reduce on EP and one on CP in the same job.

    Expected groups come from Megatron's rule for expert groups (order tp-ep-dp: TP stride 1, EP
    stride 2, EDP stride 4), not from vemesh's arithmetic; then DP is split and still all-reduces.
    """
    from vemesh import VeDeviceMesh

    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("DP", "CP", "TP"))
    mesh.flatten(("DP", "CP"), "dp_cp")
    mesh.split("dp_cp", ("EDP", "EP"), (2, 2))
    ep = [rank % 2 + 2 * k + 4 * (rank // 4) for k in range(2)]
    cp = _grid_group((2, 2, 2), (1,), rank)
    assert dist.get_process_group_ranks(mesh.get_group("EP")) == ep
    assert _sum_over(mesh.get_group("EP"), rank) == sum(r + 1 for r in ep)
    assert _sum_over(mesh.get_group("CP"), rank) == sum(r + 1 for r in cp)
    edp = [rank % 4, rank % 4 + 4]
    assert _sum_over(mesh["EDP"].get_group(), rank) == sum(r + 1 for r in edp)
    mesh.split("DP", ("dp_replicate", "dp_shard"), (2, 1))  # DP keeps its group and its answers
    dp = _grid_group((2, 2, 2), (0,), rank)
    assert mesh.get_strategy_size("DP") == 2 and mesh.lookup_rank("DP") == rank // 4
    assert _sum_over(mesh.get_group("DP"), rank) == sum(r + 1 for r in dp)
    return ["EP", "CP"]


def _two_half_meshes(rank):
    """Two meshes over the halves of the world (ranks 0-3 and 4-7), each with its own collectives."""
    from vemesh import VeDeviceMesh

    first, second = VeDeviceMesh(), VeDeviceMesh()
    first.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"), rank_offset=0)
    second.init_device_mesh("cpu", (-1, 2), mesh_dim_names=("DP", "TP"), rank_offset=4)
    mine, other = (first, second) if rank < 4 else (second, first)
    base = 0 if rank < 4 else 4
    assert mine.get_coordinate() == ((rank - base) // 2, rank % 2)
    dp = [base + rank % 2, base + 2 + rank % 2]
    assert dist.get_process_group_ranks(mine.get_group("DP")) == dp
    assert _sum_over(mine.get_group("DP"), rank) == sum(r + 1 for r in dp)
    assert _sum_over(mine.get_group("TP"), rank) == sum(r + 1 for r in _grid_group((2, 2), (1,), rank - base)) + 2 * base
    # rank-agnostic queries answer in global ranks on every rank; own-place queries refuse outsiders
    assert second.get_strategy_coordinate(7) == [1, 1] and second.to_global_rank is not None
    assert [m.mesh.tolist() for m in second.get_submeshes("TP")] == [[4, 5], [6, 7]]
    try:
        other.lookup_rank("DP")
        raise AssertionError("an outsider got an answer about its own place")
    except RuntimeError as e:
        assert f"global rank {rank} is not in this mesh, which covers global ranks {4 - base}..{7 - base}" in str(e)
    return ["halves"]


def _four_ranks(rank, world):
    from vemesh import VeDeviceMesh

    results = {}
    mesh = VeDeviceMesh()
    # a -1 is inferred; a 1-D mesh defaults to DP
    mesh.init_device_mesh("cpu", (-1, 2))
    results["shape"] = mesh.shape
    results["tp_sum"] = _sum_over(mesh.get_group("TP"), rank)
    mesh.init_device_mesh("cpu", (4,))
    results["dp_names"] = mesh.mesh_dim_names
    results["dp_sum"] = _sum_over(mesh.get_group(), rank)
    # ranks that disagree fail loudly on every rank instead of hanging
    shape = (2, 2) if rank < 2 else (4, 1)
    try:
        mesh.init_device_mesh("cpu", shape)
    except ValueError as err:
        results["mismatch"] = str(err)
    names = ("DP", "TP") if rank != 3 else ("TP", "DP")
    try:
        mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
    except ValueError as err:
        results["names_mismatch"] = str(err)
    # the mesh from before the failed inits is untouched and still works
    results["after"] = (mesh.shape, _sum_over(mesh.get_group(), rank))
    return results


def test_collectives_over_views_and_flattened_groups_on_8_ranks():
    results = run_ranks(_eight_ranks, 8)
    assert all(r == ["PP", "DP", "TP", "DP_TP", "PP_DP", "PP_TP", "halves", "EP", "CP"] for r in results)


def test_inference_defaults_and_mismatch_on_4_ranks():
    results = run_ranks(_four_ranks, 4)
    for rank, res in enumerate(results):
        assert res["shape"] == (2, 2)
        assert res["tp_sum"] == (3 if rank < 2 else 7)
        assert res["dp_names"] == ("DP",) and res["dp_sum"] == 10
        assert "ranks disagree on the mesh" in res["mismatch"]
        assert "ranks [0, 1] have shape (2, 2); ranks [2, 3] have shape (4, 1)" in res["mismatch"]
        assert f"rank {rank} asked for shape" in res["mismatch"]
        # each rank marks the ranks whose names differ from its own: rank 3 sees the other three as "other"
        other, same = ([0, 1, 2], [3]) if rank == 3 else ([3], [0, 1, 2])
        assert re.search(rf"ranks {re.escape(str(same))} have shape \(2, 2\)[;.]", res["names_mismatch"])  # no "other"
        assert f"ranks {other} have shape (2, 2) (other dim names/device)" in res["names_mismatch"]
        assert res["after"] == ((4,), 10)


def _fails_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 1 never arrives: the launcher must not hang


def test_launcher_reports_a_failing_rank_instead_of_hanging():
    with pytest.raises(RankFailed, match=r"(?s)rank 1 .*boom on rank 1"):
        run_ranks(_fails_on_rank_one, 2, timeout=60)


def test_plain_python_gets_a_one_rank_group():
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR")}
    code = (
        "from vemesh import VESCALE_DEVICE_MESH as m\n"
        "m.init_device_mesh('cpu', (1, 1))\n"
        "print(m, m.get_strategy_size('TP'), m.get_local_rank('TP'))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "VeDeviceMesh((DP=1, TP=1), device_type='cpu', rank=0, coordinate=(0, 0)) 1 0" in out.stdout
