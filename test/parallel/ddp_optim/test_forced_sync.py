"""``finish_grad_sync(force=True)`` averages gradients that no gradient hook saw: the weight pass of torch's
zero-bubble schedules computes them with ``torch.autograd.grad`` and adds them by hand (2 gloo ranks)."""

from __future__ import annotations

import torch
from torch import nn

from launch import run_ranks


def _by_hand(rank: int, world: int) -> float:
    from vemesh import VESCALE_DEVICE_MESH
    from vemesh.ddp import DistributedDataParallel as DDP

    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = DDP(nn.Linear(4, 3), VESCALE_DEVICE_MESH["DP"])
    xs = [torch.full((2, 4), float(r + 1)) for r in range(world)]
    expected = []
    for x in xs:  # what each rank's gradient is, then their mean
        grads = torch.autograd.grad(model.module(x).square().sum(), list(model.module.parameters()))
        expected.append(grads)
    mean = [sum(g[i] for g in expected) / world for i in range(2)]
    model.zero_grad()
    dws = torch.autograd.grad(model.module(xs[rank]).square().sum(), list(model.module.parameters()))
    for p, dw in zip(model.module.parameters(), dws):  # as torch's stage_backward_weight does
        p.grad = dw if p.grad is None else p.grad + dw
    model.finish_grad_sync()  # nothing unaveraged as far as the hooks know: a no-op
    unforced = max((p.grad - m).abs().max().item() for p, m in zip(model.module.parameters(), mean))
    model.finish_grad_sync(force=True)
    forced = max((p.grad - m).abs().max().item() for p, m in zip(model.module.parameters(), mean))
    VESCALE_DEVICE_MESH.reset()
    return unforced, forced


def test_forced_sync_averages_gradients_written_by_hand():
    for unforced, forced in run_ranks(_by_hand, 2):
        assert unforced > 1e-3  # the hand-written gradient is this rank's own
        assert forced < 1e-6
