"""What each of 4 gloo ranks does in test_hsdp_gloo.py: torchtitan's mesh, FSDP2 on its HSDP view, and a split."""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import fully_shard

from vemesh import VESCALE_DEVICE_MESH

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
STEPS, BATCH = 3, 8


def net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 4))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 8, generator=g), torch.randn(BATCH, 4, generator=g)


def worker(rank: int, world_size: int) -> dict:
    warnings.filterwarnings("ignore", message="Slicing a flattened dim from root mesh")
    out = {}
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2, 1, 1), mesh_dim_names=NAMES)
    VESCALE_DEVICE_MESH.flatten(("dp_shard", "cp"), "dp_shard_cp")
    VESCALE_DEVICE_MESH.flatten(("dp_replicate", "dp_shard_cp"), "dp_cp")
    hsdp = VESCALE_DEVICE_MESH["dp_replicate", "dp_shard_cp"]
    out["hsdp_mesh"] = hsdp.mesh.tolist()
    model = fully_shard(net(), mesh=hsdp)  # replicate over dp_replicate, shard over dp_shard_cp
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref = net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    dp, r = VESCALE_DEVICE_MESH.get_strategy_size("dp_cp"), VESCALE_DEVICE_MESH.lookup_rank("dp_cp")
    rows = slice(r * BATCH // dp, (r + 1) * BATCH // dp)
    for step in range(STEPS):
        x, y = data(step)
        opt.zero_grad()
        F.mse_loss(model(x[rows]), y[rows]).backward()
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
    out["max_diff"] = max((p.full_tensor() - q).abs().max().item() for p, q in zip(model.parameters(), ref.parameters()))
    # a split after init, used for a real collective: each dp_shard group sums its two ranks
    VESCALE_DEVICE_MESH.split("dp_replicate", ("outer", "inner"), (2, 1))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=VESCALE_DEVICE_MESH.get_group("dp_shard"))
    out["dp_shard_sum"] = t.item()
    out["dp_shard_group"] = dist.get_process_group_ranks(VESCALE_DEVICE_MESH.get_group("dp_shard"))
    VESCALE_DEVICE_MESH.reset()
    return out
