"""ZeRO-1 hands its inner optimizer 512K-element chunks on a CPU (a cache's size) and whole runs on a GPU (each chunk
there is only host work per step). The two cuts step alike, and a state dict of one loads into the other."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.models.gpt import GPT, GPTConfig
from vemesh.optim import DistributedOptimizer
from vemesh.parallel.optim import distributed_optimizer as zero1


@pytest.fixture
def world_of_one():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _job(whole: bool) -> tuple[DDP, DistributedOptimizer]:
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_embd=256, n_head=4)))
    # whole: as on a GPU (what a plan for a GPU traces on the CPU); else the CPU's own cut
    return model, DistributedOptimizer(torch.optim.AdamW, models=[model], lr=1e-2, main_param_chunk=0 if whole else None)


def _step(model: DDP, opt: DistributedOptimizer, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, 64, (2, 16), generator=g)
    opt.zero_grad()
    model(x).float().square().mean().backward()
    opt.step()


def test_a_gpus_whole_runs_step_as_a_cpus_chunks_and_their_state_dicts_load_into_each_other(world_of_one) -> None:
    meta = torch.empty(3 << 19, device="meta")
    assert len(zero1._chunks(meta)) == 1 and len(zero1._chunks(torch.empty(3 << 19))) == 3
    chunked, cut = _job(False)
    whole, kept = _job(True)
    assert len(cut._inner) > len(kept._inner) == len(kept.shards[0].runs)
    for bad in (-1, True, 2.5):
        with pytest.raises(ValueError, match=rf"main_param_chunk must be a number of elements >= 0 \(0: whole runs\) "
                                             rf"or None \(by device\), got {bad!r}"):
            DistributedOptimizer(torch.optim.AdamW, models=[chunked], main_param_chunk=bad)
    for seed in range(3):
        _step(chunked, cut, seed)
        _step(whole, kept, seed)
    for a, b in zip(chunked.parameters(), whole.parameters()):
        assert torch.equal(a, b)
    # the per-parameter state dict does not depend on the cut: whole -> chunked, chunked -> whole
    again, cut_again = _job(False)
    again.load_state_dict(whole.state_dict())
    cut_again.load_state_dict(kept.state_dict())
    whole_again, kept_again = _job(True)
    whole_again.load_state_dict(chunked.state_dict())
    kept_again.load_state_dict(cut.state_dict())
    for model, opt in ((chunked, cut), (whole, kept), (again, cut_again), (whole_again, kept_again)):
        _step(model, opt, 7)
    for a, b, c, d in zip(chunked.parameters(), whole.parameters(), again.parameters(), whole_again.parameters()):
        assert torch.equal(a, b) and torch.equal(a, c) and torch.equal(a, d)
