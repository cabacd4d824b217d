"""What a plan of the user's functions (or a preset's) assumed, said with its figures: the notes under its tables."""

from __future__ import annotations

from typing import Any

from vemesh.planning.results import Counted

__all__ = ["fsdp_reduces_whole", "user_notes"]

#: what a plan says of the dp mode it read from the parallelize function's wrappers (no --dp-mode)
_READ_MODES = {
    "none": "dp mode none: the parallelize function wrapped no data parallelism (the mesh has none), and the "
            "optimizer is torch's AdamW over what it returned",
    "ddp": "dp mode ddp: the parallelize function wrapped torch's DistributedDataParallel, and the optimizer is "
           "torch's AdamW over its parameters (--dp-mode zero1 needs vemesh DDP)",
    "zero1": "dp mode zero1: the parallelize function wrapped vemesh DDP, and the optimizer is ZeRO-1's "
             "DistributedOptimizer over it (--dp-mode ddp for torch's AdamW, unsplit)",
    "fsdp": "dp mode fsdp: the parallelize function applied FSDP2 (fully_shard; or torch's replicate_with_fsdp, its "
            "engine with each parameter whole); the optimizer is torch's AdamW over its parameters",
}


#: the mesh dims whose reduce-scatters are not the data-parallel gradients' (TP's under sequence parallelism)
_NOT_DATA = ("TP", "PP", "EP")


def fsdp_reduces_whole(by_op: dict[str, dict[str, Any]]) -> bool:
    """Whether FSDP2's engine averaged the gradients whole, all-reduced and never reduce-scattered over a data-parallel
    dim (``by_op``: a trace's collectives by mesh dim and op): torch's ``replicate`` of ``replicate_with_fsdp``, each
    parameter whole on every DP rank, where ``fully_shard`` reduce-scatters them into shards."""
    data = [op for dim, ops in by_op.items() if dim not in _NOT_DATA for op in ops]
    return any(op.startswith(("allreduce", "all_reduce")) for op in data) and not any("reduce_scatter" in op
                                                                                      for op in data)


def user_notes(counted: Counted, kwargs: dict[str, Any], sync_each: bool = False) -> list[str]:
    """What a plan of the user's functions assumed, said with its figures: the MoE routing, ZeRO-1's masters, the dp
    mode read from the wrappers, FSDP2's gradient accumulation. ``kwargs`` are the trace's
    (:func:`vemesh.planning.user_model.trace_arguments`); ``sync_each``: the functions' loop averages the gradients
    on every micro-batch (:attr:`vemesh.planning.user_code.UserFunctions.sync_each`)."""
    leak = counted.unwaited_note(at_least=kwargs["degrees"].get("PP", 1) > 1)
    notes = [leak] if leak is not None else []  # a leak first: the figures are of one step
    if counted.moe:
        notes.append(f"MoE routing: each expert gets an equal share of the slots, and the busiest EP rank receives "
                     f"{kwargs['load_factor']:g} x the balanced share (--moe-load-factor; 1 is balanced, a run's "
                     "measured expert_load is its own factor)")
    if counted.dp_mode == "zero1" and kwargs["dtype"] == "bf16":
        notes.append("the optimizer column includes ZeRO-1's fp32 master weights")
    if kwargs["dp_mode"] is None:  # read from the wrappers (_data_parallel): none, zero1 or fsdp
        notes.append(_READ_MODES[counted.dp_mode])
    if counted.dp_mode == "fsdp" and kwargs["passes"] > 1 and kwargs["degrees"].get("PP", 1) == 1:
        whole = fsdp_reduces_whole(counted.by_op)
        notes.append(f"gradient accumulation: each of the {kwargs['passes']} micro-batches' backward "
                     f"{'all-reduces' if whole else 'reduce-scatters'} its gradients (--gradient-sync each)"
                     if sync_each else
                     f"gradient accumulation: FSDP2's gradient sync off but on the last of the {kwargs['passes']} "
                     "micro-batches (set_requires_gradient_sync(False), as no_sync; --gradient-sync last), so every "
                     + ("gradient is held whole and unreduced until it; a loop that syncs each (torchtitan's) "
                        "all-reduces them every micro-batch: plan it with --gradient-sync each" if whole else
                        "unsharded gradient is held until it; a loop that syncs each (torchtitan's) holds the sharded "
                        "ones alone: plan it with --gradient-sync each"))
    return notes + [n for n in (counted.buffers_note(), counted.compiled_note(), counted.skipped_note(),
                                   counted.branches_note(), counted.cache_note(),
                                   counted.torch_ddp_note(), counted.split_graph_note()) if n is not None]
