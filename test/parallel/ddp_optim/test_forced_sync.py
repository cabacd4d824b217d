"""``finish_grad_sync(force=True)`` averages gradients that no gradient hook saw: the weight pass of torch's
zero-bubble schedules computes them with ``torch.autograd.grad`` and adds them by hand (2 gloo ranks). Without it, a
torch optimizer's step on them raises, where it stepped on each rank's own gradient."""

from __future__ import annotations

import torch
from torch import nn

from launch import run_ranks


def _step_refused(opt: torch.optim.Optimizer) -> str:
    try:
        opt.step()
    except RuntimeError as e:
        return str(e)
    return ""


def _by_hand(rank: int, world: int) -> dict:
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
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    out = {}
    for set_to_none in (True, False):  # stage_backward_weight: .grad = dw when None, else .grad += dw (in place)
        model.zero_grad(set_to_none=set_to_none)
        dws = torch.autograd.grad(model.module(xs[rank]).square().sum(), list(model.module.parameters()))
        for p, dw in zip(model.module.parameters(), dws):
            if p.grad is None:
                p.grad = dw
            else:
                p.grad += dw
        model.finish_grad_sync()  # nothing unaveraged as far as the hooks know: a no-op
        out[f"unforced-{set_to_none}"] = max((p.grad - m).abs().max().item()
                                             for p, m in zip(model.module.parameters(), mean))
        out[f"refused-{set_to_none}"] = _step_refused(opt)
        model.finish_grad_sync(force=True)
        out[f"forced-{set_to_none}"] = max((p.grad - m).abs().max().item()
                                           for p, m in zip(model.module.parameters(), mean))
        out[f"stepped-{set_to_none}"] = _step_refused(opt)
    # a gradient computed for a look after the average, not written into .grad: the step goes on
    model.zero_grad()
    model(xs[rank]).square().sum().backward()
    torch.autograd.grad(model.module(xs[rank]).sum(), list(model.module.parameters()))
    out["looked"] = _step_refused(opt)
    VESCALE_DEVICE_MESH.reset()
    return out


def test_forced_sync_averages_gradients_written_by_hand_and_a_step_before_it_raises():
    for out in run_ranks(_by_hand, 2):
        for set_to_none in (True, False):
            assert out[f"unforced-{set_to_none}"] > 1e-3  # the hand-written gradient is this rank's own
            assert "SGD.step() would use gradients of 2 parameters (e.g. 'weight') that torch.autograd.grad " \
                   "computed and that were written into .grad by hand" in out[f"refused-{set_to_none}"], out
            assert "finish_grad_sync(force=True)" in out[f"refused-{set_to_none}"]
            assert out[f"forced-{set_to_none}"] < 1e-6 and out[f"stepped-{set_to_none}"] == "", out
        assert out["looked"] == "", out
