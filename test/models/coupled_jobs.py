"""Steps whose own collectives couple the DP ranks' batches, for ``vemesh check`` (test_check.py).

- ``step_clip``: a contrastive loss over the negatives of every DP rank, gathered with autograd (open_clip's and
  SigLIP's shape): right under DP's average, and one process's on the DP ranks' batches together.
- ``step_tokens``: a loss divided by the tokens of every DP rank (a padding mask, so each rank counts others), as
  torchtitan's and Megatron's per-token losses do; under DP's average every gradient is 1 / DP of one process's.
  ``step_tokens_scaled`` multiplies it by DP, which makes it right.
- ``step_length``: a sequence length drawn per rank (no rows to cut by DP rank), with an all-reduce for the log.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vemesh import VESCALE_DEVICE_MESH
from vemesh.ddp import DistributedDataParallel

VOCAB = 50


class Clip(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 8))
        self.text = nn.Sequential(nn.Embedding(VOCAB, 32), nn.Flatten(), nn.Linear(32 * 4, 8))
        self.scale = nn.Parameter(torch.tensor(2.0))

    def forward(self, images: torch.Tensor, texts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return nn.functional.normalize(self.image(images), dim=-1), nn.functional.normalize(self.text(texts), dim=-1)


def make_clip() -> nn.Module:
    return Clip()


def make_lm() -> nn.Module:
    return nn.Sequential(nn.Embedding(VOCAB, 16), nn.Linear(16, VOCAB))


def parallelize_clip(model: Clip, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    parallelize_module(model.image, mesh["TP"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return DistributedDataParallel(model, mesh["DP"])


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    return DistributedDataParallel(model, mesh["DP"])


def _gathered(t: torch.Tensor, group) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """Every DP rank's rows, with autograd (the gradients of the others' go back to them). Not with
    ``torch.distributed.nn.functional.all_gather``, open_clip's: on a group that is not the world (DP beside TP) its
    backward raises in torch 2.13 ("Global rank 0 is not part of group": its scatter takes the group's rank for a
    global one)."""
    return funcol.all_gather_single_autograd(t, gather_dim=0, group=group)


def step_clip(model: nn.Module, batch_size: int) -> torch.Tensor:
    images, texts = torch.randn(batch_size, 16), torch.randint(0, VOCAB, (batch_size, 4))
    a, b = model(images, texts)
    group = VESCALE_DEVICE_MESH["DP"].get_group()
    scale = (model.module if hasattr(model, "module") else model).scale
    rows = torch.arange(batch_size) + dist.get_rank(group) * batch_size
    loss = (nn.functional.cross_entropy(scale * a @ _gathered(b, group).T, rows)
            + nn.functional.cross_entropy(scale * b @ _gathered(a, group).T, rows)) / 2
    loss.backward()
    return loss


def _token_loss(model: nn.Module, batch_size: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch_size, 8))
    labels = ids.masked_fill(torch.rand(batch_size, 8) < 0.4, -100)
    total = nn.functional.cross_entropy(model(ids).flatten(0, 1), labels.flatten(), reduction="sum")
    tokens = (labels != -100).sum().float()
    dist.all_reduce(tokens, group=VESCALE_DEVICE_MESH["DP"].get_group())
    return total / tokens


def step_tokens(model: nn.Module, batch_size: int) -> torch.Tensor:
    loss = _token_loss(model, batch_size)
    loss.backward()
    return loss


def step_tokens_scaled(model: nn.Module, batch_size: int) -> torch.Tensor:
    loss = _token_loss(model, batch_size) * VESCALE_DEVICE_MESH["DP"].size()
    loss.backward()
    return loss


def step_length(model: nn.Module, batch_size: int) -> torch.Tensor:
    length = int(torch.randint(4, 9, ()))
    loss = model(torch.randint(0, VOCAB, (batch_size, length))).logsumexp(-1).mean()
    dist.all_reduce(loss.detach().clone(), group=VESCALE_DEVICE_MESH["DP"].get_group())
    loss.backward()
    return loss
