"""A head tied in the forward (``h @ self.wte.weight.T``, GPT-2's shape in many hand-written models), for
``vemesh check`` (test_check.py): a TP plan that shards the embedding makes that weight a DTensor, which the forward's
matmul meets with a plain tensor; with the head a module of its own tied to the embedding, both ends sharded by
``vemesh.parallel.parallelize_module``, it is exact."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import parallelize_module

VOCAB = 64


class TiedInForward(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, 32)
        self.up, self.down = nn.Linear(32, 128), nn.Linear(128, 32)

    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.wte(ids)
        return h + self.down(torch.relu(self.up(h)))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.hidden(ids) @ self.wte.weight.T


class TiedHead(TiedInForward):
    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(32, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.hidden(ids))


def make() -> nn.Module:
    return TiedInForward()


def make_head() -> nn.Module:
    return TiedHead()


def parallelize(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    plan = {"wte": RowwiseParallel(input_layouts=Replicate()), "up": ColwiseParallel(), "down": RowwiseParallel()}
    if hasattr(model, "lm_head"):
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    parallelize_module(model, mesh["TP"], plan)
    return DistributedDataParallel(model, mesh["DP"])


def step(model: nn.Module, batch_size: int) -> torch.Tensor:
    ids = torch.randint(0, VOCAB, (batch_size, 16))
    loss = nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    return loss
