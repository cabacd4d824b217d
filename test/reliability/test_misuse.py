"""Plausible mistakes a torch user makes with the mesh, the wrappers, the checkpoints and the replicas.

None of them may train or answer wrong without a word: each raises a one-line error naming the value
and the fix, or gives the one-process result. ``docs/troubleshooting.md`` lists every case with the
test that holds it (``test_the_list_in_the_docs_is_the_tests`` keeps the two in step).

Mesh and wrapper cases that need no collective run on torch's fake backend, as every rank; the
others in one 4-rank gloo world (``misuse_scenarios.worker``).
"""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from launch import run_ranks
from vemesh import VeDeviceMesh, VESCALE_DEVICE_MESH, checkpoint
from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.optim import DistributedOptimizer, clip_grad_norm_

import misuse_scenarios  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def as_rank():
    """``as_rank(rank, world)``: this process is that rank of a fake world, with a fresh global mesh."""

    def become(rank: int, world: int) -> None:
        VESCALE_DEVICE_MESH.reset()
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield become
    VESCALE_DEVICE_MESH.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


def one_line(error: BaseException) -> str:
    text = error.args[0] if isinstance(error, KeyError) else str(error)
    assert "\n" not in text and "input_value" not in text, text
    return text


# ------------------------------------------------------------------ names (fake backend, every rank)
def test_lower_case_names_raise_for_the_upper_case_strategy_on_every_rank(as_rank) -> None:
    for rank in range(4):
        as_rank(rank, 4)
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for query in (lambda: mesh.get_strategy_size("DP"), lambda: mesh.lookup_rank("DP"),
                      lambda: mesh.to_local_rank(rank, "DP"), lambda: mesh.get_neighbor_rank("DP")):
            with pytest.raises(KeyError) as e:
                query()
            assert "'DP' is not a dim of this mesh, but 'dp' is (the names differ only in case)" in one_line(e.value)
        assert (mesh.get_strategy_size("dp"), mesh.lookup_rank("dp")) == (2, rank // 2)  # its own spelling answers


def test_a_tp_check_on_lower_case_names_cannot_skip_tp(as_rank) -> None:
    for rank in range(4):
        as_rank(rank, 4)
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        for query in (lambda: mesh.get_strategy_size("TP") > 1, lambda: mesh.get_optional_mesh("TP")):
            with pytest.raises(KeyError, match="'TP' is not a dim of this mesh, but 'tp' is"):
                query()


def test_vescale_names_answer_for_either_spelling(as_rank) -> None:
    """The method names carry no spelling: on ("dp", "tp") and ("DP", "TP") they answer the same, on every rank."""
    for rank in range(4):
        answers = []
        for names in (("dp", "tp"), ("DP", "TP")):
            as_rank(rank, 4)
            mesh = VeDeviceMesh()
            mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
            answers.append((mesh.get_data_parallel_rank(), mesh.get_tensor_parallel_rank(),
                            mesh.get_pipeline_parallel_rank(), mesh.get_tensor_parallel_mesh().mesh.tolist(),
                            mesh.get_data_parallel_mesh().mesh.tolist(), mesh.is_first_stage(), mesh.is_last_stage()))
        expected = (rank // 2, rank % 2, 0, [rank - rank % 2, rank - rank % 2 + 1], [rank % 2, rank % 2 + 2], True, True)
        assert answers[0] == answers[1] == expected


def test_dp_split_into_parts_raises_until_it_is_flattened(as_rank) -> None:
    for rank in range(16):
        as_rank(rank, 16)
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", (2, 2, 2, 2), mesh_dim_names=("dp_replicate", "dp_shard", "cp", "tp"))
        for query in (lambda: mesh.lookup_rank("DP"), mesh.get_data_parallel_rank):
            with pytest.raises(KeyError) as e:
                query()
            assert ("'dp_replicate', 'dp_shard' are DP under another name: ask for the one you mean, or flatten them "
                    "into 'DP' (VESCALE_DEVICE_MESH.flatten(('dp_replicate', 'dp_shard'), 'DP'))") in one_line(e.value)
        assert mesh.get_strategy_size("EP") == 1 and mesh.get_strategy_size("PP") == 1  # nothing spells these
        mesh.flatten(("dp_replicate", "dp_shard"), "DP")
        assert mesh.lookup_rank("DP") == rank // 4 == mesh.get_data_parallel_rank()


def test_an_absent_standard_name_is_said_absent_not_another_dim(as_rank) -> None:
    as_rank(0, 4)
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    with pytest.raises(KeyError) as e:
        mesh["CP"]
    assert one_line(e.value) == ("unknown dim name 'CP'; valid dim names are ['DP', 'TP']; the mesh has no CP dim (a "
                                 "strategy of size 1 is left out of a mesh: VESCALE_DEVICE_MESH.get_strategy_size('CP') "
                                 "answers 1 for it, get_optional_mesh('CP') None)")
    assert mesh.get_strategy_size("CP") == 1 and mesh.get_optional_mesh("CP") is None  # as the message says
    with pytest.raises(KeyError, match="did you mean 'TP'"):
        mesh["Tp"]  # a typo of a dim the mesh has is still suggested


def test_a_standard_name_the_mesh_spells_otherwise_is_told_its_spelling_not_the_closest_letters() -> None:
    """``mesh["DP"]`` on torchtitan's lower-case names once suggested 'tp' (the closest letters)."""
    from vemesh.layout.names import unknown_name_error

    assert str(unknown_name_error("dim name", "DP", ("dp_shard", "tp"))).endswith("this mesh spells DP as 'dp_shard'\"")
    assert str(unknown_name_error("dim name", "DP", ("dp_replicate", "dp_shard", "tp"))).endswith(
        "this mesh spells DP as 'dp_replicate' and 'dp_shard': name one, or make DP of them with "
        "VESCALE_DEVICE_MESH.flatten(('dp_replicate', 'dp_shard'), 'DP')\"")
    assert str(unknown_name_error("dim name", "tp", ("DP", "TP"))).endswith("did you mean 'TP'?\"")


# ------------------------------------------------------------------- wrappers (fake backend)
def test_ddp_over_dp_alone_on_a_cp_mesh_is_refused(as_rank) -> None:
    for rank in range(8):
        as_rank(rank, 8)
        VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("DP", "CP", "TP"))
        with pytest.raises(ValueError) as e:
            DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["DP"])
        layout = VESCALE_DEVICE_MESH.layout
        left_out = sorted(set(layout.group_ranks(rank, ("DP", "CP"))) - set(layout.group_ranks(rank, "DP")))
        assert f"leaves out ranks {left_out} of this rank's data dims DP, CP" in one_line(e.value)
        VESCALE_DEVICE_MESH.flatten(("DP", "CP"), "dp_cp")
        ddp = DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["dp_cp"])  # the fix
        assert dist.get_process_group_ranks(ddp.data_parallel_group) == VESCALE_DEVICE_MESH.layout.group_ranks(rank, "dp_cp")


