"""HF transformers' GPT-NeoX, as the library ships it, for ``vemesh check``: its fused ``query_key_value`` is
head-major (``[q_h k_h v_h]`` for each head, read with ``view(..., -1, 3 * head_size)``), so torch's
``ColwiseParallel`` shards it exactly, by whole heads, and the fused recipes would not. ``colwise`` is the plan as
for unfused Linears (exact); ``no_dense`` leaves out the RowwiseParallel of the attention's output projection
(wrong: ``dense`` gets this rank's heads), which the fused recipes do not clear."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import GPTNeoXConfig, GPTNeoXForCausalLM

VOCAB = 128


def make() -> nn.Module:
    cfg = GPTNeoXConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, attn_implementation="sdpa",
                        hidden_dropout=0.0, attention_dropout=0.0)
    return GPTNeoXForCausalLM(cfg)


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, 16))
    model(input_ids=ids, labels=ids).loss.backward()


def _plan(model: nn.Module, mesh: object, attention: dict) -> nn.Module:
    for layer in model.gpt_neox.layers:  # type: ignore[union-attr]
        parallelize_module(layer, mesh["TP"], {"attention.query_key_value": ColwiseParallel(),  # type: ignore[index]
                                               **attention, "mlp.dense_h_to_4h": ColwiseParallel(),
                                               "mlp.dense_4h_to_h": RowwiseParallel()})
    return model


def colwise(model: nn.Module, mesh: object) -> nn.Module:
    return _plan(model, mesh, {"attention.dense": RowwiseParallel()})


def no_dense(model: nn.Module, mesh: object) -> nn.Module:
    return _plan(model, mesh, {})
