"""Steps that accumulate gradients over micro-batches the way torch's wrappers are used, for ``vemesh check``
(test_check.py): ``no_sync()`` on every micro-batch but the last (vemesh's and torch's DDP), FSDP2's
``set_requires_gradient_sync``, a step that reads DDP's ``module``, and one whose last backward never syncs."""

from __future__ import annotations

import torch
from torch import nn

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
