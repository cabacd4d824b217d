"""What each gloo rank does in test_moe_dispatch.py: one MoE layer with its experts spread over EP
ranks against the same layer with every expert in one process (the tensors on CPU or on CUDA)."""

from __future__ import annotations

import torch

from ep import ExpertParallelDispatch, experts_of
from model import Experts, GPTConfig, MoE
from vemesh import VeDeviceMesh


def compare(rank: int, world: int, device: str = "cpu") -> dict:
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("EP",))  # gloo groups; the tensors may live on CUDA
    torch.manual_seed(0)
    moe = MoE(GPTConfig(n_embd=32, moe_experts=2 * world, moe_top_k=2)).to(device)
    x = torch.randn(2 * world, 8, 32, generator=torch.Generator().manual_seed(1)).to(device).requires_grad_()
    ref = moe(x)
    ref.square().sum().backward()
    ref_dx, ref_grads = x.grad.clone(), {n: p.grad.clone() for n, p in moe.named_parameters()}
    mine = experts_of(rank, world, moe.n_experts)
    moe.experts = Experts({k: e for k, e in moe.experts.items() if int(k) in mine})
    moe.dispatch = ExpertParallelDispatch(mesh["EP"], moe.n_experts)
    moe.zero_grad()
    rows = slice(2 * rank, 2 * rank + 2)  # each rank its own rows of the batch
    xs = x.detach()[rows].clone().requires_grad_()
    y = moe(xs)
    y.square().sum().backward()
    # an expert lives on one rank and sees every rank's tokens for it: its gradient is the whole batch's
    expert_err = max((p.grad - ref_grads[n]).abs().max().item() for n, p in moe.named_parameters() if "experts" in n)
    out = {"experts": sorted(moe.experts.keys(), key=int), "out": (y - ref[rows]).abs().max().item(),
           "dx": (xs.grad - ref_dx[rows]).abs().max().item(), "expert_grads": expert_err}
    mesh.reset()
    return out


def wrap_without_expert_groups(rank: int, world: int) -> str:
    """DDP over an EP-split MoE with no word about its experts: every rank must refuse, none may hang."""
    from ep import apply_ep
    from vemesh.ddp import DistributedDataParallel as DDP

    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (world,), mesh_dim_names=("DP",))
    mesh.flatten(("DP",), "dp_ep")
    mesh.split("dp_ep", ("EDP", "EP"), (1, world))
    torch.manual_seed(0)
    model = torch.nn.Sequential()
    model.add_module("moe", MoE(GPTConfig(n_embd=16, moe_experts=world, moe_top_k=1)))
    model.moe_layers = lambda: [model.moe]
    apply_ep(model, mesh["EP"])
    try:
        DDP(model, mesh["DP"])
    except ValueError as e:
        return str(e)
    finally:
        mesh.reset()
    return "no error"
