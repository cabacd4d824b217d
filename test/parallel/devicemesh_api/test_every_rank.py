"""Layer 2: every rank's view of a mesh, one fake rank at a time, against numpy arithmetic.

Nothing here asks "if rank == 6": each check computes the expected value for
the rank under test from the rank grid ``np.arange(world).reshape(shape)``.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
import torch.distributed as dist

from vemesh.layout.spec import DEFAULT_DIM_NAMES, STANDARD_STRATEGIES

MESHES = [
    ((8,), None),
    ((2, 4), None),
    ((2, 2, 2), None),
    ((4, 1, 2), None),
    ((3, 2, 2), None),
    ((2, 2, 2, 2), ("PP", "DP", "CP", "TP")),
    ((2, 3, 2), ("DP", "EP", "TP")),
]


class Expected:
    """Reference answers for one rank, from the numpy grid."""

    def __init__(self, shape: tuple[int, ...], names: tuple[str, ...], rank: int):
        self.shape, self.names, self.rank = shape, names, rank
        self.world = math.prod(shape)
        self.grid = np.arange(self.world).reshape(shape)
        self.coord = tuple(int(x) for x in np.argwhere(self.grid == rank)[0])

    def groups(self, dims: tuple[int, ...]) -> list[list[int]]:
        k = len(dims)
        moved = np.moveaxis(self.grid, dims, tuple(range(len(self.shape) - k, len(self.shape))))
        return moved.reshape(-1, math.prod(self.shape[d] for d in dims)).tolist()

    def group(self, dims: tuple[int, ...], rank: int | None = None) -> list[int]:
        rank = self.rank if rank is None else rank
        return next(g for g in self.groups(dims) if rank in g)

    def coordinate_of(self, rank: int) -> list[int]:
        return [int(x) for x in np.argwhere(self.grid == rank)[0]]


def check_rank_view(mesh, exp: Expected, all_pairs: bool = True) -> None:
    """Every query of ``mesh`` from ``exp.rank``'s point of view."""
    assert mesh.shape == exp.shape and mesh.mesh_dim_names == exp.names and mesh.ndim == len(exp.shape)
    assert mesh.size() == exp.world
    assert mesh.get_coordinate() == exp.coord
    assert mesh.get_strategy_coordinate() == list(exp.coord)
    assert mesh.get_global_rank(exp.coord) == exp.rank
    assert mesh.mesh.get_coordinate() == exp.coord  # agrees with torch itself
    others = range(exp.world) if all_pairs else random.Random(exp.rank).sample(range(exp.world), 16)
    for other in others:
        c = exp.coordinate_of(other)
        assert mesh.get_strategy_coordinate(other) == c
        assert mesh.get_global_rank(c) == other

    for d, name in enumerate(exp.names):
        group = exp.group((d,))
        assert mesh.size(name) == mesh.size(d) == mesh.get_strategy_size(name) == exp.shape[d]
        assert mesh.lookup_rank(name) == exp.coord[d] == group.index(exp.rank)
        view = mesh[name]
        assert view is mesh[name] and view is mesh[(name,)]
        assert view.mesh.tolist() == group
        assert dist.get_process_group_ranks(mesh.get_group(name)) == group
        for i, g in enumerate(group):
            assert mesh.to_global_rank(i, name) == g
        for other in others:
            assert mesh.to_local_rank(other, name) == exp.group((d,), other).index(other)
        for offset in (-2, -1, 1, 2):
            pos = exp.coord[d] + offset
            expected = group[pos] if 0 <= pos < len(group) else None
            assert mesh.get_neighbor_rank(name, offset) == expected
            assert mesh.get_neighbor_rank(name, offset, wrap=True) == group[pos % len(group)]
        # the world partitioned into this dim's submeshes (torch builds each in ~1 ms,
        # so the 16384-rank case checks single neighbor submeshes below instead)
        if all_pairs:
            subs = mesh.get_submeshes(name)
            assert [s.mesh.tolist() for s in subs] == exp.groups((d,))
            assert sum(s is view for s in subs) == 1
        # the mapping form of get_global_rank changes only the named dim
        for i in range(exp.shape[d]):
            target = list(exp.coord)
            target[d] = i
            assert mesh.get_global_rank({name: i}) == exp.grid[tuple(target)]
        # neighbor submeshes along every other dim
        for a, along in enumerate(exp.names):
            if a == d:
                continue
            for offset in (-1, 1):
                pos = exp.coord[a] + offset
                got = mesh.get_neighbor_submesh(name, along=along, offset=offset)
                if not 0 <= pos < exp.shape[a]:
                    assert got is None
                    pos %= exp.shape[a]
                    got = mesh.get_neighbor_submesh(name, along=along, offset=offset, wrap=True)
                target = list(exp.coord)
                target[a] = pos
                assert got.mesh.tolist() == exp.group((d,), int(exp.grid[tuple(target)]))

    # multi-dim views of adjacent pairs, and their flattened groups
    for d in range(len(exp.shape) - 1):
        pair = (exp.names[d], exp.names[d + 1])
        block = np.array(exp.group((d, d + 1))).reshape(exp.shape[d], exp.shape[d + 1]).tolist()
        assert mesh[pair].mesh.tolist() == block
        assert mesh[pair] is mesh[pair]
        flat = mesh.flatten(pair)
        name = "_".join(pair)
        assert flat is mesh[name] and flat is mesh.flatten(pair)
        assert flat.mesh.tolist() == exp.group((d, d + 1))
        assert dist.get_process_group_ranks(mesh.get_group(name)) == exp.group((d, d + 1))
        assert mesh.get_strategy_size(name) == exp.shape[d] * exp.shape[d + 1]
        assert mesh.lookup_rank(name) == exp.group((d, d + 1)).index(exp.rank)

    # standard strategies the mesh lacks behave as size 1
    for name in STANDARD_STRATEGIES:
        if name in exp.names:
            continue
        assert mesh.get_strategy_size(name) == 1
        assert mesh.lookup_rank(name) == 0
        assert mesh.to_global_rank(0, name) == exp.rank
        assert mesh.to_local_rank(exp.rank, name) == 0
        assert mesh.get_neighbor_rank(name) is None
        assert mesh.get_neighbor_rank(name, wrap=True) == exp.rank
        assert mesh.get_optional_mesh(name) is None


