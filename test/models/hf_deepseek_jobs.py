"""HF transformers' DeepSeek-V3 (multi-head latent attention, shared and routed experts), as the library ships it, for
``vemesh check``: TP as a user writes it for MLA, by its module names.

MLA's ``kv_a_proj_with_mqa`` (left replicated) returns ``[compressed_kv | k_pe]``: ``compressed_kv`` enters
``kv_b_proj`` (ColwiseParallel), ``k_pe`` is the rotary key that every head shares, expanded to this rank's heads
directly. ``naive`` is torch's styles on the split Linears alone: each TP rank's backward gives ``k_pe`` its own heads'
share of the gradient, every parameter before it trains on that, and every output still matches one process.
``naive_ddp`` wraps that in vemesh DDP, whose check of the replicas over TP stops the backward; ``fixed`` adds
``vemesh.parallel.SumGradOverTP`` on ``k_pe``'s features (exact)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import SumGradOverTP

VOCAB = 128


def make() -> nn.Module:
    """3 layers of width 64 (the first dense, then MoE with 4 routed experts and a shared one), 4 heads, MLA with
    low-rank q (32) and kv (32), rotary and plain key parts of 8, values of 8."""
    return DeepseekV3ForCausalLM(DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        first_k_dense_replace=1, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, max_position_embeddings=32, attn_implementation="sdpa"))


def step(model: nn.Module, micro_batch_size: int) -> None:
    tokens = torch.randint(0, VOCAB, (micro_batch_size, 17))
    logits = model(input_ids=tokens[:, :-1]).logits
    F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()


def naive(model: nn.Module, mesh: object) -> nn.Module:
    """The attention's split Linears and each dense MLP (the first layer's, the shared experts') over TP."""
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], {  # type: ignore[index]
            "self_attn.q_b_proj": ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel()})
        mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
        parallelize_module(mlp, mesh["TP"], {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),  # type: ignore[index]
                                             "down_proj": RowwiseParallel()})
    return model


def naive_ddp(model: nn.Module, mesh: object) -> nn.Module:
    """:func:`naive` in vemesh DDP over the mesh's data dims."""
    return DistributedDataParallel(naive(model, mesh))


def fixed(model: nn.Module, mesh: object) -> nn.Module:
    """:func:`naive`, and k_pe's gradient summed over TP."""
    model = naive(model, mesh)
    for layer in model.model.layers:
        parallelize_module(layer.self_attn.kv_a_proj_with_mqa, mesh["TP"],  # type: ignore[index]
                           SumGradOverTP(start=model.config.kv_lora_rank))
    return model


def rows_only(model: nn.Module, mesh: object) -> nn.Module:
    """A plan written from a Llama one: ``o_proj`` by rows and each dense MLP, but MLA has no ``q_proj``, ``k_proj``
    or ``v_proj`` for its column styles, so ``q_b_proj`` and ``kv_b_proj`` stay whole and ``o_proj`` is handed every
    head's output."""
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], {"self_attn.o_proj": RowwiseParallel()})  # type: ignore[index]
        mlp = layer.mlp.shared_experts if hasattr(layer.mlp, "shared_experts") else layer.mlp
        styles = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}
        parallelize_module(mlp, mesh["TP"], styles)  # type: ignore[index]
    return model
