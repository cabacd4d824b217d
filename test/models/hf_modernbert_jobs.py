"""HF transformers' ``ModernBertForMaskedLM`` as shipped, for ``vemesh check``: two fused projections a layer, the
attention's ``Wqkv`` (``[q|k|v]``, viewed as ``(B, T, 3, -1, head_dim)``) and the MLP's ``Wi`` (``[input|gate]``,
chunked in two). With ``intermediate_size`` 1.5 times the width, as ModernBERT-base's 1152 over 768, ``Wi`` has 3 C
rows over C inputs, the shape of a ``[q|k|v]``: the check reads the parts from the forward's own ``chunk(2)`` and
tries ``FusedColwiseParallel(2)`` (before, ``(3)``, and then ``(3, use_local_output=False)``, exact only by DTensor's
redistribution, with a hint of 3 parts of 64 rows)."""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import FusedColwiseParallel

VOCAB, SEQ = 128, 16


def make() -> nn.Module:
    """2 layers of width 64 (the second of global attention, the first of a window of 8), 4 heads, an MLP of 96."""
    return hf.ModernBertForMaskedLM(hf.ModernBertConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=64, global_attn_every_n_layers=2, local_attention=8, attn_implementation="sdpa",
        pad_token_id=0, eos_token_id=1, bos_token_id=2, cls_token_id=2, sep_token_id=1))


def step(model: nn.Module, batch_size: int) -> torch.Tensor:
    ids = torch.randint(3, VOCAB, (batch_size, SEQ))
    labels = ids.clone()
    labels[:, ::2] = -100
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss


def _parallelize(model: nn.Module, mesh, qkv, wi) -> nn.Module:  # type: ignore[no-untyped-def]
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], {"attn.Wqkv": qkv, "attn.Wo": RowwiseParallel(), "mlp.Wi": wi,
                                               "mlp.Wo": RowwiseParallel()})
    return DistributedDataParallel(model)


def parallelize(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """The first plan: torch's ColwiseParallel on both fused projections."""
    return _parallelize(model, mesh, ColwiseParallel(), ColwiseParallel())


def parallelize_fused(model: nn.Module, mesh) -> nn.Module:  # type: ignore[no-untyped-def]
    """What the check names: each fused projection split by its parts."""
    return _parallelize(model, mesh, FusedColwiseParallel(3), FusedColwiseParallel(2))
