"""``split``: dividing a dim after init gives, on every rank, the groups of the finer mesh built
directly (fake backend); flattened dims over the split dim keep their ranks; bad splits and
backend overrides name what is wrong."""

from __future__ import annotations

import itertools
import warnings

import pytest

from vemesh import VeDeviceMesh

warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")


@pytest.mark.parametrize("rank", range(8))
def test_split_equals_the_finer_mesh(fake_rank, rank):
    fake_rank(rank, 8)
    direct = VeDeviceMesh()
    direct.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "TP"))
    expected = {d: direct[d].mesh.tolist() for d in ("dp_replicate", "dp_shard", "TP")}
    expected_coordinate = direct.get_strategy_coordinate()
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"))
    flat = mesh.flatten(("DP", "TP"), "world").mesh.tolist()
    mesh.split("DP", ("dp_replicate", "dp_shard"), (2, 2))
    assert mesh.mesh_dim_names == ("dp_replicate", "dp_shard", "TP") and mesh.shape == (2, 2, 2)
    assert {d: mesh[d].mesh.tolist() for d in expected} == expected
    assert mesh.get_strategy_coordinate() == expected_coordinate
    assert mesh["world"].mesh.tolist() == flat and mesh.get_strategy_size("world") == 8  # kept
    for r, dims in itertools.product(range(8), ["dp_shard", ("dp_replicate", "TP")]):
        assert mesh.to_local_rank(r, dims) == direct.to_local_rank(r, dims)
    assert [m.mesh.tolist() for m in mesh.get_submeshes("dp_shard")] == [m.mesh.tolist() for m in direct.get_submeshes("dp_shard")]


def test_bad_splits_and_overrides(fake_rank):
    fake_rank(0, 8)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"))
    with pytest.raises(ValueError, match=r"split sizes \(2, 3\) multiply to 6, but dim 'DP' has size 4"):
        mesh.split("DP", ("a", "b"), (2, 3))
    with pytest.raises(KeyError, match=r"unknown dim name 'XP'; valid dim names are \['DP', 'TP'\]"):
        mesh.split("XP", ("a", "b"), (2, 2))
    with pytest.raises(ValueError, match=r"split names \['TP'\] are already dims"):
        mesh.split("DP", ("TP", "b"), (2, 2))
    with pytest.raises(TypeError, match="a split size must be an integer"):
        mesh.split("DP", ("a", "b"), (2.0, 2))
    with pytest.raises(ValueError, match="two or more names"):
        mesh.split("DP", ("a",), (4,))
    other = VeDeviceMesh()
    with pytest.raises(KeyError, match=r"unknown dim name 'pp'; valid dim names are \['DP', 'TP'\]"):
        other.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"), backend_override={"pp": "gloo"})
    with pytest.raises(TypeError, match=r"backend_override\['TP'\] must be a backend name"):
        other.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"), backend_override={"TP": 3})
