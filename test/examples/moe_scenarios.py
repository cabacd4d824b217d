"""What each gloo rank does in test_moe_dispatch.py: one MoE layer of the GPT preset with its grouped experts spread
over EP ranks by ``ExpertParallel``, against the same layer with every expert in one process (the tensors on CPU or
on CUDA)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module

from vemesh import VeDeviceMesh
from vemesh.models.gpt import GPTConfig, MoE
from vemesh.parallel import ExpertParallel


def compare(rank: int, world: int, device: str = "cpu") -> dict:
    mesh = VeDeviceMesh()
    # gloo groups (run_ranks' process group) on a mesh of the tensors' device: ExpertParallel's DTensors live on the
    # mesh's device, as torch's distribute_tensor places them, so a CUDA run needs a "cuda" mesh (its ranks share a GPU)
    if device == "cuda":
        torch.cuda.set_device(0)  # before the mesh, which would take GPU LOCAL_RANK: the ranks share one GPU
    mesh.init_device_mesh(device, (world,), mesh_dim_names=("EP",))
    torch.manual_seed(0)
    moe = MoE(GPTConfig(n_embd=32, moe_experts=2 * world, moe_top_k=2)).to(device)
    x = torch.randn(2 * world, 8, 32, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    ref = moe(x)
    ref.square().sum().backward()
    ref_dx, ref_grads = x.grad.clone(), {n: p.grad.clone() for n, p in moe.named_parameters()}
    parallelize_module(moe.experts, mesh["EP"], ExpertParallel())
    moe.zero_grad()
    rows = slice(2 * rank, 2 * rank + 2)  # each rank its own rows of the batch
    xs = x.detach()[rows].clone().requires_grad_()
    y = moe(xs)
    y.square().sum().backward()
    # an expert lives on one rank and sees every rank's tokens for it: its gradient is the whole batch's
    held = [(n, p) for n, p in moe.named_parameters() if isinstance(p, DTensor)]
    expert_err = max((p.grad.to_local() - ref_grads[n].chunk(world)[rank]).abs().max().item() for n, p in held)
    out = {"experts": [n for n, _ in held], "local_rows": held[0][1].to_local().size(0),
           "out": (y - ref[rows]).abs().max().item(), "dx": (xs.grad - ref_dx[rows]).abs().max().item(),
           "expert_grads": expert_err}
    mesh.reset()
    return out


def wrap_without_an_edp(rank: int, world: int) -> str:
    """DDP over a model whose experts ExpertParallel spread, on a mesh with no EDP dim: every rank must refuse
    (it cannot know where the experts' gradients average), none may hang."""
    from vemesh import VESCALE_DEVICE_MESH
    from vemesh.ddp import DistributedDataParallel as DDP

    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (world,), mesh_dim_names=("EP",))
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("moe", MoE(GPTConfig(n_embd=16, moe_experts=world, moe_top_k=1)))
    parallelize_module(model.moe.experts, VESCALE_DEVICE_MESH["EP"], ExpertParallel())
    try:
        DDP(model, VESCALE_DEVICE_MESH["EP"])
    except ValueError as e:
        return str(e)
    finally:
        VESCALE_DEVICE_MESH.reset()
    return "no error"
