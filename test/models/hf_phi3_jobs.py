"""HF transformers' Phi-3, as the library ships it, for ``vemesh check``: a fused ``qkv_proj`` that its attention
slices by global sizes and then mixes with plain tensors (rotary embeddings), and a fused ``gate_up_proj`` that its
MLP reads with ``chunk(2, -1)``. ``naive`` is torch's styles as on unfused Linears (wrong); the check's hint names
the gathered recipe for it, tried and exact."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import Phi3Config, Phi3ForCausalLM

from vemesh.parallel import FusedColwiseParallel

VOCAB = 128


def make() -> nn.Module:
    cfg = Phi3Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64,
                     attn_implementation="sdpa", pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return Phi3ForCausalLM(cfg)


def make_gqa() -> nn.Module:
    """:func:`make` with 2 KV heads for its 4 query heads (Phi-3-medium's and Phi-4's GQA): its qkv_proj holds
    [q|k|v] of unequal parts."""
    model = make()
    cfg = model.config
    cfg.num_key_value_heads = 2
    return Phi3ForCausalLM(cfg)


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, 16))
    model(input_ids=ids, labels=ids).loss.backward()


def naive(model: nn.Module, mesh: object) -> nn.Module:
    for layer in model.model.layers:  # type: ignore[union-attr]
        parallelize_module(layer, mesh["TP"], {  # type: ignore[index]
            "self_attn.qkv_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_up_proj": FusedColwiseParallel(2), "mlp.down_proj": RowwiseParallel()})
    return model
