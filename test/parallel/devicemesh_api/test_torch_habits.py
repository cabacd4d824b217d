"""Layer 2: what a torch user writes on ``VESCALE_DEVICE_MESH`` out of habit, against torch's own mesh, every rank.

torch's ``DeviceMesh`` takes its dim as ``mesh_dim=`` (torch's own code passes it by keyword), lists its groups with
``get_all_groups()`` and is a context manager for DTensor; the manager answers each as its global torch mesh does.
Where torch's functions read the torch mesh's own attributes, the manager is not a stand-in and says what to pass;
torch's ``_flatten`` on a view names torch's mesh only, and the manager's error says how vemesh makes the name.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import _mesh_resources
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

MESHES = [((8,), ("DP",)), ((2, 4), ("DP", "TP")), ((2, 2, 2), ("PP", "DP", "TP")), ((3, 2, 2), ("PP", "DP", "TP"))]


def ranks(group: dist.ProcessGroup) -> list[int]:
    return dist.get_process_group_ranks(group)


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], int) else "")
def test_torchs_keyword_and_group_list_answer_as_torchs_mesh_on_every_rank(fake_mesh, shape, names) -> None:
    """By name, by index and by negative index (``get_local_rank(-1)``: the innermost dim, as torch takes it)."""
    world = 1
    for n in shape:
        world *= n
    for rank in range(world):
        mesh = fake_mesh(rank, shape, names)
        torch_mesh = mesh.mesh
        for dim in [*names, *range(-len(names), len(names))]:  # torch counts a negative index from the innermost
            assert mesh.size(mesh_dim=dim if isinstance(dim, int) else names.index(dim)) == \
                torch_mesh.size(mesh_dim=names.index(dim) if isinstance(dim, str) else dim)
            assert mesh.get_local_rank(mesh_dim=dim) == torch_mesh.get_local_rank(mesh_dim=dim)
            assert ranks(mesh.get_group(mesh_dim=dim)) == ranks(torch_mesh.get_group(mesh_dim=dim))
        assert [ranks(g) for g in mesh.get_all_groups()] == [ranks(g) for g in torch_mesh.get_all_groups()]


@pytest.mark.parametrize("shape,names", MESHES, ids=lambda v: "x".join(map(str, v)) if isinstance(v[0], int) else "")
def test_get_local_rank_without_a_dim_answers_or_refuses_as_torchs_mesh_on_every_rank(fake_mesh, shape, names) -> None:
    """The index along a 1-D mesh's only dim; on more dims, torch's refusal, and the manager's names the dims and
    where a rank's index on its host is (veScale answered that, which on a 1-D mesh over hosts is another number)."""
    world = 1
    for n in shape:
        world *= n
    for rank in range(world):
        mesh = fake_mesh(rank, shape, names)
        if len(shape) == 1:
            assert mesh.get_local_rank() == mesh.mesh.get_local_rank() == rank
            continue
        with pytest.raises(RuntimeError, match="mesh_dim"):
            mesh.mesh.get_local_rank()
        with pytest.raises(RuntimeError, match=rf"get_local_rank\(\) needs a dim on a mesh of {len(names)} dims "
                                               rf"\({', '.join(map(repr, names))}\).*get_local_rank\('TP'\) is this "
                                               r"rank's index along TP.*int\(os.environ\[\"LOCAL_RANK\"\]\)"):
            mesh.get_local_rank()


def test_the_dim_given_twice_is_a_type_error_naming_both(fake_mesh) -> None:
    mesh = fake_mesh(5, (2, 2, 2), ("PP", "DP", "TP"))
    for call in (mesh.size, mesh.get_local_rank, mesh.get_group):
        with pytest.raises(TypeError, match=r"got the dim twice: 'TP' and mesh_dim='DP' \(mesh_dim is torch's name"):
            call("TP", mesh_dim="DP")


def test_with_the_manager_makes_its_torch_mesh_current_for_dtensor(fake_mesh) -> None:
    mesh = fake_mesh(5, (2, 4), ("DP", "TP"))
    before = list(_mesh_resources.mesh_stack)
    with mesh as entered:
        assert entered is mesh and _mesh_resources.get_current_mesh() is mesh.mesh
        with mesh["TP"]:  # torch's own nesting
            assert _mesh_resources.get_current_mesh() is mesh["TP"]
        t = distribute_tensor(torch.arange(8.0).view(2, 4), placements=[Replicate(), Shard(1)])
        assert t.device_mesh is mesh.mesh and t.to_local().shape == (2, 1)  # a TP rank's column of 4 (fake: no data)
        first = mesh.mesh
        mesh.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"))  # a new mesh inside: the entered one exits
    assert mesh.mesh is not first and _mesh_resources.mesh_stack == before


