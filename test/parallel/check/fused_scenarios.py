"""What each rank runs in test_fused_checkpoints.py: a fused weight under TP and FSDP2 saved by vemesh's checkpoints,
loaded back on another TP degree (spawn pickles these by name)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import parallelize_module

import vemesh.checkpoint as ck
from vemesh import VESCALE_DEVICE_MESH as mesh
from vemesh.parallel import FusedColwiseParallel, ParallelDims, fully_shard


def _model(tp: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    ParallelDims(4, tp=tp).build("cpu")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.Linear(24, 4))
    if tp > 1:
        parallelize_module(model, mesh["TP"], {"0": FusedColwiseParallel(3, output_layouts=Replicate())})
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def save_then_load(rank: int, world: int, path: str, save_tp: int, load_tp: int) -> dict[str, bool]:
    model, opt = _model(save_tp)
    torch.manual_seed(1)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    want = {k: v.full_tensor() for k, v in model.state_dict().items()}
    want_state = {k: v["exp_avg"].full_tensor() for k, v in zip(model.state_dict(), opt.state.values())}
    ck.save(path, step=1, model=model, optimizer=opt)
    mesh.reset()
    model, opt = _model(load_tp)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()  # some other state, overwritten by the load
    ck.load(path, model=model, optimizer=opt)
    got = {k: v.full_tensor() for k, v in model.state_dict().items()}
    got_state = {k: v["exp_avg"].full_tensor() for k, v in zip(model.state_dict(), opt.state.values())}
    return {k: torch.equal(got[k], want[k]) and torch.equal(got_state[k], want_state[k]) for k in want}
