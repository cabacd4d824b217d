"""Shared pieces for the checkpoint tests: the GPT example's model at a tiny size, built on any
(DP, TP) mesh with vemesh DDP and the ZeRO-1 optimizer (or plain AdamW), and one training step
whose loss is the mean over the global batch (so it is the same number on every mesh).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from vemesh.models.gpt import GPT, GPTConfig, apply_tp  # noqa: E402  (the GPT preset: its model imports no vemesh)

from vemesh import VESCALE_DEVICE_MESH  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.optim import DistributedOptimizer  # noqa: E402

VOCAB, SEQ, GLOBAL_BATCH = 64, 16, 8
BUCKET = 4096  # elements: several buckets, so ZeRO shards cut through parameters
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)


def tiny_config(n_embd: int = 32) -> GPTConfig:
    return GPTConfig(vocab_size=VOCAB, block_size=SEQ, n_layer=2, n_head=4, n_embd=n_embd, dropout=0.0)


def build(
    mesh_shape: tuple[int, int], *, zero: bool = True, seed: int = 0, n_embd: int = 32, dtype: torch.dtype = torch.float32
) -> tuple[DDP, Any]:
    """(Re-)initialize ``VESCALE_DEVICE_MESH`` on ``mesh_shape`` and build model + optimizer on it."""
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", mesh_shape, mesh_dim_names=("DP", "TP"))
    torch.manual_seed(seed)
    model = GPT(tiny_config(n_embd)).to(dtype)
    if VESCALE_DEVICE_MESH.get_strategy_size("TP") > 1:
        model = apply_tp(model, VESCALE_DEVICE_MESH["TP"])
    ddp = DDP(model, VESCALE_DEVICE_MESH["DP"], bucket_size=BUCKET)
    if zero:
        return ddp, DistributedOptimizer(torch.optim.AdamW, models=[ddp], clip_grad=1.0, **ADAMW)
    return ddp, torch.optim.AdamW(ddp.parameters(), **ADAMW)


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def train_step(ddp: DDP, optimizer: Any, step: int) -> float:
    """One step on this DP rank's slice of global batch ``step``; returns the global-batch loss."""
    dp, dp_rank = VESCALE_DEVICE_MESH.get_strategy_size("DP"), VESCALE_DEVICE_MESH.lookup_rank("DP")
    x, y = global_batch(step)
    rows = slice(dp_rank * GLOBAL_BATCH // dp, (dp_rank + 1) * GLOBAL_BATCH // dp)
    optimizer.zero_grad()
    loss = F.cross_entropy(ddp(x[rows]).float().reshape(-1, VOCAB), y[rows].reshape(-1))
    loss.backward()
    if not isinstance(optimizer, DistributedOptimizer):
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), 1.0)
    optimizer.step()
    value = loss.detach().clone()
    if dp > 1:
        dist.all_reduce(value, group=VESCALE_DEVICE_MESH.get_group("DP"))
    return value.item() / dp


def full_params(ddp: DDP) -> dict[str, torch.Tensor]:
    """Every parameter unsharded (all-gathers DTensors: every rank must call it)."""
    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().clone() for n, p in ddp.module.named_parameters()}
