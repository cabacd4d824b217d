"""A model split into pipeline stages two ways: by torch's tracer frontend (``pipeline`` with a ``SplitPoint``, then
``build_stage``), and by hand into ``PipelineStage`` modules of the same layers (``parallelize_by_hand``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.pipelining import PipelineStage, SplitPoint, pipeline

VOCAB, SEQ = 128, 32


class Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.norm, self.fc1, self.fc2 = nn.LayerNorm(d), nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Net(nn.Module):
    def __init__(self, d: int = 64, n: int = 4) -> None:
        super().__init__()
        self.emb, self.layers, self.head = nn.Embedding(VOCAB, d), nn.ModuleList(Block(d) for _ in range(n)), nn.Linear(d, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.emb(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make() -> nn.Module:
    return Net()


def parallelize(model: nn.Module, mesh) -> list:
    """torch's tracer frontend: the model traced with one micro-batch and split where this PP rank's layers begin."""
    pp, rank = mesh.get_strategy_size("PP"), mesh.lookup_rank("PP")
    example = torch.randint(0, VOCAB, (1, SEQ))
    pipe = pipeline(model, mb_args=(example,), split_spec={f"layers.{len(model.layers) // pp}": SplitPoint.BEGINNING})
    return [pipe.build_stage(rank, torch.device("cpu"), group=mesh["PP"].get_group())]


class HandStage(nn.Module):
    """The same stage cut by hand: the embedding on the first, this stage's layers, the head on the last."""

    def __init__(self, model: Net, stage: int, n: int) -> None:
        super().__init__()
        per = len(model.layers) // n
        self.emb = model.emb if stage == 0 else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in range(stage * per, (stage + 1) * per)})
        self.head = model.head if stage == n - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.emb is not None:
            x = self.emb(x)
        for layer in self.layers.values():
            x = layer(x)
        return self.head(x) if self.head is not None else x


def parallelize_by_hand(model: nn.Module, mesh) -> list:
    pp, rank = mesh.get_strategy_size("PP"), mesh.lookup_rank("PP")
    return [PipelineStage(HandStage(model, rank, pp), rank, pp, torch.device("cpu"), group=mesh["PP"].get_group())]


def step(schedule, batch_size: int) -> None:
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    schedule.step(tokens[:, :-1].contiguous(), target=tokens[:, 1:].contiguous(), losses=[], return_outputs=False)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
