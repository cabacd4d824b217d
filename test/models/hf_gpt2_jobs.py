"""HF transformers' GPT-2 for ``vemesh check``: its projections are transformers' ``Conv1D`` (a Linear whose weight is
stored ``[in, out]``), which torch's styles refuse, so ``make_linear`` builds it with an ``nn.Linear`` in place of each
(the weight transposed), as the check's hint says. Its ``c_attn`` is then a fused ``[q|k|v]`` that its attention
splits by global sizes (``split(split_size, dim=2)``); ``naive`` is torch's styles as on unfused Linears. ``sharded``
is what the check's hints then say: ``FusedColwiseParallel(3)`` on ``c_attn``, and the attention's head count and the
width it splits by (``num_heads``, ``split_size``) set to this rank's (exact)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from transformers import GPT2Config, GPT2LMHeadModel

from vemesh import VESCALE_DEVICE_MESH
from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import FusedColwiseParallel, context_parallel

VOCAB = 128


def _make() -> nn.Module:
    return GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def _linear(conv: nn.Module) -> nn.Linear:
    """An ``nn.Linear`` computing what ``conv`` (transformers' ``Conv1D``: ``x @ weight + bias``) does."""
    lin = nn.Linear(*conv.weight.shape)
    with torch.no_grad():
        lin.weight.copy_(conv.weight.T)
        lin.bias.copy_(conv.bias)
    return lin


def make_linear() -> nn.Module:
    model = _make()
    for block in model.transformer.h:  # type: ignore[union-attr]
        for parent, name in ((block.attn, "c_attn"), (block.attn, "c_proj"), (block.mlp, "c_fc"),
                             (block.mlp, "c_proj")):
            setattr(parent, name, _linear(getattr(parent, name)))
    return model


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, 16))
    model(input_ids=ids, labels=ids).loss.backward()


def naive(model: nn.Module, mesh: object) -> nn.Module:
    for block in model.transformer.h:  # type: ignore[union-attr]
        parallelize_module(block, mesh["TP"], {"attn.c_attn": ColwiseParallel(),  # type: ignore[index]
                                               "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(),
                                               "mlp.c_proj": RowwiseParallel()})
    return model


def sharded(model: nn.Module, mesh: object) -> nn.Module:
    tp = mesh["TP"].size()  # type: ignore[index]
    for block in model.transformer.h:  # type: ignore[union-attr]
        parallelize_module(block, mesh["TP"], {"attn.c_attn": FusedColwiseParallel(3),  # type: ignore[index]
                                               "attn.c_proj": RowwiseParallel(), "mlp.c_fc": ColwiseParallel(),
                                               "mlp.c_proj": RowwiseParallel()})
        for name in ("num_heads", "split_size"):  # the whole model's: this rank's are 1/tp of them
            setattr(block.attn, name, getattr(block.attn, name) // tp)
    return model


def ddp(model: nn.Module, mesh: object) -> nn.Module:
    return DistributedDataParallel(model)


def _step_cp(model: nn.Module, micro_batch_size: int, positions: bool) -> None:
    tokens = torch.randint(0, VOCAB, (micro_batch_size, 17))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    p = torch.arange(16).expand(micro_batch_size, 16).contiguous()
    buffers = [x, y, p] if positions else [x, y]
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        logits = model(input_ids=x, position_ids=p if positions else None).logits
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()


def step_cp_without_positions(model: nn.Module, micro_batch_size: int) -> None:
    """CP with the tokens cut and GPT-2 left to number the positions of its learned ``wpe`` itself, from 0 on each
    rank."""
    _step_cp(model, micro_batch_size, positions=False)


def step_cp(model: nn.Module, micro_batch_size: int) -> None:
    """CP with ``position_ids`` cut with the tokens and given to the model."""
    _step_cp(model, micro_batch_size, positions=True)
