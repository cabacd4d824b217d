"""A user's own model, and the three functions ``vemesh plan`` runs for it (docs/planning.md, "Your own model").

``make()`` builds the model, ``parallelize(model, mesh)`` shards it as the training script does (TP with torch's
``parallelize_module`` when the mesh has TP, then FSDP2), and ``step(model, micro_batch_size)`` runs one forward
and backward of a micro-batch. Plan it from this folder:

    vemesh plan --model module:mymodel:make --parallelize mymodel:parallelize --step mymodel:step --world-size 8 --tp 2

and check that the plan computes what one process does (one step, module by module):

    vemesh check --model module:mymodel:make --parallelize mymodel:parallelize --step mymodel:step --world-size 4 --tp 2
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vemesh.parallel import FusedColwiseParallel, fully_shard

VOCAB, DIM, HEADS, LAYERS, SEQ = 1024, 256, 8, 6, 256


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(B, T, 3, -1, DIM // HEADS).unbind(2)  # heads local under TP
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def make() -> Model:
    return Model()


def parallelize(model: Model, mesh) -> nn.Module:
    """TP inside each block when the mesh has TP (qkv and up column-wise, proj and down row-wise), then FSDP2.

    ``qkv`` is one Linear whose rows are ``[q | k | v]``: ``FusedColwiseParallel(3)`` gives each TP rank its own heads'
    q, k and v (``[q_r | k_r | v_r]``), which the forward's ``view(B, T, 3, -1, head_dim)`` reads as local heads.
    torch's ``ColwiseParallel`` would give TP rank 0 all of q and half of k at TP 2: another model, which trains.
    ``vemesh check`` compares this plan with one process (docs/checking.md).
    """
    if mesh.get_strategy_size("TP") > 1:
        plan = {"qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(), "up": ColwiseParallel(),
                "down": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["TP"], plan)
    for block in model.blocks:
        fully_shard(block)
    return fully_shard(model)


def step(model: nn.Module, micro_batch_size: int) -> None:
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(tokens[:, :-1])
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