def test_ddp_without_a_group_on_unflattened_data_dims_says_what_to_flatten(as_rank) -> None:
    as_rank(3, 8)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("DP", "CP", "TP"))
    with pytest.raises(ValueError) as e:
        DDP(nn.Linear(4, 4))
    assert "flatten them first, VESCALE_DEVICE_MESH.flatten(('DP', 'CP'), 'dp_cp')" in one_line(e.value)
    VESCALE_DEVICE_MESH.flatten(("DP", "CP"), "dp_cp")
    assert dist.get_process_group_ranks(DDP(nn.Linear(4, 4)).data_parallel_group) == [1, 3, 5, 7]


def test_ddp_over_one_hsdp_part_is_refused(as_rank) -> None:
    as_rank(5, 8)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (4, 2), mesh_dim_names=("DP", "TP"))
    VESCALE_DEVICE_MESH.split("DP", ("dp_replicate", "dp_shard"), (2, 2))
    with pytest.raises(ValueError, match=r"leaves out ranks \[1, 3\] of this rank's data dims dp_replicate, dp_shard"):
        DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["dp_shard"])
    assert dist.get_process_group_ranks(DDP(nn.Linear(4, 4)).data_parallel_group) == [1, 3, 5, 7]  # DP answers


def test_ddp_without_a_group_on_a_mesh_without_data_dims_raises(as_rank) -> None:
    """Without a data dim (torchtitan's ParallelDims leaves out dims of size 1) the refusal says what to do at DP 1,
    and the way it gives works: a 'DP' dim of size 1 averages over the rank alone. It once said "pass the group to
    average over, e.g. VESCALE_DEVICE_MESH['DP']", a view this mesh does not have."""
    as_rank(1, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "TP"))
    with pytest.raises(ValueError, match=r"VESCALE_DEVICE_MESH \('PP', 'TP'\) has no data dim .* data parallel is 1 "
                                         r"on it, .* or give init_device_mesh a 'DP' dim of size 1"):
        DDP(nn.Linear(4, 4))
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("DP", "PP", "TP"))
    assert dist.get_process_group_ranks(DDP(nn.Linear(4, 4)).data_parallel_group) == [1]


