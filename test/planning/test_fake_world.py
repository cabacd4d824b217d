"""The planner's fake world: what it changes in torch while it traces, and that it leaves nothing behind."""

from __future__ import annotations

import copy
import json
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn

from vemesh import VESCALE_DEVICE_MESH
from vemesh.planning.fake_world import _storages, copies_in_mode, fake_world, give_storage, to_bf16
from vemesh.planning.fit import Job, predict

SMALL = "gpt:n_layer=4,n_embd=64,n_head=4,vocab=256,seq_len=32"


def test_a_deepcopy_in_the_trace_is_a_fake_tensor_of_the_traces_own_mode() -> None:
    """torch's own deepcopy of a fake tensor makes it in a new fake mode, whose views MemTracker cannot tell from
    their base (a pipeline stage cut by deepcopy held its weights twice in the peak); inside ``copies_in_mode`` a
    copy is the trace's, with its own storage, and a Parameter stays a Parameter."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        layer = nn.Linear(4, 4)
        outside = copy.deepcopy(layer).weight
        assert outside.fake_mode is not mode  # what torch does, which the planner replaces
        with copies_in_mode(mode):
            copied = copy.deepcopy(layer)
        w = copied.weight
        assert isinstance(w, nn.Parameter) and w.fake_mode is mode and w.requires_grad
        assert w.t().untyped_storage() is w.untyped_storage()
        assert w.untyped_storage() is not layer.weight.untyped_storage()


def test_storage_given_in_one_pass_is_what_to_empty_then_to_bf16_give() -> None:
    """``give_storage(model, dtype=bf16)`` makes each meta tensor as ``to_empty`` and then ``.to(torch.bfloat16)`` do:
    the same shapes, strides (a non-contiguous one's too) and dtypes, integer buffers kept, parameters still
    parameters, tied weights still tied; and each storage is counted once, however many tensors view it."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    def build() -> nn.Module:
        with torch.device("meta"):
            model = nn.Sequential(nn.Embedding(16, 8), nn.Linear(8, 16, bias=False))
            model[1].weight = model[0].weight  # tied, as a GPT ties its head to its embedding
            model.register_parameter("across", nn.Parameter(torch.empty(6, 4).t()))  # non-contiguous
            model.register_buffer("steps", torch.zeros(3, dtype=torch.int64))
            model.register_buffer("row", torch.empty_strided((1, 4), (1, 1)))  # contiguous, a size-1 dim's odd stride
        return model

    with FakeTensorMode(allow_non_fake_inputs=True):
        one, two = build(), build()
        give_storage(one, dtype=torch.bfloat16)
        give_storage(two)
        to_bf16(two)
        for a, b in zip((*one.parameters(), *one.buffers()), (*two.parameters(), *two.buffers()), strict=True):
            assert isinstance(a, FakeTensor) and not a.is_meta and a.device.type == "cpu"
            assert (a.shape, a.stride(), a.dtype, type(a)) == (b.shape, b.stride(), b.dtype, type(b))
        assert one.across.stride() == (1, 4) and one.steps.dtype == torch.int64
        assert isinstance(one.across, nn.Parameter) and one[1].weight is one[0].weight
        tensors = [*one.parameters(), *one.buffers()]
        assert one.row.stride() == (1, 1) and one.row.is_contiguous()
        assert sum(_storages([*tensors, one.across.t(), one[0].weight[:2]]).values()) == (128 + 24 + 4) * 2 + 3 * 8


def test_each_pp_rank_is_traced_in_its_own_world_and_dtensors_caches_do_not_cross_them() -> None:
    """PP x TP: PP rank 1's TP all-reduces on its own TP group. DeviceMesh compares equal for the same slice of two
    worlds, so a sharding plan DTensor cached in PP rank 0's world would send them to rank 0's group: the fake world
    empties those caches on entry and exit."""
    fit = predict(Job(SMALL, 8, micro_batch_size=2), dp=1, tp=2, pp=2)
    assert [c.name for c in fit.classes] == ["PP rank 0", "PP rank 1"]
    assert all(c.sent.get("TP", 0) > 0 and c.sent.get("PP", 0) > 0 for c in fit.classes)
    assert not dist.is_initialized() and not VESCALE_DEVICE_MESH.is_initialized()


def test_the_fake_world_of_a_pp_rank_is_its_first_rank() -> None:
    degrees = {"PP": 2, "DP": 2, "CP": 1, "TP": 2, "EP": 1}
    for pp_rank, rank in ((0, 0), (1, 4)):
        with fake_world(8, degrees, 1, pp_rank=pp_rank) as mesh:
            assert dist.get_rank() == rank and mesh.lookup_rank("PP") == pp_rank
            assert dist.get_process_group_ranks(mesh["TP"].get_group()) == [rank, rank + 1]
    assert not dist.is_initialized() and torch.distributed.distributed_c10d._world.pg_map == {}


def test_local_shards_cut_what_torchs_distribute_tensor_cuts_on_every_rank() -> None:
    """The planner's ``distribute_tensor`` (this rank's chunk only, no scatter) against torch's own on every rank of
    a 4-rank mesh: even, uneven and empty chunks, on dim 0 and 1, the same local tensor (shape, values, stride)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vemesh.planning.fake_world import local_shards

    for rank in range(4):
        dist.init_process_group("fake", rank=rank, world_size=4, store=FakeStore())
        try:
            device_mesh = DeviceMesh("cpu", [0, 1, 2, 3])
            for shape, dim in (((8, 3), 0), ((6, 5), 0), ((3, 2), 0), ((2, 7), 1)):
                full = torch.arange(float(shape[0] * shape[1])).reshape(shape)
                want = distribute_tensor(full, device_mesh, [Shard(dim)], src_data_rank=None).to_local()
                with local_shards():
                    got = distribute_tensor(full, device_mesh, [Shard(dim)]).to_local()
                assert got.shape == want.shape and torch.equal(got, want) and got.stride() == want.stride(), \
                    (rank, shape, dim)
        finally:
            dist.destroy_process_group()


def test_a_plan_leaves_the_users_mesh_and_world_as_they_were() -> None:
    """The planner's fake world is its own. After a plan no process group is left and ``VESCALE_DEVICE_MESH`` is as
    it was (not built). Asked inside the user's own world, a plan refuses, and that world's mesh, groups and epoch
    are untouched."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vemesh.planning import plan

    mesh = VESCALE_DEVICE_MESH

    gpt = "gpt:n_layer=2,n_embd=64,n_head=4"
    assert not mesh.is_initialized() and not dist.is_initialized()
    assert plan(gpt, world_size=4, tp=2, global_batch_size=4)["degrees"]["TP"] == 2
    assert not mesh.is_initialized() and not dist.is_initialized()
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    try:
        mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
        before = (mesh.epoch, mesh.get_group("TP"), mesh.mesh, mesh.get_local_rank("TP"))
        with pytest.raises(RuntimeError, match="in a world of its own; call it before init_process_group"):
            plan(gpt, world_size=4, tp=2, global_batch_size=8)  # not the plan above: its traces are kept
        assert (mesh.epoch, mesh.get_group("TP"), mesh.mesh, mesh.get_local_rank("TP")) == before
        assert mesh.mesh.mesh_dim_names == ("DP", "TP") and dist.get_rank() == 1
    finally:
        mesh.reset()
        dist.destroy_process_group()


def test_a_trace_that_redistributes_over_two_dims_prints_no_torch_warning(capfd) -> None:
    """The Llama 3 preset clips its gradients over DP x TP, where DTensor's norm takes two all-reduces and torch warns
    once per mesh; every trace has a mesh of its own, so a search printed it once per mesh. The trace counts both."""
    from vemesh.cli import main

    assert main(["plan", "--model", "llama3:8b", "--world-size", "8", "--tp", "2", "--dtype", "bf16",
                 "--global-batch-size", "8", "--json"]) == 0
    out, err = capfd.readouterr()
    assert json.loads(out)["degrees"]["TP"] == 2
    assert "sequential all_reduce" not in err, err[-600:]
    assert logging.getLogger("torch.distributed.tensor._redistribute").level == logging.NOTSET  # given back
