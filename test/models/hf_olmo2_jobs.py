"""HF transformers' ``Olmo2ForCausalLM`` as shipped, with the TP plan a user first writes for it, for ``vemesh check``:
its ``q_norm`` and ``k_norm`` are RMSNorms over the whole projected width, applied before the heads' view, so under
torch's ``ColwiseParallel`` q and k projections they get this TP rank's part and raise. HF's own plan for it gathers
q, k and v (docs/checking.md: a norm over the whole projected width)."""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from vemesh.parallel import parallelize_module

VOCAB, SEQ = 128, 16


def make() -> nn.Module:
    """2 layers of width 64, 4 heads of 16, SDPA (the EOS id in the vocabulary, as HF's config check asks)."""
    return hf.Olmo2ForCausalLM(hf.Olmo2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=4, max_position_embeddings=64, eos_token_id=VOCAB - 1, pad_token_id=0,
        attn_implementation="sdpa"))


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()


def parallelize_llama_like(model: nn.Module, mesh) -> nn.Module:
    """Llama's plan: q, k and v column-wise, their outputs this rank's heads; wrong for OLMo 2's width norms."""
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    return model
