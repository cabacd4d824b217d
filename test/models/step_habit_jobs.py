"""Steps written the way torch's users write them, for ``vemesh check`` (test_check.py): gradients accumulated with
``no_sync()`` on every micro-batch but the last (vemesh's and torch's DDP), FSDP2's ``set_requires_gradient_sync``, a
step that reads DDP's ``module``, one whose last backward never syncs, a log line's all-reduce on rank 0 alone,
collectives that wait for each other in a cycle, and a forward under ``torch.autocast`` to bf16 with a TP plan."""

from __future__ import annotations

import torch
from torch import nn

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vemesh.ddp import DistributedDataParallel

VOCAB = 50


def make() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    return DistributedDataParallel(model, mesh["DP"])


def parallelize_torch_ddp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    return nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group())


def parallelize_fsdp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    from vemesh.parallel import fully_shard

    return fully_shard(model)


def _micro_batch(model: nn.Module, batch_size: int, vocab: int = VOCAB) -> torch.Tensor:
    ids = torch.randint(0, vocab, (batch_size, 8))
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()) / 2
    loss.backward()
    return loss


def step_no_sync(model: nn.Module, batch_size: int) -> torch.Tensor:
    with model.no_sync():
        _micro_batch(model, batch_size)
    return _micro_batch(model, batch_size)


def step_module(model: nn.Module, batch_size: int) -> torch.Tensor:
    vocab = model.module[0].num_embeddings  # torch DDP's wrapped model
    with model.no_sync():
        _micro_batch(model, batch_size, vocab)
    return _micro_batch(model, batch_size, vocab)


def step_fsdp(model: nn.Module, batch_size: int) -> torch.Tensor:
    model.set_requires_gradient_sync(False)
    _micro_batch(model, batch_size)
    model.set_requires_gradient_sync(True)
    return _micro_batch(model, batch_size)


def step_never_synced(model: nn.Module, batch_size: int) -> torch.Tensor:
    with model.no_sync():
        _micro_batch(model, batch_size)
        return _micro_batch(model, batch_size)


def step_logged_on_rank_zero(model: nn.Module, batch_size: int) -> torch.Tensor:
    """A log line's mean loss all-reduced under ``if rank == 0:``: rank 0 waits for the others forever."""
    import torch.distributed as dist

    loss = _micro_batch(model, batch_size)
    if dist.get_rank() == 0:
        dist.all_reduce(loss.detach().clone())
    return loss


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 64)
        self.up, self.down, self.head = nn.Linear(64, 256), nn.Linear(256, 64), nn.Linear(64, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        return self.head(h + self.down(torch.relu(self.up(h))))


def make_mlp() -> nn.Module:
    return MLP()


def parallelize_mlp(model: MLP, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    parallelize_module(model, mesh["TP"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    return DistributedDataParallel(model, mesh["DP"])


def step_autocast(model: nn.Module, batch_size: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch_size, 16))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(ids)
    loss = nn.functional.cross_entropy(logits.float().flatten(0, 1), ids.flatten())
    loss.backward()
    return loss


def step_in_a_cycle(model: nn.Module, batch_size: int) -> torch.Tensor:
    """On DP 2 x TP 2, each rank's first all-reduce in a group whose other rank is in its own first: rank 0 waits for
    rank 2 (DP), 2 for 3 (TP), 3 for 1 (DP), 1 for 0 (TP)."""
    import torch.distributed as dist

    from vemesh import VESCALE_DEVICE_MESH

    loss = _micro_batch(model, batch_size)
    dp, tp = VESCALE_DEVICE_MESH["DP"].get_group(), VESCALE_DEVICE_MESH["TP"].get_group()
    for group in (dp, tp) if dist.get_rank() in (0, 3) else (tp, dp):
        dist.all_reduce(torch.ones(3), group=group)
    return loss


def step_receiving(model: nn.Module, batch_size: int) -> torch.Tensor:
    """A message from the next rank, by hand."""
    import torch.distributed as dist

    loss = _micro_batch(model, batch_size)
    dist.recv(torch.zeros(3), src=(dist.get_rank() + 1) % dist.get_world_size())
    return loss