def test_ddp_given_the_whole_mesh_averages_over_its_data_dims_on_every_rank(as_rank) -> None:
    """``DDP(model, VESCALE_DEVICE_MESH)``, as vemesh's ``fully_shard`` takes the mesh: its data dims, on every rank
    of ``(DP, CP, TP) = (2, 2, 2)`` (``dp_cp``) and of ``(DP, TP)``, as ``DDP(model)`` gives; a mesh without a data dim
    and one not initialized say so. The expert group given the whole mesh is refused, naming the view to pass (the
    experts average over EDP, not the data dims). It once raised "must be a 1-D DeviceMesh, a ProcessGroup or None,
    got VeDeviceMesh", on the first thing a new user tries."""
    from vemesh.mesh import VeDeviceMesh

    for shape, names, grad in (((2, 2, 2), ("DP", "CP", "TP"), "dp_cp"), ((4, 2), ("DP", "TP"), "DP")):
        for rank in range(8):
            as_rank(rank, 8)
            VESCALE_DEVICE_MESH.init_device_mesh("cpu", shape, mesh_dim_names=names)
            if grad == "dp_cp":
                VESCALE_DEVICE_MESH.flatten(("DP", "CP"), "dp_cp")
            ddp = DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH)
            assert dist.get_process_group_ranks(ddp.data_parallel_group) == \
                VESCALE_DEVICE_MESH.layout.group_ranks(rank, grad), (rank, grad)
    with pytest.raises(TypeError) as e:
        DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH, expert_data_parallel=VESCALE_DEVICE_MESH,
            expert_parameters=[])
    assert "expert_data_parallel must be a 1-D DeviceMesh, a ProcessGroup or None; got a whole VeDeviceMesh of dims " \
        "('DP', 'TP'): pass one of its views, mesh[NAME]" in one_line(e.value)
    as_rank(1, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "TP"))
    with pytest.raises(ValueError, match=r"mesh \('PP', 'TP'\) has no data dim .* Leave the model unwrapped"):
        DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH)
    with pytest.raises(ValueError, match="data_pg_or_device_mesh is a VeDeviceMesh that is not initialized"):
        DDP(nn.Linear(4, 4), VeDeviceMesh())


