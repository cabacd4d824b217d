"""The search's estimate of a GPT-preset mesh with PP, and the wrappers' data-parallel collectives by rule.

A search does not trace every PP rank of every PP mesh through torch's schedule (the 70B search over 1024 ranks has
meshes of 64 stages and 512 micro-batches): :func:`estimate_pipeline` traces one micro-batch per stage
(:func:`vemesh.planning.activations.trace_stage`) and counts the rest along torch's own action list of the schedule,
with the data-parallel wrapper's work on each micro-batch traced apart (:mod:`vemesh.planning.wrapper_costs`).
:func:`dp_traffic` gives what vemesh DDP, ZeRO-1 and FSDP2 send per step, by collective op, for a rank holding some
of the model's parameters (the static plans use it too). ``job`` is a :class:`vemesh.planning.fit.Job`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vemesh.layout.parallel_dims import ParallelDims
from vemesh.parallel.schedules import split_layers
from vemesh.parallel.ddp.bucketing import DEFAULT_BUCKET_SIZE, plan_buckets
from vemesh.parallel.schedules import in_flight, stage_indices, stages_per_rank
from vemesh.planning.activations import Trace, add_ops, trace_stage
from vemesh.planning.estimate import Model, fsdp_local, local_numel, rank_shards, rank_static, stage_keys
from vemesh.planning.pipeline_order import check_micro_batches
from vemesh.planning.results import MeshFit, RankClass
from vemesh.planning.user_model import batch_split
from vemesh.planning.wrapper_costs import wrapper_costs

__all__ = ["ADAMW_BYTES_PER_STATE_BYTE", "Ops", "by_group", "dp_traffic", "estimate_pipeline", "nbytes",
           "optimizer_bytes"]

#: Collectives of a step as a trace counts them: ``{op: (bytes, calls)}``.
Ops = dict[str, tuple[int, int]]


def estimate_pipeline(job: Any, model: Model, *, dp: int, tp: int, pp: int, cp: int, ep: int) -> MeshFit:
    """A GPT-preset mesh with PP in a search, estimated rather than traced: each stage's weights, gradients and
    optimizer state from :func:`rank_static`; one micro-batch through the stage traced on fake tensors
    (:func:`vemesh.planning.activations.trace_stage`) times the chunks in flight, counted along torch's own action
    list (:func:`vemesh.parallel.schedules.in_flight`); a receive buffer per micro-batch and direction; the DP and
    PP bytes from the wrappers' rules; the wrapper's work on each micro-batch, and what FSDP2 holds unsharded through
    the step, per parameter element (:func:`vemesh.planning.wrapper_costs.wrapper_costs`). Why not traced: tracing every PP rank of every PP mesh is the schedule's
    every micro-batch through every block (the 70B search over 1024 ranks has meshes of 64 stages and 512
    micro-batches); docs/planning.md gives the figures."""
    cfg = dict(model.config)
    if cfg["n_head"] % tp:
        raise ValueError(f"TP {tp} does not divide the {cfg['n_head']} heads")
    if cfg["block_size"] % cp or (job.sequence_parallel and (cfg["block_size"] // cp) % tp):
        raise ValueError(f"CP {cp}{' x TP ' + str(tp) if job.sequence_parallel else ''} does not divide seq_len "
                         f"{cfg['block_size']}")
    per_dp, mbs = batch_split(job.global_batch_size, dp, job.micro_batch_size, pp)
    check_micro_batches(job.pp_schedule, pp, per_dp, mbs)
    passes = per_dp // mbs
    grad_dim = ParallelDims(pp * dp * cp * tp, pp=pp, dp_shard=dp, cp=cp, tp=tp).grad_dim or "DP"  # the one rule
    width = 2 if job.dtype == "bf16" else 4
    n_stages = pp * stages_per_rank(job.pp_schedule)
    layers = split_layers(model.n_layer, n_stages)
    keys = stage_keys(model, n_stages)
    flights = in_flight(job.pp_schedule, pp, passes)
    classes = []
    for rank in range(pp):
        stages = stage_indices(rank, pp, job.pp_schedule)
        mine = set().union(*(keys[s] for s in stages))
        name = f"PP rank {rank}"
        static = rank_static(model, mine, name, dp=dp * cp, tp=tp, ep=ep, dtype=job.dtype, dp_mode=job.mode)
        traces = [trace_stage(model.config, blocks=len(layers[s]),
                              role="first" if s == 0 else "last" if s == n_stages - 1 else "middle", micro_batch=mbs,
                              tp=tp, cp=cp, sequence_parallel=job.sequence_parallel and tp > 1, dtype=job.dtype,
                              checkpointing=job.activation_checkpointing, ep=ep, load_factor=job.moe_load_factor,
                              timed=job.timed)
                  for s in stages]
        retained = sum(t.retained for t in traces) / len(traces)
        activations = int((flights[rank] - 1) * retained) + max(t.peak for t in traces)
        hidden = mbs * (cfg["block_size"] // cp) // (tp if job.sequence_parallel else 1) * cfg["n_embd"] * width
        transfers = sum((s < n_stages - 1) + (s > 0) for s in stages)
        # every micro-batch through each stage; each one's activations sent forward and its input gradient back
        ops: dict[str, Ops] = {"PP": {"send": (hidden * passes * transfers, passes * transfers)}}
        for t in traces:
            ops = add_ops(ops, t.by_op, passes)
        dp_ops, extra = dp_traffic(model, mine, job, dp * cp, tp, passes, ep)
        if job.mode == "fsdp" and dp * cp > 1:
            # torch's stages run FSDP2 without gradient sync or reshard after backward, and clear the gradients as a
            # step starts: through the step it holds every unit's parameters unsharded and their gradients unsharded
            # in fp32, and the sharded gradients are made at its end, past the peak (wrapper_costs.WrapperCosts.held)
            elements = _elements(model, mine, tp, ep)[0]
            whole, shard = wrapper_costs(job.mode, job.dtype).held
            extra, static = round(elements * whole + elements / (dp * cp) * shard), replace(static, grads=0)
        extra += hidden * passes * transfers  # torch's stages keep a receive buffer per micro-batch and direction
        for dim, by_op in (("EDP", dp_ops[1]), (grad_dim, dp_ops[0])):
            if by_op:
                ops = add_ops(ops, {dim: by_op}, 1)
        ops = by_group(ops, pp, dp, cp, tp, ep)
        timing = {}
        if job.timed:  # what the step's compute and the optimizer's bytes come to (step_time times them)
            optimizer = optimizer_bytes(static, job.mode)
            wrapper = _wrapper(model, mine, job, tp, dp * cp, ep, passes)
            timing = dict(flops=passes * sum(t.flops for t in traces), optimizer_bytes=optimizer,
                          memory_bytes=passes * sum(t.memory_bytes for t in traces) + optimizer + wrapper[0],
                          ops=passes * sum(t.ops for t in traces) + wrapper[1],
                          dtensor_ops=passes * sum(t.dtensor_ops for t in traces),
                          collectives=ops,
                          counts=_rated(traces, passes))
        classes.append(RankClass(name, static, activations, extra, {d: nbytes(o) for d, o in ops.items()}, **timing))
    notes = (f"pipeline estimated, not traced (a search): one micro-batch per stage traced, times the chunks in "
             f"flight along torch's {job.pp_schedule} action list, without the example's end of a step (its "
             f"clipping and the loss's all-reduces); plan this mesh with --pp {pp} to trace the schedule",)
    return MeshFit({"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep}, classes, passes, mbs, notes=notes,
                   dp_mode=job.mode, pp_schedule=job.pp_schedule)


def _wrapper(model: Model, keys: set[str], job: Any, tp: int, dp: int, ep: int, passes: int) -> tuple[int, int]:
    """(memory-bound bytes, ops) that the data-parallel wrapper adds to a PP rank's step over its stage traces: vemesh
    DDP's and ZeRO-1's fold into ``main_grad`` and refresh of ``.grad``, FSDP2's gathers and unsharded gradients,
    autograd's accumulation, the reduction and the example's clipping
    (:func:`vemesh.planning.wrapper_costs.wrapper_costs`)."""
    if dp <= 1 and job.mode == "fsdp":
        return 0, 0
    return wrapper_costs(job.mode, job.dtype).step(passes, *_elements(model, keys, tp, ep), dp)


def _elements(model: Model, keys: set[str], tp: int, ep: int) -> tuple[int, int]:
    """(parameter elements as TP leaves them, parameter tensors) of a rank holding ``keys``."""
    mine = rank_shards(model, keys, ep)
    return sum(local_numel(p.shape, p.tp_dim, tp) for p in mine), len(mine)


def by_group(ops: dict[str, Ops], pp: int, dp: int, cp: int, tp: int, ep: int) -> dict[str, Ops]:
    """Collectives per dim, a dim whose group is the whole world named as the first such dim (mesh dims first).

    torch gives a group of every rank the default group, so a run counts it under the first name that has it.
    """
    sizes = {"PP": pp, "DP": dp, "CP": cp, "TP": tp, "dp_cp": dp * cp, "EDP": dp * cp // ep, "EP": ep}
    world = pp * dp * cp * tp
    first = next((d for d, n in sizes.items() if n == world), None)
    out: dict[str, Ops] = {}
    for dim, by_op in ops.items():
        key = first if first is not None and sizes.get(dim) == world else dim
        out = add_ops(out, {key: by_op}, 1)
    return dict(sorted(out.items()))


#: The bytes AdamW's update reads and writes per byte of its state (its two fp32 moments): 84 per element, as a
#: traced plan counts it under vemesh DDP (10.5 per byte there; 11.5 under FSDP2, whose shards add copies).
ADAMW_BYTES_PER_STATE_BYTE = 10.5


def optimizer_bytes(static: Any, mode: str) -> int:
    """The bytes a PP rank's ``optimizer.step()`` moves, estimated: AdamW's update over its state
    (:data:`ADAMW_BYTES_PER_STATE_BYTE`), and under ZeRO-1 each gradient copied into the shard and each parameter
    gathered back (a traced plan's figure is 0.91 to 1.0 of this on the PP meshes of ``test_step_time.py``)."""
    copies = static.params + static.grads if mode == "zero1" else 0
    return round(ADAMW_BYTES_PER_STATE_BYTE * static.optimizer + copies)


def _rated(traces: list[Trace], passes: int) -> dict[str, int]:
    """The counts a profile times at their own rates (the transcendental ops' bytes, attention's FLOPs, each in all
    and by op or shape) over ``passes`` of the stage traces; compile's and Float8's are the traced plan's alone."""
    keys = {k for t in traces for k in t.counts if "@" in k or k in ("transcendental_bytes", "attention_flops")}
    return {k: passes * sum(t.counts.get(k, 0) for t in traces) for k in sorted(keys)}


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
