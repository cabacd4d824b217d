"""Every bad input gets its exception type and a message naming the value and the valid choices."""

from __future__ import annotations

import pytest

from vemesh import VeDeviceMesh
from vemesh.layout.spec import MeshSpec


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(mesh_shape=(2, 0)), r"mesh_shape: every size must be a positive integer, or one -1 to fill in; got 0 in \(2, 0\)"),
        (dict(mesh_shape=(2, -2)), r"got -2 in \(2, -2\)"),
        (dict(mesh_shape=(-1, -1)), r"mesh_shape: only one size can be -1 \(filled in\); got 2 in \(-1, -1\)"),
        (dict(mesh_shape=()), r"at least one dim; got \(\)"),
        (dict(mesh_shape="2,2"), r"mesh_shape must be a tuple of ints .* got '2,2'"),
        (dict(mesh_shape=(2, 2), mesh_dim_names=("DP",)), r"\('DP',\) has 1 names but mesh_shape \(2, 2\) has 2 dims"),
        (dict(mesh_shape=(2, 2), mesh_dim_names=("TP", "TP")), r"must be unique; \['TP'\] repeat"),
        (dict(mesh_shape=(2, 2), mesh_dim_names=("DP", "")), r"dim name '' is not a plain name"),
        (dict(mesh_shape=(2, 2), mesh_dim_names=(" DP", "TP")), r"dim name ' DP' is not a plain name .* no spaces"),
        (dict(mesh_shape=(2, 2), mesh_dim_names={"DP", "TP"}), r"ordered sequence \(a tuple or list\); got a set"),
        (dict(mesh_shape=(1, 2, 2, 2)), r"4-D mesh_shape \(1, 2, 2, 2\) needs mesh_dim_names; defaults exist only for 1-D"),
        (dict(device_type="gpu"), r"unknown device type 'gpu'; valid device types are \['cpu', 'cuda'"),
        (dict(device_type=3), r"device_type must be a string"),
    ],
)
def test_spec_rejects(kwargs, match):
    args = dict(device_type="cpu", mesh_shape=(2, 2)) | kwargs
    with pytest.raises(ValueError, match=match):
        MeshSpec(**args)


@pytest.mark.parametrize(
    "shape, match",
    [
        ((2, 2), r"mesh_shape: DP 2 x TP 2 = 4 but the world size is 8; the product must equal it"),
        ((4, 4), r"DP 4 x TP 4 = 16 but the world size is 8"),
        ((3, -1), r"mesh_shape: cannot fill in TP: DP 3 = 3 does not divide the world size 8 \(the product of the others must be one of its divisors: 1, 2, 4, 8\)"),
    ],
)
def test_shape_must_cover_the_world(fake_rank, shape, match):
    fake_rank(0, 8)
    mesh = VeDeviceMesh()
    with pytest.raises(ValueError, match=match):
        mesh.init_device_mesh("cpu", shape)
    assert not mesh.is_initialized()


def test_device_index_is_normalized_with_a_warning(fake_rank):
    fake_rank(1, 2)
    mesh = VeDeviceMesh()
    with pytest.warns(UserWarning, match=r"device_type 'cpu:0' names one device.*using 'cpu'") as record:
        mesh.init_device_mesh("cpu:0", (2,))
    assert record[0].filename == __file__  # points at the caller, not at vemesh
    assert mesh.device_type == "cpu"


def test_use_before_init_says_which_call_to_make():
    mesh = VeDeviceMesh()
    calls = [
        lambda: mesh["TP"],
        lambda: mesh.shape,
        lambda: mesh.get_strategy_size("TP"),
        lambda: mesh.lookup_rank("DP"),
        lambda: mesh.get_coordinate(),
        lambda: mesh.get_global_rank([0, 0]),
        lambda: mesh.get_group("DP"),
        lambda: mesh.describe(),
        lambda: mesh.get_local_rank(),
    ]
    for call in calls:
        with pytest.raises(RuntimeError, match=r"not initialized; call VESCALE_DEVICE_MESH.init_device_mesh\("):
            call()
    assert repr(mesh) == "VeDeviceMesh(uninitialized)"