def test_fully_shard_given_a_torch_view_shards_over_it_when_it_is_the_data_dims(as_rank) -> None:
    """``vemesh.parallel.fully_shard(module, mesh=mesh["dp_cp"])``, torch's habit: over that mesh, on every rank of
    ``(DP, CP, TP) = (2, 2, 2)``, as with the mesh manager; ``(DP, CP)`` is torch's HSDP over both. A view that leaves
    out a data rank (``DP`` alone) or holds a TP peer (``(DP, TP)``) is refused, naming the view to pass: FSDP2 would
    average without some of the batch, or over other shards. A module with experts needs the manager (EDP). It once
    raised "'DeviceMesh' object has no attribute 'layout'"."""
    from vemesh.parallel import fully_shard
    from vemesh.parallel.experts.style import EXPERT

    for rank in range(8):
        as_rank(rank, 8)
        VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2, 2), mesh_dim_names=("DP", "CP", "TP"))
        VESCALE_DEVICE_MESH.flatten(("DP", "CP"), "dp_cp")
        data = VESCALE_DEVICE_MESH.layout.group_ranks(rank, "dp_cp")
        sharded = fully_shard(nn.Linear(4, 4), mesh=VESCALE_DEVICE_MESH["dp_cp"])
        assert sharded.weight.device_mesh.mesh.flatten().tolist() == data, rank
        hsdp = fully_shard(nn.Linear(4, 4), mesh=VESCALE_DEVICE_MESH["DP", "CP"])
        assert sorted(hsdp.weight.device_mesh.mesh.flatten().tolist()) == data, rank
        for view in ("DP", ("DP", "TP")):
            with pytest.raises(ValueError) as e:
                fully_shard(nn.Linear(4, 4), mesh=VESCALE_DEVICE_MESH[view])
            assert f"but this rank's data dims hold {data}: FSDP2 must shard over exactly those. Pass " \
                "VESCALE_DEVICE_MESH['dp_cp'], or leave mesh out" in one_line(e.value)
    moe = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    setattr(moe[1], EXPERT, True)
    with pytest.raises(ValueError, match="the module holds experts .* pass mesh=VESCALE_DEVICE_MESH"):
        fully_shard(moe, mesh=VESCALE_DEVICE_MESH["dp_cp"])


def test_a_view_from_before_a_re_init_is_refused(as_rank) -> None:
    as_rank(1, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    old = VESCALE_DEVICE_MESH["DP"]
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (4, 1), mesh_dim_names=("DP", "TP"))
    with pytest.raises(RuntimeError) as e:
        DDP(nn.Linear(4, 4), old)
    assert "is a view of an earlier mesh" in one_line(e.value) and "DP=4, TP=1" in str(e.value)
    DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["DP"])  # taken again: accepted


def test_a_view_from_before_a_reset_is_refused(as_rank) -> None:
    as_rank(1, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    pp = VESCALE_DEVICE_MESH["PP"]
    VESCALE_DEVICE_MESH.reset()
    with pytest.raises(RuntimeError, match="reset and not initialized again"):
        clip_grad_norm_([nn.Parameter(torch.ones(2))], 1.0, groups=[pp])


def test_the_mesh_refuses_every_question_once_its_process_group_is_destroyed(as_rank) -> None:
    """After ``destroy_process_group()`` the mesh's groups are dead and its ranks of a world that is gone; after a new
    ``init_process_group()`` (an in-process restart on fewer ranks) it would answer the old world's sizes."""
    as_rank(3, 8)
    mesh = VESCALE_DEVICE_MESH
    mesh.init_device_mesh("cpu", (2, 4), mesh_dim_names=("DP", "TP"))
    assert mesh.get_strategy_size("TP") == 4 and mesh.is_initialized()
    questions = {"get_strategy_size": lambda: mesh.get_strategy_size("TP"), "view": lambda: mesh["TP"],
                 "get_group": lambda: mesh.get_group("TP"), "get_rank": mesh.get_rank,
                 "get_local_rank": lambda: mesh.get_local_rank("TP"), "size": mesh.size, "mesh": lambda: mesh.mesh,
                 "get_submeshes": lambda: mesh.get_submeshes("TP"), "to_global_rank": lambda: mesh.to_global_rank(1, "TP"),
                 "get_strategy_coordinate": lambda: mesh.get_strategy_coordinate(5)}
    dist.destroy_process_group()
    assert not mesh.is_initialized() and "stale" in repr(mesh)
    for asked, question in questions.items():
        with pytest.raises(RuntimeError, match=r"^the device mesh \(DP=2, TP=4\) was built on a process group that "
                           r"was destroyed \(destroy_process_group\(\)\).*init_device_mesh"):
            question()
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())  # a restart on 4 ranks
    assert not mesh.is_initialized()
    for asked, question in questions.items():
        with pytest.raises(RuntimeError, match="destroyed and replaced by another"):
            question()
    mesh.init_device_mesh("cpu", (4,))  # the fix
    assert mesh.size() == 4 and mesh.get_rank() == 1 and mesh.is_initialized()


