"""torchtitan's HSDP + CP + TP mesh on every rank (fake backend): mixed views of flattened and
ordinary dims, and flattens over flattened dims, give the ranks that torch's own
``init_device_mesh`` + ``_flatten`` + slicing give, and answer every query."""

from __future__ import annotations

import warnings

import pytest
from torch.distributed.device_mesh import init_device_mesh

from vemesh import VeDeviceMesh

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
SHAPE = (2, 2, 2, 2)
FLATTENS = [(("dp_replicate", "dp_shard"), "dp"), (("dp_shard", "cp"), "dp_shard_cp"), (("dp_replicate", "dp_shard_cp"), "dp_cp")]
TORCH_FLATTENS = [(("dp_replicate", "dp_shard"), "dp"), (("dp_shard", "cp"), "dp_shard_cp"), (("dp_replicate", "dp_shard", "cp"), "dp_cp")]
VIEWS = [("dp_replicate", "dp_shard_cp"), ("dp", "cp"), ("dp_cp", "tp"), ("dp_shard_cp", "tp"), ("dp_replicate", "dp_shard_cp", "tp"), "dp_cp", "dp"]


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")  # torch's own, for torch's slicing
        yield


@pytest.mark.parametrize("rank", range(16))
def test_every_rank_matches_torch(fake_rank, rank):
    fake_rank(rank, 16)
    ref = init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    for dims, name in TORCH_FLATTENS:
        ref[dims]._flatten(name)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    for dims, name in FLATTENS:
        mesh.flatten(dims, name)
    for view in VIEWS:
        assert mesh[view].mesh.tolist() == ref[view].mesh.tolist(), view
        assert mesh[view] is mesh[view]  # cached
    assert mesh.get_strategy_size("dp_cp") == 8 and mesh.get_strategy_size(("dp_replicate", "dp_shard_cp")) == 8
    assert mesh.lookup_rank("dp_shard_cp") == ref["dp_shard_cp"].get_local_rank()
    assert mesh.lookup_rank("dp_cp") == ref["dp_cp"].get_local_rank()
    assert mesh.to_global_rank(3, "dp_cp") == ref["dp_cp"].mesh.tolist()[3]
    assert mesh.get_neighbor_rank("dp_cp") == (ref["dp_cp"].mesh.tolist() + [None])[ref["dp_cp"].get_local_rank() + 1]
    groups = [m.mesh.flatten().tolist() for m in mesh.get_submeshes(("dp_replicate", "dp_shard_cp"))]
    assert sorted(r for g in groups for r in g) == list(range(16)) and [len(g) for g in groups] == [8, 8]
    assert mesh[("dp_replicate", "dp_shard_cp")].mesh.flatten().tolist() in groups
    assert "dp_shard_cp" in mesh.describe()


def test_an_invalid_mix_names_its_dims(fake_rank):
    fake_rank(0, 16)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", SHAPE, mesh_dim_names=NAMES)
    mesh.flatten(("dp_shard", "cp"), "dp_shard_cp")
    with pytest.raises(ValueError, match=r"dims \(dp_shard_cp=\(dp_shard, cp\), dp_replicate\) do not form a sub-mesh"):
        mesh[("dp_shard_cp", "dp_replicate")]
    with pytest.raises(ValueError, match=r"name the same dim twice: dp_shard_cp=\(dp_shard, cp\), cp"):
        mesh[("dp_shard_cp", "cp")]
    with pytest.raises(ValueError, match="do not form a sub-mesh"):
        mesh.flatten(("tp", "dp_shard_cp"), "x")
    with pytest.raises(ValueError, match="'dp shard' is not a plain name"):
        mesh.flatten(("dp_replicate", "dp_shard"), "dp shard")
