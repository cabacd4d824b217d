"""What a data-parallel wrapper's collectives move per step over a model planned without its step: a module factory
given alone (``--model module:MODULE:FACTORY`` without ``--step``), whose forward is never traced.

vemesh DDP all-reduces fp32 gradients in buckets; ZeRO-1 then gathers the updated shards; FSDP2 gathers each unit in
forward and again in backward and reduce-scatters its fp32 gradients once. With a step, these are counted on the
traced step instead (:mod:`vemesh.planning.user_model`).
"""

from __future__ import annotations

from typing import Any

from vemesh.parallel.ddp.bucketing import DEFAULT_BUCKET_SIZE, plan_buckets
from vemesh.planning.estimate import Model, fsdp_local, local_numel, rank_shards

__all__ = ["Ops", "dp_traffic", "nbytes"]

#: Collectives of a step as a trace counts them: ``{op: (bytes, calls)}``.
Ops = dict[str, tuple[int, int]]


def dp_traffic(model: Model, keys: set[str], job: Any, dp: int, tp: int, passes: int,
                ep: int = 1) -> tuple[tuple[Ops, Ops], int]:
    """((the gradient dim's collectives per step, EDP's), FSDP2's unsharded bytes in use) of a rank holding ``keys``;
    each collective op as ``{op: (bytes, calls)}``, the op named as torch's c10d names it (what a trace counts).

    With EP the experts' gradients average over EDP (the ranks holding the same experts), the rest over DP. vemesh
    DDP all-reduces fp32 gradients in buckets of at least 6,553,600 elements (a parameter never split); ZeRO-1 then
    gathers the updated shards, one all-gather of the buffer; FSDP2
    gathers each unit (each block, and the root) in forward and the blocks again in backward, every micro-batch, and
    reduce-scatters each unit's fp32 gradients once.
    """
    width = 2 if job.dtype == "bf16" else 4
    mine = rank_shards(model, keys, ep)
    if job.mode != "fsdp":
        def per_step(params: list[Any], over: int) -> Ops:
            n = sum(local_numel(p.shape, p.tp_dim, tp) for p in params)
            if over <= 1 or not n:
                return {}
            # vemesh DDP's buckets (bucketing.plan_buckets): filled in reverse registration order, each closed once
            # it holds DEFAULT_BUCKET_SIZE elements, never splitting a parameter (70B's were 164 by n / size, not 90)
            sizes = [local_numel(p.shape, p.tp_dim, tp) for p in reversed(params)]
            buckets = len(plan_buckets(sizes, DEFAULT_BUCKET_SIZE).buckets)
            ops = {"allreduce_": (4 * n, buckets)}
            if job.mode == "zero1":
                ops["_allgather_base_"] = (width * -(-n // over) * over, 1)  # ZeRO-1 gathers each buffer at once
            return ops
        dense = [p for p in mine if p.expert is None or ep == 1]
        expert = [p for p in mine if p.expert is not None and ep > 1]
        return (per_step(dense, dp), per_step(expert, dp // ep)), 0
    units: dict[str, int] = {}  # FSDP2 unit (each block, and the root) -> elements of its padded full TP shards
    for p in mine:
        unit = p.stage_key if p.stage_key.startswith("block:") else "root"
        units[unit] = units.get(unit, 0) + fsdp_local([p], dp, tp) * dp
    blocks = [v for k, v in units.items() if k != "root"]
    root = units.get("root", 0)
    gathered = width * (root + 2 * sum(blocks))  # forward: every unit; backward: the blocks again (the root stays)
    reduced = 4 * (root + sum(blocks))
    biggest = max(blocks, default=0)
    extra = width * (root + 2 * biggest)  # the root stays gathered; a block and the next one (prefetch)
    if dp <= 1:
        return ({}, {}), 0
    ops = {"_allgather_base_": (gathered * passes, ((root > 0) + 2 * len(blocks)) * passes),
           "_reduce_scatter_base_": (reduced, len(units))}
    return (ops, {}), extra


def nbytes(ops: Ops) -> int:
    """The bytes of ``{op: (bytes, calls)}``."""
    return sum(b for b, _ in ops.values())
