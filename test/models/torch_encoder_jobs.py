"""torch's own ``nn.TransformerEncoder`` (``batch_first``, post-norm, no dropout) under a first TP plan and under CP,
for ``vemesh check``. Its layers' ``nn.MultiheadAttention`` reads ``out_proj``'s weight itself (it hands it to
``F.multi_head_attention_forward``; ``out_proj``'s own forward never runs), so a TP style on ``out_proj`` only makes
the weight a DTensor, which the attention's plain tensors meet. Its MLP's Linears split as torch's styles split them
are exact, and so is CP over its attention, which is not causal."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vemesh import VESCALE_DEVICE_MESH
from vemesh.parallel import context_parallel

VOCAB, SEQ, WIDTH = 64, 16, 32


class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, WIDTH), nn.Embedding(SEQ, WIDTH)
        layer = nn.TransformerEncoderLayer(WIDTH, 4, 2 * WIDTH, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(WIDTH, VOCAB)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.tok(ids) + self.pos(positions)))


def make() -> nn.Module:
    return Encoder()


def _loss(model: nn.Module, ids: torch.Tensor, target: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    loss = F.cross_entropy(model(ids, positions).reshape(-1, VOCAB), target.reshape(-1))
    loss.backward()
    return loss.detach()


def step(model: nn.Module, batch_size: int) -> torch.Tensor:
    ids, target = torch.randint(0, VOCAB, (2, batch_size, SEQ))
    return _loss(model, ids, target, torch.arange(SEQ).expand(batch_size, SEQ))


def step_cp(model: nn.Module, batch_size: int) -> torch.Tensor:
    """The tokens, targets and positions cut by ``context_parallel``."""
    ids, target = torch.randint(0, VOCAB, (2, batch_size, SEQ))
    positions = torch.arange(SEQ).expand(batch_size, SEQ).contiguous()
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[ids, target, positions], buffer_seq_dims=[1, 1, 1]):
        return _loss(model, ids, target, positions)


def parallelize_out_proj(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """A first plan: the MLP split, and the attention's output projection row-wise as in any decoder."""
    for layer in model.enc.layers:
        parallelize_module(layer, mesh["TP"], {"linear1": ColwiseParallel(), "linear2": RowwiseParallel(),
                                               "self_attn.out_proj": RowwiseParallel()})
    return model


def parallelize_mlp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """The MLP split alone."""
    for layer in model.enc.layers:
        parallelize_module(layer, mesh["TP"], {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()})
    return model


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """vemesh DDP alone: over CP, it averages the CP ranks' gradients."""
    from vemesh.ddp import DistributedDataParallel

    return DistributedDataParallel(model)
