"""HF transformers' ``ViTForImageClassification`` as shipped, with the TP plan a user writes for it (q, k, v and the
MLP's first Linear column-wise, the attention's output and the MLP's second row-wise), for ``vemesh check``. Its key
projection has a bias, whose gradient is zero in exact arithmetic (softmax ignores a constant per query): with DP and
no data-parallel wrapper, every other gradient differs from one process's. With sequence parallelism (torchtitan's
layout on each layer), what a plan must add for a model whose input no Linear or Embedding makes: the patches cut
into each TP rank's part before the first layer, and gathered back before the last norm (the class token is read
from the whole sequence); and a sequence that TP divides (``make`` has 9 patches and the class token). Under FSDP2
over DP (``parallelize_fsdp``), two first plans' mistakes: the attention's output projection left out
(``fsdp_without_o_proj``), and the MLP's second Linear split by columns (``fsdp_fc2_by_columns``); and FSDP2 on the
layers alone (``fsdp_blocks_only``), and a step that divides its loss by the world size
(``step_over_world_size``)."""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from vemesh.ddp import DistributedDataParallel

CLASSES, SIDE = 10, 24


def make(side: int = SIDE) -> nn.Module:
    """2 layers of width 64, 4 heads, patches of 8 x 8 on images of 24 x 24 (a sequence of 10), no dropout."""
    return hf.ViTForImageClassification(hf.ViTConfig(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128, image_size=side,
        patch_size=8, num_labels=CLASSES, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))


def make_uneven() -> nn.Module:
    """:func:`make` on images of 32 x 32: 16 patches and the class token, a sequence TP 2 does not divide."""
    return make(32)


def step(model: nn.Module, micro_batch_size: int) -> None:
    side = model.config.image_size
    images = torch.randn(micro_batch_size, 3, side, side)
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


def _sequence_parallel(model: nn.Module, mesh, cut: tuple | None, gather: bool) -> nn.Module:
    """torchtitan's sequence-parallel layout on each layer; ``cut``: the first layer's input layouts to cut the
    sequence with (None: not cut); ``gather``: the sequence gathered back before the last norm."""
    tp = mesh["TP"]
    if cut is not None:
        parallelize_module(model.vit.layers[0], tp, PrepareModuleInput(
            input_layouts=(Replicate(), None)[:len(cut)], desired_input_layouts=cut, use_local_output=True))
    if gather:
        parallelize_module(model.vit.layernorm, tp, PrepareModuleInput(
            input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True))
    for layer in model.vit.layers:
        parallelize_module(layer, tp, {
            "layernorm_before": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
            "attention.v_proj": ColwiseParallel(), "attention.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "layernorm_after": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel(output_layouts=Shard(1))})
    return model


def parallelize_sp(model: nn.Module, mesh) -> nn.Module:
    """Sequence parallelism, the sequence cut before the first layer (its input and its mask, None) and gathered
    before the last norm: exact where TP divides the sequence."""
    return _sequence_parallel(model, mesh, (Shard(1), None), gather=True)


def parallelize_sp_uncut(model: nn.Module, mesh) -> nn.Module:
    """The layout without the cut: the first norm's SequenceParallel reads the whole sequence as this rank's part."""
    return _sequence_parallel(model, mesh, None, gather=True)


def parallelize_sp_one_layout(model: nn.Module, mesh) -> nn.Module:
    """The cut given one layout, where the layer is called with two arguments (the hidden states and the mask)."""
    return _sequence_parallel(model, mesh, (Shard(1),), gather=True)


def _fsdp(model: nn.Module, mesh, plan: dict) -> nn.Module:
    """``plan`` on each layer over TP, then FSDP2 over DP on each layer and the model, as torchtitan orders them."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.vit.layers:
        parallelize_module(layer, mesh["TP"], plan)
    for layer in model.vit.layers:
        fully_shard(layer, mesh=mesh["DP"])
    return fully_shard(model, mesh=mesh["DP"])


PLAN = {"attention.q_proj": ColwiseParallel(), "attention.k_proj": ColwiseParallel(),
        "attention.v_proj": ColwiseParallel(), "attention.o_proj": RowwiseParallel(),
        "mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}


def parallelize_fsdp(model: nn.Module, mesh) -> nn.Module:
    """The plan of :func:`parallelize_tp` under FSDP2 (exact)."""
    return _fsdp(model, mesh, PLAN)


def fsdp_without_o_proj(model: nn.Module, mesh) -> nn.Module:
    """The plan with the attention's output projection left out: it is handed this TP rank's heads."""
    return _fsdp(model, mesh, {k: v for k, v in PLAN.items() if k != "attention.o_proj"})


def fsdp_fc2_by_columns(model: nn.Module, mesh) -> nn.Module:
    """The plan with the MLP's second Linear split by columns too, as a first plan that splits every Linear does."""
    return _fsdp(model, mesh, {**PLAN, "mlp.fc2": ColwiseParallel()})


def fsdp_blocks_only(model: nn.Module, mesh) -> nn.Module:
    """The plan under FSDP2 on each layer and not on the model: the embeddings, the last norm and the classifier are
    under no FSDP2 unit, so their gradients are never averaged over DP."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.vit.layers:
        parallelize_module(layer, mesh["TP"], PLAN)
        fully_shard(layer, mesh=mesh["DP"])
    return model


def step_over_world_size(model: nn.Module, micro_batch_size: int) -> None:
    """:func:`step` with the loss divided by the world size, where the data-parallel wrapper already averages."""
    import torch.distributed as dist

    side = model.config.image_size
    images = torch.randn(micro_batch_size, 3, side, side)
    labels = torch.randint(0, CLASSES, (micro_batch_size,))
    (nn.functional.cross_entropy(model(pixel_values=images).logits, labels) / dist.get_world_size()).backward()
