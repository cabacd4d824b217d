"""HF transformers' ``Qwen3ForCausalLM`` as shipped (tied embeddings), with the TP plan a user writes for it, for
``vemesh check``: ``q_norm`` and ``k_norm`` normalize each head's query and key, so under ``ColwiseParallel`` q and k
projections they run on this TP rank's heads only, and need torch's ``SequenceParallel`` on the heads' dim
(docs/checking.md: a norm over this rank's heads)."""

from __future__ import annotations

import torch
import transformers as hf
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import parallelize_module

VOCAB, SEQ = 128, 16


def make() -> nn.Module:
    """2 layers of width 64, 4 query and 2 KV heads of 16, the embedding tied to the head, SDPA."""
    return hf.Qwen3ForCausalLM(hf.Qwen3Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True,
        attn_implementation="sdpa"))


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, SEQ))
    model(input_ids=ids, labels=ids).loss.backward()


def step_cp(model: nn.Module, micro_batch_size: int) -> None:
    """:func:`step` with the tokens, labels and positions cut over ``mesh["CP"]`` by ``context_parallel``."""
    from vemesh import VESCALE_DEVICE_MESH
    from vemesh.parallel import context_parallel

    ids = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    positions = torch.arange(SEQ).expand(micro_batch_size, SEQ).contiguous()
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[x, y, positions], buffer_seq_dims=[1, 1, 1]):
        logits = model(input_ids=x, position_ids=positions).logits
        nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()


def _tp(model: nn.Module, mesh, norms: bool) -> nn.Module:
    """The vocabulary-parallel tied pair (kept one parameter by vemesh's parallelize_module), HF's Llama-like plan on
    each layer, and with ``norms`` SequenceParallel on the q and k norms over the heads' dim (2)."""
    tp = mesh["TP"]
    parallelize_module(model, tp, {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                                   "lm_head": ColwiseParallel(output_layouts=Replicate())})
    plan = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}
    if norms:
        plan |= {"self_attn.q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                 "self_attn.k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
    for layer in model.model.layers:
        parallelize_module(layer, tp, plan)
    return model


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:
    """The right plan, under vemesh DDP."""
    return DistributedDataParallel(_tp(model, mesh, norms=True))


def parallelize_ddp_without_norms(model: nn.Module, mesh) -> nn.Module:
    """The plan without the norms' SequenceParallel, under vemesh DDP (which refuses it at the first backward)."""
    return DistributedDataParallel(_tp(model, mesh, norms=False))


def parallelize_tp_without_norms(model: nn.Module, mesh) -> nn.Module:
    """The plan without the norms' SequenceParallel, and no data-parallel wrapper."""
    return _tp(model, mesh, norms=False)