def test_clipping_a_pipeline_stage_without_the_pp_group_raises(as_rank) -> None:
    as_rank(2, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    p = nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(ValueError) as e:
        clip_grad_norm_([p], 1.0)
    assert "each pipeline stage would clip by the norm of its own part" in one_line(e.value)
    assert "groups=[VESCALE_DEVICE_MESH.get_group('PP')]" in str(e.value)
    clip_grad_norm_([p], 1.0, groups=[VESCALE_DEVICE_MESH.get_group("PP")])  # the fix


def test_zero1_clipping_on_a_pipeline_needs_the_pp_group(as_rank) -> None:
    as_rank(2, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    model = DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["DP"])
    with pytest.raises(ValueError, match=r"clip_groups=\[VESCALE_DEVICE_MESH.get_group\('PP'\)\]"):
        DistributedOptimizer(torch.optim.AdamW, models=[model], clip_grad=1.0)
    DistributedOptimizer(torch.optim.AdamW, models=[model], clip_grad=1.0, clip_groups=[VESCALE_DEVICE_MESH.get_group("PP")])


def test_clipping_summed_over_the_dp_group_is_refused(as_rank) -> None:
    as_rank(0, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    model = DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["DP"])
    with pytest.raises(ValueError) as e:
        clip_grad_norm_(model.parameters(), 1.0, groups=[VESCALE_DEVICE_MESH.get_group("DP")])
    assert "groups[0] holds ranks [0, 1] of the data-parallel group [0, 1], which hold the same averaged gradients" \
        in one_line(e.value)


def test_clipping_given_one_pp_group_alone_takes_it_as_a_list_of_it(as_rank) -> None:
    """``groups=mesh["PP"]`` or ``groups=mesh.get_group("PP")``, not in a list: the same norm as ``groups=[...]``. It
    once raised "'int' object is not iterable"; the whole mesh still asks for a dim, naming them."""
    as_rank(1, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("PP", "DP"))
    model = nn.Linear(4, 4)
    model.weight.grad, model.bias.grad = torch.ones(4, 4), torch.ones(4)
    listed = clip_grad_norm_(model.parameters(), 1e9, groups=[VESCALE_DEVICE_MESH["PP"]])
    for alone in (VESCALE_DEVICE_MESH["PP"], VESCALE_DEVICE_MESH.get_group("PP")):
        assert torch.equal(clip_grad_norm_(model.parameters(), 1e9, groups=alone), listed)
    with pytest.raises(ValueError, match=r"get_group\(\) needs a dim on a 2-D mesh; choose one of \('PP', 'DP'\)"):
        clip_grad_norm_(model.parameters(), 1e9, groups=VESCALE_DEVICE_MESH)


def test_clipping_summed_over_a_dtensor_mesh_is_refused(as_rank) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    as_rank(0, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    model = parallelize_module(nn.Linear(4, 4), VESCALE_DEVICE_MESH["TP"], ColwiseParallel())
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with pytest.raises(ValueError) as e:
        clip_grad_norm_(model.parameters(), 1.0, groups=[VESCALE_DEVICE_MESH.get_group("TP")])
    assert "holds ranks [0, 1] of a gradient's DTensor mesh dim 'TP'" in one_line(e.value)


def test_zero1_over_models_with_other_groups_is_refused(as_rank) -> None:
    as_rank(0, 4)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    a, b = DDP(nn.Linear(4, 4), VESCALE_DEVICE_MESH["DP"]), DDP(nn.Linear(4, 4), dist.group.WORLD)
    with pytest.raises(ValueError, match=r"all models must share one data-parallel group, got groups with ranks "
                                         r"\[\[0, 2\], \[0, 1, 2, 3\]\]"):
        DistributedOptimizer(torch.optim.AdamW, models=[a, b])


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_requires_grad_changed_after_wrapping_is_refused_and_a_rewrap_trains_the_rest(as_rank, zero1) -> None:
    """A parameter frozen after DDP wrapped the model got a zero gradient after the sync and was stepped (AdamW's
    momentum and weight decay moved it), where torch's optimizers skip a parameter without a gradient; one unfrozen
    after wrapping would never be averaged. Both are refused at the next training forward, naming the parameter;
    wrapping again once the old wrapper and its optimizer are dropped trains the others and leaves it alone."""
    as_rank(0, 2)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))

    def wrap():
        model = DDP(net, VESCALE_DEVICE_MESH["DP"])
        opt = DistributedOptimizer(torch.optim.AdamW, models=[model]) if zero1 else torch.optim.AdamW(model.parameters())
        return model, opt

    model, opt = wrap()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    net[1].bias.requires_grad_(False)
    opt.zero_grad()
    with pytest.raises(RuntimeError) as e:
        model(torch.ones(3, 4))
    assert one_line(e.value).startswith("parameter '1.bias' stopped requiring grad after DistributedDataParallel "
                                        "wrapped the module: it would still get a gradient (zeros) and be stepped")
    assert "build DDP (and the optimizer) again after freezing or unfreezing parameters" in one_line(e.value)
    with pytest.raises(ValueError, match=r"already belongs to a vemesh DistributedDataParallel; wrap the module once "
                                         r"\(to wrap it again, drop the old wrapper and the optimizers built on it"):
        DDP(net, VESCALE_DEVICE_MESH["DP"])
    del model, opt, e  # the error's traceback holds the old wrapper too
    model, opt = wrap()
    frozen = net[1].bias.detach().clone()
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    assert net[1].bias.grad is None and torch.equal(net[1].bias, frozen)
    net[1].bias.requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"^parameter '1.bias' requires grad, but did not when DistributedDataParallel "
                                           r"wrapped the module: its gradient would never be averaged"):
        model(torch.ones(3, 4))