def check_vescale_helpers(mesh, exp: Expected) -> None:
    names = exp.names

    def rank_on(name):
        return exp.coord[names.index(name)] if name in names else 0

    assert mesh.get_tensor_parallel_rank() == rank_on("TP")
    assert mesh.get_data_parallel_rank() == rank_on("DP")
    assert mesh.get_pipeline_parallel_rank() == rank_on("PP")
    for name, getter, groups in (
        ("TP", mesh.get_tensor_parallel_mesh, mesh.get_tensor_parallel_dim_groups),
        ("DP", mesh.get_data_parallel_mesh, mesh.get_data_parallel_dim_groups),
        ("PP", mesh.get_pipeline_parallel_mesh, None),
    ):
        if name in names:
            d = names.index(name)
            assert getter().mesh.tolist() == exp.group((d,))
            if groups is not None:
                assert dist.get_process_group_ranks(groups()) == exp.group((d,))
        else:
            with pytest.raises(KeyError, match=f"unknown dim name '{name}'"):
                getter()
    if "TP" in names:
        d = names.index("TP")
        assert [m.mesh.tolist() for m in mesh.get_global_tensor_parallel_meshes()] == exp.groups((d,))
    stages = mesh.get_global_pipeline_parallel_meshes()
    if "PP" in names:
        pp = names.index("PP")
        others = tuple(i for i in range(len(names)) if i != pp)
        assert len(stages) == exp.shape[pp]
        for s, stage in enumerate(stages):
            idx = [slice(None)] * len(names)
            idx[pp] = s
            assert stage.mesh.tolist() == exp.grid[tuple(idx)].tolist()
            assert stage.mesh_dim_names == tuple(names[i] for i in others)
        assert mesh.is_first_stage() == (exp.coord[pp] == 0)
        assert mesh.is_last_stage() == (exp.coord[pp] == exp.shape[pp] - 1)
    else:
        assert stages == [mesh.mesh]
        assert mesh.is_first_stage() and mesh.is_last_stage()


