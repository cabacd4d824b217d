"""Expert parameters in vemesh's DDP, ZeRO-1 optimizer and gradient clipping, on 4 gloo ranks split
(EDP, EP) = (2, 2): dense gradients are the mean over DP, expert gradients the sum over EDP divided by DP,
experts start from their EDP peer's values, ZeRO-1 shards each kind over its own group, and the norm
counts every expert once. Bad arguments fail on the fake backend before any collective."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore

from launch import run_ranks


class Toy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dense = nn.Linear(4, 4)
        self.expert = nn.Linear(4, 4)  # one "expert": different on each EP rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(torch.tanh(self.dense(x)))


def _experts(rank: int, world: int) -> dict:
    from vemesh import VESCALE_DEVICE_MESH as mesh
    from vemesh.ddp import DistributedDataParallel as DDP
    from vemesh.optim import DistributedOptimizer, clip_grad_norm_

    mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("DP",))
    mesh.flatten(("DP",), "dp_ep")
    mesh.split("dp_ep", ("EDP", "EP"), (2, 2))  # EP groups [0, 1], [2, 3]; EDP groups [0, 2], [1, 3]
    dp, edp, ep = (mesh.get_group(n) for n in ("DP", "EDP", "EP"))
    torch.manual_seed(mesh.lookup_rank("EP") + 10 * rank)  # experts differ by EP rank; the rest is broadcast
    model = Toy()
    ddp = DDP(model, mesh["DP"], expert_data_parallel=mesh["EDP"], expert_parameters=list(model.expert.parameters()))
    start = {n: p.detach().clone() for n, p in model.named_parameters()}  # as broadcast
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + rank))
    local = torch.autograd.grad(model(x).square().sum(), list(model.parameters()))
    out = {"start_equal_over": {}}
    for name, p in model.named_parameters():  # dense from DP rank 0, experts from their EDP group's first rank
        group = edp if name.startswith("expert") else dp
        first = [torch.empty_like(p) for _ in range(dist.get_world_size(group))]
        dist.all_gather(first, p.detach(), group=group)
        out["start_equal_over"][name] = all(torch.equal(f, first[0]) for f in first)
    ddp(x).square().sum().backward()
    err = 0.0
    for (name, p), g in zip(model.named_parameters(), local):
        want = g.clone()
        dist.all_reduce(want, group=edp if name.startswith("expert") else dp)
        err = max(err, (p.grad - want / world).abs().max().item())
    out["grad_error"] = err
    # the norm: dense once, every expert once (by hand: gather all ranks' squares)
    sq = torch.stack([sum(p.grad.square().sum() for n, p in model.named_parameters() if n.startswith(k))
                      for k in ("dense", "expert")])
    every = [torch.empty_like(sq) for _ in range(world)]
    dist.all_gather(every, sq)
    ep_peers = dist.get_process_group_ranks(ep)
    want_norm = (every[rank][0] + sum(every[r][1] for r in ep_peers)).sqrt().item()
    opt = DistributedOptimizer(torch.optim.AdamW, models=[ddp], clip_grad=1e9, lr=0.1)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    norm = clip_grad_norm_(list(model.parameters()), 1e9, expert_parameters=list(model.expert.parameters()),
                           expert_groups=[ep])
    out["norm_error"] = abs(norm.item() - want_norm)
    opt.step()
    out["opt_norm_error"] = abs(opt.grad_norm.item() - want_norm)
    # ZeRO-1 equals plain AdamW on the averaged gradients, dense and expert alike
    ref = Toy()
    ref.load_state_dict(start)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1)
    for name, p in ref.named_parameters():
        p.grad = grads[name]
    ref_opt.step()
    out["step_error"] = max((p - q).abs().max().item() for p, q in zip(ref.parameters(), model.parameters()))
    state = opt.state_dict()  # gathered per group: each expert's state from its EDP peers
    out["state_params"] = sorted(state["state"])
    mesh.reset()
    return out


def test_expert_gradients_norm_and_step_on_4_gloo_ranks():
    for rank, res in enumerate(run_ranks(_experts, 4)):
        assert all(res["start_equal_over"].values()), (rank, res["start_equal_over"])
        assert res["grad_error"] < 1e-6, (rank, res)
        assert res["norm_error"] < 1e-5 and res["opt_norm_error"] < 1e-5, (rank, res)
        assert res["step_error"] < 1e-6, (rank, res)
        assert res["state_params"] == [0, 1, 2, 3], (rank, res)


@pytest.fixture
def fake4():
    dist.init_process_group("fake", rank=1, world_size=4, store=FakeStore())
    yield
    dist.destroy_process_group()


def test_bad_expert_arguments_fail_before_any_collective(fake4):
    from vemesh.ddp import DistributedDataParallel as DDP

    model = Toy()
    experts = list(model.expert.parameters())
    edp = dist.new_group([1, 3])
    with pytest.raises(ValueError, match="expert_data_parallel was given without expert_parameters; pass both"):
        DDP(model, expert_data_parallel=edp)
    with pytest.raises(ValueError, match="expert_parameters was given without expert_data_parallel"):
        DDP(model, expert_parameters=experts)
    with pytest.raises(ValueError, match=r"expert_parameters holds a tensor of shape \(4, 4\) that is not a trainable"):
        DDP(Toy(), expert_data_parallel=edp, expert_parameters=[nn.Parameter(torch.zeros(4, 4))])
    with pytest.raises(ValueError, match=r"the expert-data-parallel group \[1, 3\] must be part of the data-parallel group \[0, 1\]"):
        DDP(model, dist.new_group([0, 1]), expert_data_parallel=edp, expert_parameters=experts)
    with pytest.raises(ValueError, match="expert_parameters is empty"):
        DDP(Toy(), expert_data_parallel=edp, expert_parameters=[])


def test_expert_tensor_parallel_refuses_what_it_cannot_split(fake4):
    """``ExpertTensorParallel`` needs the 2-D EP x TP view, parameters it can split over TP, and names it knows."""
    from torch.distributed.tensor.parallel import parallelize_module

    from vemesh import VESCALE_DEVICE_MESH as mesh
    from vemesh.parallel import ExpertTensorParallel, ParallelDims

    class Grouped(nn.Module):
        def __init__(self, hidden: int = 8) -> None:
            super().__init__()
            self.w1, self.w2 = nn.Parameter(torch.zeros(4, hidden, 4)), nn.Parameter(torch.zeros(4, 4, hidden))

    ParallelDims(4, dp_shard=2, tp=2, ep=2).build("cpu", mesh)
    try:
        with pytest.raises(ValueError, match=r"needs the 2-D mesh of EP and TP, VESCALE_DEVICE_MESH\['EP', 'TP'\]"):
            parallelize_module(Grouped(), mesh["EP"], ExpertTensorParallel())
        with pytest.raises(ValueError, match=r"w1 \(4, 3, 4\) cannot split dim 1 over TP 2"):
            parallelize_module(Grouped(hidden=3), mesh["EP", "TP"], ExpertTensorParallel())
        with pytest.raises(ValueError, match=r"tp_dims names \['w3'\], which Grouped does not have"):
            parallelize_module(Grouped(), mesh["EP", "TP"], ExpertTensorParallel({"w1": 1, "w3": 1}))
        experts = parallelize_module(Grouped(), mesh["EP", "TP"], ExpertTensorParallel())
        assert experts.w1.to_local().shape == (2, 4, 4) and experts.w2.to_local().shape == (2, 4, 4)
        with pytest.raises(ValueError, match="already expert-parallel; apply ExpertTensorParallel once"):
            parallelize_module(experts, mesh["EP", "TP"], ExpertTensorParallel())
    finally:
        mesh.reset()