@pytest.mark.parametrize("convert", ["wrapper.double()", "module.half()", "bf16 module.float()"])
def test_a_dtype_changed_after_wrapping_is_named_with_the_parameter(as_rank, convert) -> None:
    """``.double()`` on the wrapper, or ``.half()`` / ``.float()`` on the module inside, changes each parameter's dtype
    in place (torch sets ``param.data``), and the wrapper's gradient buffer keeps the old one. autograd refused the
    buffer's view with "attempting to assign a gradient with dtype 'float' to a tensor with grad_dtype 'Double'",
    naming no parameter and no cause; now the parameter, both dtypes and what to do."""
    as_rank(0, 2)
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    net = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    if convert.startswith("bf16"):
        net.bfloat16()
    model = DDP(net, VESCALE_DEVICE_MESH["DP"])
    {"wrapper.double()": model.double, "module.half()": net.half, "bf16 module.float()": net.float}[convert]()
    was, now = (torch.bfloat16, torch.float32) if convert.startswith("bf16") else (torch.float32, net[1].bias.dtype)
    with pytest.raises(RuntimeError) as e:
        model(torch.ones(3, 4, dtype=now)).float().sum().backward()
    assert one_line(e.value).startswith(f"parameter '1.bias' is {now} on cpu, but was {was} on cpu when "
                                        "DistributedDataParallel wrapped the module (.to(), .double(), .half() or "
                                        ".cuda() ran on it since)")
    assert "Convert the model before wrapping it" in one_line(e.value)


# --------------------------------------------------------------- wrappers (4 gloo ranks)
@pytest.fixture(scope="module")
def world() -> list[dict]:
    return run_ranks(misuse_scenarios.worker, 4, timeout=240, env={"OMP_NUM_THREADS": "1"})


def _raised(world: list[dict], case: str, kind: str, *pieces: str) -> None:
    for rank, results in enumerate(world):
        o = results[case]
        assert not o["ok"] and o["type"] == kind, (rank, o)
        assert "\n" not in o["message"], o["message"]
        for piece in pieces:
            assert piece.format(rank=rank, tp=[rank - rank % 2, rank - rank % 2 + 1]) in o["message"], o["message"]