def test_torchs_functions_given_the_manager_are_told_to_pass_its_torch_mesh(fake_mesh) -> None:
    """torch's DTensor reads its mesh's own attributes: given the manager, the first it lacks says what to pass. A
    name that torch's mesh does not have either stays Python's plain AttributeError."""
    mesh = fake_mesh(1, (2, 2), ("DP", "TP"))
    with pytest.raises(AttributeError, match=r"VESCALE_DEVICE_MESH has no '_is_current_rank_part_of_mesh', which "
                                             r"torch's DeviceMesh has.*VESCALE_DEVICE_MESH.mesh, the global torch mesh"):
        DTensor.from_local(torch.ones(2), mesh, [Replicate(), Replicate()]).full_tensor()
    assert not hasattr(mesh, "_flatten_rank_map") and getattr(mesh, "_vemesh_epoch", None) is None
    with pytest.raises(AttributeError, match=r"^'VeDeviceMesh' object has no attribute 'no_such_thing'$"):
        mesh.no_such_thing  # noqa: B018
    t = DTensor.from_local(torch.ones(2), mesh.mesh, [Replicate(), Replicate()])  # what the message says to do
    assert t.full_tensor().tolist() == [1.0, 1.0]


def test_a_name_torchs_flatten_made_on_a_view_gets_the_flatten_that_makes_it_for_vemesh(fake_mesh) -> None:
    """torchtitan's habit, ``mesh["DP", "CP"]._flatten("DP_CP")``, names torch's mesh (torch deprecates finding it
    from the root mesh, and keeps it for whoever holds what ``_flatten`` returned); vemesh's queries do not know the
    name, and say which call makes it. That call gives the group torch's made."""
    mesh = fake_mesh(5, (2, 2, 2), ("PP", "DP", "CP"))
    made = mesh["DP", "CP"]._flatten("DP_CP")
    for ask in (lambda: mesh["DP_CP"], lambda: mesh.size("DP_CP"), lambda: mesh.get_group("DP_CP")):
        with pytest.raises(KeyError, match=r"'DP_CP' joins DP and CP: make it with "
                                           r"VESCALE_DEVICE_MESH.flatten\(\('DP', 'CP'\), 'DP_CP'\)"):
            ask()
    assert ranks(mesh.flatten(("DP", "CP"), "DP_CP").get_group()) == ranks(made.get_group()) == [4, 5, 6, 7]
    assert mesh.size("DP_CP") == 4 and mesh.get_local_rank("DP_CP") == 1
    with pytest.raises(KeyError, match=r"unknown dim name 'DP_XP'; valid dim names are .*; did you mean"):
        mesh["DP_XP"]  # not a join of the mesh's names: the usual error


class _Accelerator:
    """What :func:`vemesh.mesh.startup.bound_device` reads of ``torch.cuda``, on a machine of ``count`` devices."""

    def __init__(self, count: int, current: int | None = None) -> None:
        self.count, self.current, self.selected = count, current, None

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def is_initialized(self) -> bool:
        return self.current is not None

    def current_device(self) -> int:
        return self.current

    def set_device(self, index: int) -> None:
        self.selected = index


@pytest.mark.parametrize("count, current, local_rank, rank, want", [
    (8, None, "3", 11, 3),     # torchrun: LOCAL_RANK
    (1, None, "3", 11, 0),     # CUDA_VISIBLE_DEVICES gave the process one device
    (4, None, None, 6, 2),     # another launcher: the rank modulo the host's devices, as torch's DeviceMesh guesses
    (8, 5, "3", 11, 5),        # the user selected a device before the mesh: kept
    (0, None, "3", 11, None),  # no device
])
def test_a_cuda_rank_binds_the_device_torchs_mesh_would_select(monkeypatch, count, current, local_rank, rank,
                                                               want) -> None:
    """torch's ``init_process_group(device_id=...)`` forms NCCL's communicator at start-up and splits each mesh dim's
    group from it; vemesh passes the device torch's ``DeviceMesh`` would select, and selects it (no GPU here: the
    choice and its wiring into ``init_process_group`` are checked, not NCCL)."""
    from vemesh.mesh import startup

    accelerator = _Accelerator(count, current)
    monkeypatch.setattr(torch, "cuda", accelerator)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    if local_rank is not None:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    got = startup.bound_device("cuda", rank)
    assert got == (None if want is None else torch.device("cuda", want))
    assert accelerator.selected == (want if current is None else None)
    assert startup.bound_device("cpu", rank) is None

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(kw, backend=backend))
    for key in ("RANK", "WORLD_SIZE"):
        monkeypatch.delenv(key, raising=False)
    assert startup.ensure_process_group("cuda", startup.DEFAULT_TIMEOUT)
    assert seen["backend"] == "cpu:gloo,cuda:nccl" and seen["world_size"] == 1
    assert seen["device_id"] == (None if want is None else torch.device("cuda", want if current is not None or
                                                                          local_rank is not None else 0))
    startup.ensure_process_group("cpu", startup.DEFAULT_TIMEOUT)
    assert seen["backend"] == "gloo" and seen["device_id"] is None