@pytest.fixture
def mesh_2x2x2(fake_mesh):
    return fake_mesh(5, (2, 2, 2))


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m["Tp"], r"unknown dim name 'Tp'; valid dim names are \['PP', 'DP', 'TP'\]; did you mean 'TP'\?"),
        (lambda m: m.size("dp"), r"unknown dim name 'dp'.*did you mean 'DP'"),
        (lambda m: m["CP"], r"unknown dim name 'CP'"),
        (lambda m: m.get_group("CP"), r"unknown dim name 'CP'"),
        # only those the mesh lacks: PP, DP and TP are its dims (before, all five were called absent)
        (lambda m: m.get_strategy_size("pipe"), r"unknown dim name 'pipe'.*absent standard strategies \['CP', 'EP'\]"),
        (lambda m: m.lookup_rank("tp"), r"did you mean 'TP'"),
        (lambda m: m.get_global_rank({"tp": 0}), r"unknown dim name 'tp'.*did you mean 'TP'"),
    ],
)
def test_unknown_dim_is_a_key_error_with_closest_match(mesh_2x2x2, call, match):
    with pytest.raises(KeyError, match=match):
        call(mesh_2x2x2)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda m: m.get_strategy_coordinate(8), r"global rank 8 is out of range; valid: 0..7"),
        (lambda m: m.get_strategy_coordinate(-1), r"global rank -1 is out of range; valid: 0..7"),
        (lambda m: m.to_local_rank(99, "TP"), r"global rank 99 is out of range; valid: 0..7"),
        (lambda m: m.get_global_rank([0, 0]), r"coordinate \(0, 0\) has 2 entries; .* needs 3"),
        (lambda m: m.get_global_rank([0, 2, 0]), r"DP=2 is out of range; valid: 0..1"),
        (lambda m: m.get_global_rank({"PP": 5}), r"PP=5 is out of range; valid: 0..1"),
        (lambda m: m.to_global_rank(2, "TP"), r"local rank 2 is out of range along TP \(size 2\); valid: 0..1"),
        (lambda m: m.to_global_rank(1, "CP"), r"local rank 1 is out of range along \(none\) \(size 1\); valid: 0..0"),
        (lambda m: m.size(3), r"dim index 3 is out of range for a 3-D mesh; valid: 0..2, or -3..-1 counted from the innermost"),
        (lambda m: m["TP", "DP"], r"dims \(TP, DP\) do not form a sub-mesh in mesh order \('PP', 'DP', 'TP'\): a view, like torch's DeviceMesh"),
        (lambda m: m["TP", "TP"], r"name the same dim twice"),
        (lambda m: m.flatten(("TP", "PP")), r"dims \(TP, PP\) do not form a sub-mesh"),
        (lambda m: m.flatten(("DP", "TP"), "PP"), r"flattened name 'PP' is already a dim"),
        (lambda m: m.get_group(), r"get_group\(\) needs a dim on a 3-D mesh; choose one of \('PP', 'DP', 'TP'\)"),
        (lambda m: m.get_group(("DP", "TP")), r"a process group runs along one dim"),
        (lambda m: m.get_neighbor_submesh("TP", along="TP"), r"along='TP' must be a dim outside view_dim='TP'"),
    ],
)
def test_bad_values_are_value_errors(mesh_2x2x2, call, match):
    with pytest.raises(ValueError, match=match):
        call(mesh_2x2x2)


def test_flatten_name_clash(mesh_2x2x2):
    mesh_2x2x2.flatten(("DP", "TP"), "inner")
    with pytest.raises(ValueError, match=r"'inner' already names the flattened dims \('DP', 'TP'\), not \('PP', 'DP'\)"):
        mesh_2x2x2.flatten(("PP", "DP"), "inner")
    # a flattened dim mixes with the others when the dims stay in mesh order (issue 13)
    assert tuple(mesh_2x2x2["PP", "inner"].mesh.shape) == (2, 4)
    with pytest.raises(ValueError, match=r"dims \(inner=\(DP, TP\), PP\) do not form a sub-mesh"):
        mesh_2x2x2["inner", "PP"]


def test_bad_dim_types_are_type_errors(mesh_2x2x2):
    with pytest.raises(TypeError, match=r"a dim is a name \(str\), an index \(int\) or a sequence of them; got 1.5"):
        mesh_2x2x2.get_strategy_size(1.5)


def test_pipeline_meshes_need_other_dims(fake_mesh):
    mesh = fake_mesh(0, (4,), ("PP",))
    with pytest.raises(ValueError, match=r"only the PP dim.*use get_submeshes\('PP'\)"):
        mesh.get_global_pipeline_parallel_meshes()
