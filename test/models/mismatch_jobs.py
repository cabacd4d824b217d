"""A step whose ranks all-reduce different sizes (a data-dependent shape): gloo aborts a rank, which leaves no result
and no error behind; ``vemesh check`` must say so, not trip on the missing file."""

import torch
import torch.distributed as dist
from torch import nn


def make() -> nn.Module:
    return nn.Linear(4, 4)


def parallelize(model: nn.Module, mesh: object) -> nn.Module:
    return model


def step(model: nn.Module, micro_batch_size: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(torch.ones(8 if dist.get_rank() == 1 else 4))
    model(torch.ones(micro_batch_size, 4)).sum().backward()
