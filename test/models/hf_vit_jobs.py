"""HF transformers' ``ViTForImageClassification`` as shipped, with the TP plan a user writes for it (q, k, v and the
MLP's first Linear column-wise, the attention's output and the MLP's second row-wise), for ``vemesh check``. Its key
projection has a bias, whose gradient is zero in exact arithmetic (softmax ignores a constant per query): with DP and
no data-parallel wrapper, every other gradient differs from one process's."""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vemesh.ddp import DistributedDataParallel

CLASSES, SIDE = 10, 32


def make() -> nn.Module:
    """2 layers of width 64, 4 heads, patches of 8 x 8 on images of 32 x 32, no dropout."""
    return hf.ViTForImageClassification(hf.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=SIDE,
        patch_size=8, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def step(model: nn.Module, micro_batch_size: int) -> None:
    images = torch.randn(micro_batch_size, 3, SIDE, SIDE)
    labels = torch.randint(0, CLASSES, (micro_batch_size,))
    nn.functional.cross_entropy(model(pixel_values=images).logits, labels).backward()


def parallelize_tp(model: nn.Module, mesh) -> nn.Module:
    """The TP plan on each layer, and no data-parallel wrapper."""
    plan = {"attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(), "attention.o_proj": RowwiseParallel(),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
    for layer in model.vit.layers:
        parallelize_module(layer, mesh["TP"], plan)
    return model


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:
    """The same plan under vemesh DDP (exact)."""
    return DistributedDataParallel(parallelize_tp(model, mesh))
