"""vemesh's DDP and ZeRO-1 hold the collectives' work handles they waited for until their next wait.

Dropped at once, a gloo work's last reference can be gloo's worker thread's, which releases it a moment after the
collective completes; a script that returns in that moment aborts at exit, "terminate called without an active
exception" (docs/troubleshooting.md). Measured with two CPU burners, a 2-rank torchrun script (vemesh DDP, 4 steps,
``destroy_process_group()`` at its end) aborted in 4 of 16 runs under torch's AdamW and 3 to 6 of 12 to 16 under
ZeRO-1 before, 0 of 16 each after. Checked here on the fake backend in one process, where nothing but Python holds
a work: every work of the last step's gradient reduction and parameter gather is alive after the step.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.testing._internal.distributed.fake_pg import FakeStore


@pytest.fixture
def fake_dp2():
    from vemesh import VeDeviceMesh

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", (2,), mesh_dim_names=("DP",))
    yield mesh
    dist.destroy_process_group()


@pytest.mark.parametrize("zero1", [False, True], ids=["ddp", "zero1"])
def test_the_last_steps_waited_works_are_held_until_the_next_wait(fake_dp2, monkeypatch, zero1) -> None:
    from vemesh.ddp import DistributedDataParallel as DDP
    from vemesh.optim import DistributedOptimizer

    seen: list[tuple[str, weakref.ref]] = []

    def recording(name: str):
        original = getattr(dist, name)

        def call(*args, **kwargs):
            work = original(*args, **kwargs)
            if work is not None:  # async: the caller waits for it
                seen.append((name, weakref.ref(work)))
            return work
        return call

    for name in ("all_reduce", "all_gather_single", "broadcast"):
        monkeypatch.setattr(dist, name, recording(name))
    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 2)), fake_dp2["DP"], bucket_size=16)
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model]) if zero1 else torch.optim.AdamW(model.parameters())
    for step in range(2):
        seen.clear()
        opt.zero_grad()
        model(torch.randn(4, 8)).square().sum().backward()
        opt.step()
        gc.collect()
        kinds = sorted({name for name, _ in seen})
        assert kinds == (["all_gather_single", "all_reduce"] if zero1 else ["all_reduce"]), kinds
        assert sum(name == "all_reduce" for name, _ in seen) > 1  # several buckets
        dead = [name for name, ref in seen if ref() is None]
        assert not dead, f"step {step}: {len(dead)} of {len(seen)} waited works dropped ({dead})"
