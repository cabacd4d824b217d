"""A step whose ranks all-reduce different sizes (a data-dependent shape): gloo aborts a rank, which leaves no result
and no error behind; ``vemesh check`` must say so, not trip on the missing file. And a rank that aborts in the first
parallel run only (``make_marked``, ``step_abort_once``: what gloo's abort on a lost connection, or the kernel's kill,
does to a rank on a loaded machine), which the check runs again."""

import os

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


class Marked(nn.Linear):
    """``nn.Linear(4, 4)`` that knows the file which says the first parallel run was made."""

    def __init__(self, marker: str) -> None:
        super().__init__(4, 4)
        self.marker = marker


def make_marked(marker: str) -> nn.Module:
    return Marked(marker)


def step_abort_once(model: nn.Module, micro_batch_size: int) -> None:
    if dist.is_initialized() and dist.get_world_size() > 1:
        if dist.get_rank() == 1 and not os.path.exists(model.marker):
            open(model.marker, "w").close()
            os.abort()  # no result, no error: SIGABRT, as gloo's abort ends a rank
        dist.all_reduce(torch.ones(4))  # rank 0: gloo's transport error, its connection to rank 1 lost
    model(torch.ones(micro_batch_size, 4)).sum().backward()
