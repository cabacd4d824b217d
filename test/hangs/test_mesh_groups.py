"""The groups a hang dump names (layer 2): on torch's fake backend, every rank of a (PP, DP, TP) mesh with a
flattened and a split name describes, by process-group name, exactly the groups the layout's arithmetic gives, and
the members of a group of the user's own (``dist.new_group``)."""

from __future__ import annotations

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VESCALE_DEVICE_MESH as mesh
from vemesh.hangs.dumps import Layout


def test_every_rank_describes_the_groups_the_layout_gives() -> None:
    world, seen = 16, {}
    try:
        for rank in range(world):
            mesh.reset()
            if dist.is_initialized():
                dist.destroy_process_group()
            dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
            mesh.init_device_mesh("cpu", (2, 4, 2), mesh_dim_names=("PP", "DP", "TP"))
            mesh.flatten(("DP", "TP"), "dp_tp")
            mesh.split("DP", ("dp_replicate", "dp_shard"), (2, 2))
            own = dist.new_group([0, 1, 5])  # a group of the user's own: its members, not only those seen in a dump
            doc = mesh.hang_description()
            mine = {g["dim"]: g["ranks"] for g in doc["groups"].values() if g["dim"].startswith("group ")}
            assert mine == ({f"group {own.group_name}": [0, 1, 5]} if rank in (0, 1, 5) else {}), (rank, mine)
            layout = mesh.layout
            assert doc["coordinate"] == list(layout.coordinate(rank))
            dims = {g["dim"]: g["ranks"] for g in doc["groups"].values()}
            for name in ("PP", "DP", "TP", "dp_tp", "dp_replicate", "dp_shard"):
                assert dims[name] == layout.group_ranks(rank, name), (rank, name)
            assert dims["world"] == list(range(world))
            # the dump's layout gives the same coordinates and groups, as vemesh diagnose reads it
            read = Layout(tuple(doc["shape"]), tuple(doc["dim_names"]), tuple(doc["strides"]), doc["first_rank"])
            assert list(read.coordinate(rank).values()) == doc["coordinate"]
            for name in read.dim_names:
                assert read.group(rank, (name,)) == layout.group_ranks(rank, name)
            seen[rank] = sorted(g["dim"] for g in doc["groups"].values() if g["dim"] not in mine)
        # one process group per name on every rank (their names are the same across the ranks of a real job, which
        # makes them in one order: the dumps of test_hang_jobs.py show it; here one process re-inits, so they count on)
        assert all(s == ["DP", "PP", "TP", "dp_replicate", "dp_shard", "dp_tp", "world"] for s in seen.values()), seen[0]
    finally:
        mesh.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