@pytest.mark.parametrize("shape, names", MESHES, ids=[str(s) for s, _ in MESHES])
def test_every_rank(fake_mesh, shape, names):
    names = names or DEFAULT_DIM_NAMES[len(shape)]
    for rank in range(math.prod(shape)):
        mesh = fake_mesh(rank, shape, names)
        exp = Expected(shape, names, rank)
        check_rank_view(mesh, exp)
        check_vescale_helpers(mesh, exp)


@pytest.mark.parametrize(
    "shape, names",
    [((16, 64, 16), ("PP", "DP", "TP")), ((4, 16, 32, 8), ("PP", "DP", "CP", "TP"))],
    ids=["16x64x16", "4x16x32x8"],
)
def test_sampled_ranks_of_16384(fake_mesh, shape, names):
    world = math.prod(shape)
    assert world == 16384
    samples = [0, 1, world - 1, world // 2 + 3] + random.Random(0).sample(range(world), 4)
    for rank in samples:
        mesh = fake_mesh(rank, shape, names)
        exp = Expected(shape, names, rank)
        check_rank_view(mesh, exp, all_pairs=False)


def test_minus_one_is_inferred_on_every_rank(fake_mesh):
    for rank in range(8):
        mesh = fake_mesh(rank, (2, -1, 2), world_size=8)
        assert mesh.shape == (2, 2, 2)
        assert mesh.mesh_dim_names == ("PP", "DP", "TP")


def test_reinit_replaces_mesh_and_drops_views(fake_rank):
    from vemesh import VeDeviceMesh

    fake_rank(5, 8)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (2, 4))
    tp, flat = mesh["TP"], mesh.flatten(("DP", "TP"), "world")
    assert tp.mesh.tolist() == [4, 5, 6, 7] and mesh.get_strategy_size("world") == 8
    mesh.init_device_mesh("cpu", (4, 2))
    assert mesh["TP"] is not tp and mesh["TP"].mesh.tolist() == [4, 5]
    with pytest.raises(KeyError, match="unknown dim name 'world'"):
        mesh["world"]
    with pytest.raises(RuntimeError, match=r"already initialized .* call reset\(\) first"):
        mesh.init_device_mesh("cpu", (8,), check_uniqueness=True)
    assert mesh.shape == (4, 2)  # the failed init changed nothing
    mesh.reset()
    assert not mesh.is_initialized()
    mesh.init_device_mesh("cpu", (8,), check_uniqueness=True)
    assert mesh.mesh_dim_names == ("DP",) and flat.mesh.tolist() == list(range(8))


def test_get_initializes_once(fake_rank):
    from vemesh import VeDeviceMesh

    fake_rank(3, 4)
    mesh = VeDeviceMesh()
    with pytest.raises(RuntimeError, match=r"call VESCALE_DEVICE_MESH.init_device_mesh"):
        mesh.get()
    first = mesh.get(device_type="cpu", mesh_shape=(2, 2))
    assert mesh.get() is first and mesh.get(device_type="cpu", mesh_shape=(4,)) is first
    assert repr(mesh) == "VeDeviceMesh((DP=2, TP=2), device_type='cpu', rank=3, coordinate=(1, 1))"


def test_describe_lists_groups_and_rank_view(fake_mesh):
    mesh = fake_mesh(5, (2, 2, 2))
    text = mesh.describe()
    assert "mesh (PP=2, DP=2, TP=2): 8 ranks" in text
    assert "[4, 5]" in text and "rank 5" in text and "PP=1, DP=0, TP=1" in text


def test_rank_zero_logs_the_layout_when_asked(fake_rank, caplog, monkeypatch):
    from vemesh import VeDeviceMesh

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    for rank in (0, 5):
        fake_rank(rank, 16)
        mesh = VeDeviceMesh()
        caplog.clear()
        with caplog.at_level("INFO", logger="vemesh"):
            mesh.init_device_mesh("cpu", (2, 8), log_layout=True)
            mesh.init_device_mesh("cpu", (2, 8))  # not asked: silent
        logged = [r for r in caplog.records if r.name == "vemesh"]
        if rank == 0:
            assert "mesh (DP=2, TP=8): 16 ranks" in logged[0].getMessage()
            assert any(r.levelname == "WARNING" and "TP groups cross hosts" in r.getMessage() for r in logged)
            assert len(logged) == 2
        else:
            assert logged == []
