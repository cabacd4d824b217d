"""DTensor sharding for torch's CPU attention kernel, so that a TP model calling SDPA on DTensors runs on CPU too.

``F.scaled_dot_product_attention`` on DTensors shards over the heads on CUDA: torch has DTensor strategies for its
flash and memory-efficient kernels. Its CPU kernel, ``aten._scaled_dot_product_flash_attention_for_cpu``, has none in
torch 2.13, so a model whose TP plan keeps the attention's inputs DTensors (pytorch/examples' Llama2 with
``ColwiseParallel(use_local_output=False)``, whose forward views them with the global head count) raises
``NotImplementedError`` on gloo, and so does its plan.

:func:`shard_cpu_attention` registers, through torch's own ``register_sharding``, the rule torch gives the CUDA
kernels: everything replicated, or sharded on the batch (dim 0), or on the heads (dim 1): query, key, value, the
output and its logsumexp alike, and in the backward the gradients as their inputs. Each head's attention is
computed whole on one rank, so the values are the one-process ones. It registers nothing for an op that torch
already has a strategy for. ``vemesh.parallel`` calls it on import.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["shard_cpu_attention"]

_aten = torch.ops.aten
FORWARD = _aten._scaled_dot_product_flash_attention_for_cpu.default
BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _no_mask(attn_mask: object) -> None:
    if attn_mask is not None:
        raise NotImplementedError("vemesh's DTensor sharding of torch's CPU attention takes no attn_mask: pass "
                                  "is_causal=True, or call the attention on local tensors")


def _forward(query, key, value, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):  # type: ignore[no-untyped-def]
    """``(output, logsumexp)`` from ``(query, key, value)``, each ``[batch, heads, seq, head_dim]``."""
    _no_mask(attn_mask)
    return [([p, p], [p, p, p, None, None]) for p in (Replicate(), Shard(0), Shard(1))]


def _backward(grad_out, query, key, value, out, logsumexp, dropout_p, is_causal, *, attn_mask=None,  # type: ignore[no-untyped-def]
              scale=None):
    """``(grad_query, grad_key, grad_value)`` placed as their inputs."""
    _no_mask(attn_mask)
    return [([p] * 3, [p] * 6 + [None, None]) for p in (Replicate(), Shard(0), Shard(1))]


def _has_strategy(op: torch._ops.OpOverload) -> bool:
    propagator = DTensor._op_dispatcher.sharding_propagator
    return op in getattr(propagator, "op_strategy_funcs", {}) or op in getattr(propagator, "op_to_rules", {})


def shard_cpu_attention() -> list[str]:
    """Register the CPU attention kernel's sharding where torch has none; the ops it registered, by name."""
    from torch.distributed.tensor.experimental import register_sharding

    done = []
    for op, rule in ((FORWARD, _forward), (BACKWARD, _backward)):
        if not _has_strategy(op):
            register_sharding(op)(rule)
            done.append(str(op))
    return done
