"""Hugging Face models cut into pipeline stages by ``vemesh.parallel.DecoderStage``, each stage under a TP plan that
is wrong as a user writes it, for ``vemesh check``'s recipes under PP: each PP rank holds its own stage's layers, and
a recipe must reach every stage's (it reached the first stage's only, and on GPT-OSS it broke the stage's own check of
the cut). The models and their plans are those of ``hf_qwen3_jobs`` (q/k norms left replicated) and
``hf_head_count_jobs`` (GPT-OSS's sinks left whole), with their heads untied (a tied head cannot be cut)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import hf_head_count_jobs
import hf_qwen3_jobs
from vemesh.parallel import DecoderStage

VOCAB, SEQ = 128, 16
ATTENTION = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
             "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel()}


def _untied(model: nn.Module) -> nn.Module:
    model.lm_head.weight = nn.Parameter(model.lm_head.weight.detach().clone())
    model.config.tie_word_embeddings = False
    return model


def make_qwen3() -> nn.Module:
    return _untied(hf_qwen3_jobs.make())


def make_gpt_oss() -> nn.Module:
    return _untied(hf_head_count_jobs.make_gpt_oss())



def _stages(model: nn.Module, mesh, plan: dict, ddp: bool = False) -> list:
    """This PP rank's stage (1F1B: one), ``plan`` on each of its layers over TP, in vemesh DDP with ``ddp``, given to
    torch's PipelineStage."""
    from torch.distributed.pipelining import PipelineStage

    from vemesh.ddp import DistributedDataParallel

    pp, rank = mesh.get_strategy_size("PP"), mesh.lookup_rank("PP")
    part = DecoderStage(model, rank, pp)
    for layer in part.model.layers:
        parallelize_module(layer, mesh["TP"], plan)
    return [PipelineStage(DistributedDataParallel(part) if ddp else part, rank, pp, torch.device("cpu"),
                          group=mesh["PP"].get_group())]


def qwen3_without_norms(model: nn.Module, mesh, ddp: bool = False) -> list:
    return _stages(model, mesh, ATTENTION | {"mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
                                             "mlp.down_proj": RowwiseParallel()}, ddp)


def gpt_oss_naive(model: nn.Module, mesh) -> list:
    return _stages(model, mesh, ATTENTION)


def step_pp(schedule, batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    schedule.step(ids[:, :-1].contiguous(), target=ids[:, 1:].contiguous(), losses=[])


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), target.flatten())


def qwen3_without_norms_ddp(model: nn.Module, mesh) -> list:
    """:func:`qwen3_without_norms` with the stage in vemesh DDP (whose check of the replicas over TP raises first)."""
    return qwen3_without_norms(model, mesh, ddp=True)