def test_ddp_without_a_group_averages_over_the_mesh_dp_and_matches_one_process(world) -> None:
    for rank, results in enumerate(world):
        o = results["ddp-default-group"]
        assert o["ok"], o["trace"]
        assert o["value"]["group"] == [rank % 2, rank % 2 + 2] and o["value"]["diff"] < 1e-5, o["value"]


def test_ddp_over_the_world_with_a_tp_model_is_refused(world) -> None:
    _raised(world, "ddp-world-with-tp", "ValueError", "parameter 'fc1.weight' is split over ranks {tp} (S(0) along 'TP'), "
            "and the data-parallel group [0, 1, 2, 3] (the ProcessGroup given) holds 2 of them",
            "pass VESCALE_DEVICE_MESH['DP']")


def test_ddp_over_the_tp_view_is_refused(world) -> None:
    _raised(world, "ddp-tp-as-dp", "ValueError", "the data-parallel group {tp} (mesh['TP']) holds 2 of them")


def test_ddp_without_a_mesh_over_torch_default_group_with_a_tp_model_is_refused(world) -> None:
    _raised(world, "ddp-no-mesh-world", "ValueError", "(torch's default group (no VESCALE_DEVICE_MESH)) holds 2 of them")


def test_tensor_parallelism_applied_after_ddp_is_refused_at_the_forward(world) -> None:
    _raised(world, "ddp-before-tp", "RuntimeError", "parameters changed after DistributedDataParallel wrapped it "
            "(e.g. 'fc1.weight' is a new tensor", "Apply tensor parallelism and sharding first")


def test_experts_left_among_the_dense_parameters_are_refused(world) -> None:
    _raised(world, "experts-in-dp", "ValueError", "the data-parallel parameters differ across the ranks [0, 1, 2, 3]",
            "go in expert_parameters, with expert_data_parallel")


def test_clipping_experts_without_naming_them_is_refused(world) -> None:
    _raised(world, "clip-experts-missing", "ValueError", "is an expert of this EP rank only",
            "expert_groups=[VESCALE_DEVICE_MESH.get_group('EP')]")


def test_fsdp2_on_a_view_that_holds_tp_is_refused_by_torch(world) -> None:
    _raised(world, "fsdp2-view-with-tp", "RuntimeError", "Cannot concatenate overlapping meshes")


def test_vemesh_clip_on_a_mixed_tp_model_is_the_one_process_norm(world) -> None:
    for results in world:
        o = results["vemesh-clip-mixed"]
        assert o["ok"], o["trace"]
        assert abs(o["value"]["norm"] - o["value"]["ref"]) < 1e-5 * o["value"]["ref"], o["value"]
        assert "got mixed torch.Tensor and DTensor" in o["value"]["torch"]  # what torch's own says on the same model


