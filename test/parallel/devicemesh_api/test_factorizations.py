"""One layout owns every name: a split keeps the old name, and a second factorization (MoE's EDP x EP over
DP x CP) answers every query, equal to Megatron-core's expert groups and to torch's ``_unflatten``
(fake backend, every rank)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from vemesh import VeDeviceMesh

SPLITS = [(2, 2), (4, 1), (1, 4), (2, 1, 2)]  # every way to write DP = 4 as two or three factors, up to order


def _dp_answers(mesh: VeDeviceMesh) -> dict:
    """Everything a user can ask about "DP" on this rank."""
    n, world = mesh.get_strategy_size("DP"), mesh.size()
    return {
        "sizes": (n, mesh.size("DP")),
        "lookup": (mesh.lookup_rank("DP"), mesh.get_data_parallel_rank(), mesh.get_local_rank("DP")),
        "to_local": [mesh.to_local_rank(g, "DP") for g in range(world)],
        "to_global": [mesh.to_global_rank(i, "DP") for i in range(n)],
        "neighbors": [mesh.get_neighbor_rank("DP", o, w) for o in (-1, 1, 2) for w in (False, True)],
        "coordinate": [mesh.get_global_rank({"DP": i}) for i in range(n)],
        "view": mesh["DP"].mesh.tolist(),
        "veScale view": mesh.get_data_parallel_mesh().mesh.tolist(),
        "2-D view": mesh["DP", "TP"].mesh.tolist(),
        "group": dist.get_process_group_ranks(mesh.get_group("DP")),
        "submeshes": [m.mesh.tolist() for m in mesh.get_submeshes("DP")],
        "all groups": mesh.layout.all_groups("DP"),
        "described": [line for line in mesh.describe().splitlines() if line.lstrip().startswith("DP")],
    }


@pytest.mark.parametrize("shape,names", [((4, 2), ("DP", "TP")), ((2, 4, 2), ("PP", "DP", "TP"))])
def test_every_split_of_dp_keeps_every_answer_on_every_rank(fake_rank, shape, names):
    world = math.prod(shape)
    for rank, sizes in itertools.product(range(world), SPLITS):
        fake_rank(rank, world)
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", shape, mesh_dim_names=names)
        before = _dp_answers(mesh)
        parts = tuple(f"dp{i}" for i in range(len(sizes)))
        mesh.split("DP", parts, sizes)
        assert mesh.mesh_dim_names == tuple(n for d in names for n in (parts if d == "DP" else (d,)))
        after = _dp_answers(mesh)
        for key in before:
            if key != "described":
                assert after[key] == before[key], (rank, sizes, key)
        assert set(before["described"]) <= set(after["described"]), (rank, sizes)


def test_a_name_never_falls_back_to_size_one(fake_rank):
    fake_rank(5, 8)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"))
    mesh.split("DP", ("dp_replicate", "dp_shard"), (2, 2))
    assert (mesh.get_strategy_size("DP"), mesh.lookup_rank("DP"), mesh.get_data_parallel_rank()) == (4, 2, 2)
    assert mesh["DP"].mesh.tolist() == [1, 3, 5, 7]
    mesh.split("dp_shard", ("a", "b"), (1, 2))  # a part split again: both old names still answer
    assert (mesh.get_strategy_size("DP"), mesh.get_strategy_size("dp_shard"), mesh.lookup_rank("DP")) == (4, 2, 2)
    assert mesh.get_strategy_size("CP") == 1  # a standard name the mesh never had is still size 1


# --------------------------------------------------------------- Megatron-core's expert groups
def megatron_groups(world: int, sizes: dict[str, int], order: str, token: str) -> list[list[int]]:
    """Megatron-core's RankGenerator rule, written out here as the oracle.

    ``order`` lists dims innermost first (``"tp-ep-dp-pp"``); a rank's index along a dim is
    ``rank // stride % size`` with strides the running product of the sizes before it. The groups
    along the dims in ``token`` vary those dims (first listed fastest) and hold the others fixed;
    groups are counted with the remaining dims, first listed fastest.
    """
    dims = order.split("-")
    strides = [math.prod(sizes[d] for d in dims[:i]) for i in range(len(dims))]
    masked = [i for i, d in enumerate(dims) if d in token.split("-")]
    rest = [i for i in range(len(dims)) if i not in masked]

    def combos(idx):
        return itertools.product(*(range(sizes[dims[i]]) for i in reversed(idx)))  # last listed slowest

    groups = []
    for fixed in combos(rest):
        base = sum(c * strides[i] for c, i in zip(fixed, reversed(rest)))
        groups.append([base + sum(c * strides[i] for c, i in zip(cs, reversed(masked))) for cs in combos(masked)])
    assert sorted(r for g in groups for r in g) == list(range(world))
    return groups


# The same 16-rank case, spelled out as Megatron's docstrings spell groups: DP=4, CP=2, TP=2 dense;
# experts with ETP=TP=2, EP=4, EDP=2, order tp-ep-dp-pp.
MEGATRON_EP = [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]
MEGATRON_EDP = [[0, 8], [1, 9], [2, 10], [3, 11], [4, 12], [5, 13], [6, 14], [7, 15]]
MEGATRON_ETP = [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11], [12, 13], [14, 15]]


def test_the_oracle_reproduces_the_spelled_out_groups():
    sizes = {"tp": 2, "ep": 4, "dp": 2, "pp": 1}
    assert megatron_groups(16, sizes, "tp-ep-dp-pp", "ep") == MEGATRON_EP
    assert megatron_groups(16, sizes, "tp-ep-dp-pp", "dp") == MEGATRON_EDP
    assert megatron_groups(16, sizes, "tp-ep-dp-pp", "tp") == MEGATRON_ETP
    dense = {"tp": 2, "cp": 2, "ep": 1, "dp": 4, "pp": 1}
    assert megatron_groups(16, dense, "tp-cp-ep-dp-pp", "dp-cp") == [[r + k for k in range(0, 16, 2)] for r in (0, 1)]


@pytest.mark.parametrize("rank", range(16))
def test_expert_factorization_equals_megatron_and_torch(fake_rank, rank):
    fake_rank(rank, 16)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (4, 2, 2), mesh_dim_names=("DP", "CP", "TP"))
    mesh.flatten(("DP", "CP"), "dp_cp")
    parts = mesh.split("dp_cp", ("EDP", "EP"), (2, 4))
    assert parts.mesh_dim_names == ("EDP", "EP")
    ref = init_device_mesh("cpu", (4, 2, 2), mesh_dim_names=("DP", "CP", "TP"))
    torch_parts = ref["DP", "CP"]._flatten("dp_cp")._unflatten(0, (2, 4), ("EDP", "EP"))
    for name, expected in (("EP", MEGATRON_EP), ("EDP", MEGATRON_EDP), ("TP", MEGATRON_ETP)):
        mine = next(g for g in expected if rank in g)
        assert mesh[name].mesh.tolist() == mine, name
        assert dist.get_process_group_ranks(mesh.get_group(name)) == mine
        assert mesh.get_strategy_size(name) == len(mine) and mesh.lookup_rank(name) == mine.index(rank)
        assert [mesh.to_global_rank(i, name) for i in range(len(mine))] == mine
        assert [mesh.to_local_rank(g, name) for g in mine] == list(range(len(mine)))
        assert mesh.get_neighbor_rank(name, 1, wrap=True) == mine[(mine.index(rank) + 1) % len(mine)]
        assert [m.mesh.tolist() for m in mesh.get_submeshes(name)] == expected
        if name != "TP":
            assert torch_parts[name].mesh.tolist() == mine
    # views of one factorization; the expert mesh (EDP, EP, TP) holds every rank once
    assert mesh["EP", "TP"].mesh.flatten().tolist() == sorted(next(g for g in MEGATRON_EP if rank in g) + [
        r ^ 1 for r in next(g for g in MEGATRON_EP if rank in g)])
    assert sorted(mesh["EDP", "EP", "TP"].mesh.flatten().tolist()) == list(range(16))
    assert mesh.get_strategy_size(("EDP", "EP")) == 8 == mesh.get_strategy_size("dp_cp")
    # the dense dims answer as before the split
    assert mesh["DP"].mesh.tolist() == ref["DP"].mesh.tolist() and mesh.lookup_rank("CP") == ref["CP"].get_local_rank()
    with pytest.raises(ValueError, match=r"dims \(DP, EP\) mix two factorizations of the ranks: DP is in \(DP, CP, TP\); "
                                         r"EP is in \(EDP, EP, TP\)"):
        mesh["DP", "EP"]
    with pytest.raises(ValueError, match=r"dims \(TP, EP\) do not form a sub-mesh"):
        mesh["TP", "EP"]
    with pytest.raises(ValueError, match="mix two factorizations"):
        mesh.flatten(("CP", "EP"))


def test_a_split_that_is_no_stride_pattern_is_refused(fake_rank):
    fake_rank(0, 12)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (3, 2, 2), mesh_dim_names=("DP", "TP", "CP"))
    mesh.flatten(("DP", "CP"), "dp_cp")
    with pytest.raises(ValueError, match=r"cannot split dp_cp=\(DP, CP\) into sizes \(2, 3\)"):
        mesh.split("dp_cp", ("EDP", "EP"), (2, 3))
    with pytest.raises(ValueError, match="its dims are not adjacent in any factorization"):
        mesh.split("dp_cp", ("EDP", "EP"), (3, 2))


def test_get_local_rank_with_a_dim_is_torchs(fake_rank):
    for rank in range(8):
        fake_rank(rank, 8)
        ref = init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("PP", "DP", "TP"))
        for d in ("PP", "DP", "TP", 0, 2):
            assert mesh.get_local_rank(d) == ref.get_local_rank(d)
        with pytest.raises(KeyError, match="unknown dim name 'CP'"):
            mesh.get_local_rank("CP")
