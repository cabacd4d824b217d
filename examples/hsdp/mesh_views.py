"""torchtitan's HSDP + CP + TP mesh on VESCALE_DEVICE_MESH, and what every rank gets from it.

The mesh is ``(dp_replicate, dp_shard, cp, tp)`` with three flattened dims:

* ``dp = (dp_replicate, dp_shard)``: the data-parallel ranks (the batch is split over them);
* ``dp_shard_cp = (dp_shard, cp)``: where FSDP2 shards the parameters;
* ``dp_cp = (dp_replicate, dp_shard, cp)``: where the loss is averaged.

FSDP2 is then applied on the 2-D HSDP view ``mesh["dp_replicate", "dp_shard_cp"]``. This
script builds the mesh on 16 ranks of torch's fake backend, in this process, and prints every
rank's view; the same calls run unchanged under torchrun (``test/parallel/devicemesh_api/
test_hsdp_gloo.py`` runs them on 4 real gloo ranks and trains with ``fully_shard`` on the view):

    python examples/hsdp/mesh_views.py                 # every rank of (2, 2, 2, 2)
    vemesh show --shape 2,2,2,2 --names dp_replicate,dp_shard,cp,tp \\
        --flatten dp=dp_replicate,dp_shard --flatten dp_shard_cp=dp_shard,cp \\
        --flatten dp_cp=dp_replicate,dp_shard_cp --rank 5

Under torchrun, the training script would read::

    VESCALE_DEVICE_MESH.init_device_mesh("cuda", (2, 2, 2, 2), mesh_dim_names=NAMES)
    for dims, name in FLATTENS:
        VESCALE_DEVICE_MESH.flatten(dims, name)
    model = fully_shard(model, mesh=VESCALE_DEVICE_MESH["dp_replicate", "dp_shard_cp"])
"""
from __future__ import annotations

import warnings

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VeDeviceMesh

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
SHAPE = (2, 2, 2, 2)
FLATTENS = [(("dp_replicate", "dp_shard"), "dp"), (("dp_shard", "cp"), "dp_shard_cp"), (("dp_replicate", "dp_shard_cp"), "dp_cp")]


def view_of(rank: int) -> str:
    """One line: what ``rank`` gets from the mesh (its HSDP view and its groups)."""
    dist.init_process_group("fake", rank=rank, world_size=16, store=FakeStore())
    try:
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
        for dims, name in FLATTENS:
            mesh.flatten(dims, name)
        hsdp = mesh["dp_replicate", "dp_shard_cp"]
        groups = ", ".join(f"{d} {dist.get_process_group_ranks(mesh.get_group(d))}" for d in ("dp_shard_cp", "cp", "tp"))
        return (f"rank {rank:2d}: {tuple(mesh.get_coordinate())}, HSDP view {hsdp.mesh.tolist()}, "
                f"dp index {mesh.lookup_rank('dp')} of {mesh.get_strategy_size('dp')}, groups: {groups}")
    finally:
        dist.destroy_process_group()


def main() -> None:
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")  # torch's note on its slicing
    print(f"torchtitan's mesh {dict(zip(NAMES, SHAPE))} with dp, dp_shard_cp, dp_cp flattened; every rank's view:")
    for rank in range(16):
        print(view_of(rank))


if __name__ == "__main__":
    main()