# ------------------------------------------------------------ checkpoints, replicas, CLI, messages
def test_a_flipped_byte_is_listed_as_damaged(tmp_path) -> None:
    model = nn.Linear(8, 8)
    for step in (1, 2):
        checkpoint.save(tmp_path, model=model, step=step)
    data = next((tmp_path / "step_000002").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    listed = checkpoint.list_checkpoints(tmp_path)
    assert [(c.step, c.ok, c.checked) for c in listed] == [(2, False, "checksums"), (1, True, "checksums")]
    assert f"file '{data.name}' does not match its checksum" in listed[0].problem
    fast = checkpoint.list_checkpoints(tmp_path, verify="sizes")  # says what it checked: blind to the flip
    assert [(c.step, c.ok, c.checked) for c in fast] == [(2, True, "sizes"), (1, True, "sizes")]
    with pytest.raises(ValueError, match=r"verify must be one of \['checksums', 'sizes'\]; got 'bytes'"):
        checkpoint.list_checkpoints(tmp_path, verify="bytes")
    assert checkpoint.load_latest(tmp_path, model=nn.Linear(8, 8))[0] == 1  # load agrees: the older one


class _Quorum:
    """torchft's Manager, as far as :class:`vemesh.ft.Replicas` reads it, with a quorum of the given replica ids."""

    _use_async_quorum = False

    def __init__(self, members: tuple[int, ...]) -> None:
        self._pg = types.SimpleNamespace(vemesh_quorum=(1, members))
        self.errors: list[Exception] = []

    def start_quorum(self) -> None:
        pass

    def current_step(self) -> int:
        return 4

    def num_participants(self) -> int:
        return len(self._pg.vemesh_quorum[1])

    def report_error(self, e: Exception) -> None:
        self.errors.append(e)


def test_a_quorum_that_cannot_run_sends_the_newcomer_away_and_the_live_replicas_retry() -> None:
    """Two processes started as replica 1 at the same moment, both let in: the one that just joined leaves, the
    live one votes the step down (nothing is applied) and goes on with the next quorum."""
    from vemesh.ft import ReplicaError, Replicas

    newcomer = Replicas(_Quorum((0, 1, 1)), 1)
    with pytest.raises(ReplicaError, match=r"replica 1: leaving the quorum of step 5: replica id \[1\] joined twice"):
        newcomer.start_step()
    live = Replicas(_Quorum((0, 1, 1)), 0)
    live._seen = (0, 1)  # it has trained with [0, 1]
    live.start_step()
    assert live.refused.startswith("replica id [1] joined twice") and "joined twice" in str(live.manager.errors[0])
    odd = Replicas(_Quorum((0, 1, 2)), 0, admits=lambda n: None if 8 % n == 0 else f"8 rows do not split over {n}")
    odd._seen = (0, 1)
    odd.start_step()
    assert odd.refused == "3 replicas take part and 8 rows do not split over 3"


def test_the_torchft_install_hint_is_what_a_wheel_user_types() -> None:
    from vemesh.ft import INSTALL_HINT

    assert INSTALL_HINT.startswith('pip install "vemesh[ft]"')


def test_plan_finds_a_factory_in_the_current_directory_and_names_the_folder_when_it_cannot(tmp_path, monkeypatch,
                                                                                          capsys) -> None:
    from vemesh.cli import main as cli

    (tmp_path / "mymodel_misuse.py").write_text("import torch\ndef make():\n    return torch.nn.Linear(64, 64)\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    try:
        assert cli(["plan", "--model", "module:mymodel_misuse:make", "--world-size", "2"]) == 0
        assert "every rank" in capsys.readouterr().out
        assert cli(["plan", "--model", "module:./mymodel_misuse.py:make", "--world-size", "2"]) == 0
        assert cli(["plan", "--model", "module:nomodel:make", "--world-size", "2"]) == 2
        err = capsys.readouterr().err
        assert f"no module named 'nomodel' in the current directory {tmp_path} or on sys.path" in err, err
        assert err.count("\n") == 1
    finally:
        sys.modules.pop("mymodel_misuse", None)


def test_mesh_validation_errors_are_one_line_without_pydantic_dumps() -> None:
    from vemesh.layout.spec import MeshSpec

    with pytest.raises(ValueError) as e:
        MeshSpec(device_type="cpu", mesh_shape=(2, 0))
    assert one_line(e.value) == "mesh_shape: every size must be a positive integer, or one -1 to fill in; got 0 in (2, 0)"


# ------------------------------------------------------------------------------- the docs
def test_the_list_in_the_docs_is_the_tests() -> None:
    """Every entry of docs/troubleshooting.md's list names a test that exists; every test here is listed."""
    text = (REPO / "docs" / "troubleshooting.md").read_text()
    listed = re.findall(r"`(test/[\w/]+\.py)::(\w+)`", text)
    assert len(listed) >= 20, listed
    for path, name in listed:
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), f"{path}::{name} does not exist"
    here = {n for n in re.findall(r"^def (test_\w+)\(", Path(__file__).read_text(), re.M)}
    here.discard("test_the_list_in_the_docs_is_the_tests")
    missing = sorted(here - {name for path, name in listed if path.endswith("test_misuse.py")})
    assert not missing, f"tests of test_misuse.py not listed in docs/troubleshooting.md: {missing}"
