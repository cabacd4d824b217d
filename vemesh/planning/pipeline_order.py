"""What torch's action list of a schedule says about each backward of a PP rank's stages, for
:mod:`vemesh.planning.pipeline_replay`: the action its stage runs just before it, whether an earlier backward of the
stage came first in the step, and whether the rank's gradients may change between a micro-batch's forward and its
backward (another of the rank's stages starting or ending its backwards in between); and whether the schedule takes
the micro-batches at all."""

from __future__ import annotations

from typing import Any

from vemesh.layout.names import divisors, listed
from vemesh.parallel.schedules import actions

__all__ = ["backward_contexts", "check_micro_batches", "gradients_may_change"]


def _compute(schedule: str, pp: int, pp_rank: int, n_microbatches: int) -> list[tuple[str, int, int]]:
    """``(kind, stage, micro-batch)`` of each forward and backward of PP rank ``pp_rank``, in torch's order."""
    out = []
    for action in actions(schedule, pp, n_microbatches)[pp_rank]:
        if action is None:
            continue
        kind = getattr(action.computation_type, "value", action.computation_type)
        if kind in ("F", "B"):
            out.append((kind, action.stage_index, action.microbatch_index))
    return out


def backward_contexts(schedule: str, pp: int, pp_rank: int, n_microbatches: int,
                      after_backward: bool = False) -> dict[tuple[int, int], Any]:
    """``{(stage, micro-batch): kind}``: the kind ("F", "B") of the action each stage of PP rank ``pp_rank`` runs
    just before its backward of each micro-batch, along torch's own action list of ``schedule``; with
    ``after_backward``, ``{(stage, micro-batch): bool}``: whether a backward of the same stage came before it."""
    out, last, backwards = {}, {}, set()
    for kind, stage, mb in _compute(schedule, pp, pp_rank, n_microbatches):
        if kind == "B" and after_backward:
            out[(stage, mb)] = stage in backwards
            backwards.add(stage)
        elif kind == "B" and stage in last:
            out[(stage, mb)] = last[stage]
        last[stage] = kind
    return out


def gradients_may_change(schedule: str, pp: int, pp_rank: int, n_microbatches: int) -> set[tuple[int, int]]:
    """The ``(stage, micro-batch)`` of PP rank ``pp_rank`` between whose forward and backward another stage of the
    rank runs its first backward of the step (which allocates its gradients, without gradient sync) or its last (which
    reduces them: FSDP2's sharded gradients appear): the bytes of gradients the rank holds at the backward's start are
    then not those at the forward's."""
    order = _compute(schedule, pp, pp_rank, n_microbatches)
    firsts, lasts = {}, {}
    for i, (kind, stage, _) in enumerate(order):
        if kind == "B":
            firsts.setdefault(stage, i)
            lasts[stage] = i
    at = {(kind, stage, mb): i for i, (kind, stage, mb) in enumerate(order)}
    out = set()
    for (kind, stage, mb), i in at.items():
        j = at.get(("B", stage, mb))
        if kind == "F" and j is not None and any(
                i < k < j for other in firsts if other != stage for k in (firsts[other], lasts[other])):
            out.add((stage, mb))
    return out


def check_micro_batches(schedule: str, pp: int, per_dp: int, mbs: int) -> None:
    """A ``ValueError`` naming the flags where torch's schedule refuses ``per_dp / mbs`` micro-batches over ``pp``
    ranks (1F1B needs at least as many as stages), before any stage is built: its own rule, from its action list.
    A traced pipeline asks it before any stage is built, so a search rejects such a mesh at no cost."""
    def refusal(n: int) -> str | None:
        try:
            actions(schedule, pp, n)
        except ValueError as e:
            return str(e)
        return None

    why = refusal(per_dp // mbs)
    if why is None:
        return
    ok = [d for d in divisors(per_dp) if refusal(per_dp // d) is None]
    fix = (f"choose --micro-batch-size from {listed(ok, 64)}" if ok else
           "give a --global-batch-size of more sequences per DP rank, or fewer PP ranks")
    n = per_dp // mbs
    raise ValueError(f"PP {pp} under {schedule}: {n} micro-batch{'es' * (n != 1)} of {mbs} per DP rank ({per_dp} "
                     f"sequence{'s' * (per_dp != 1)}), which torch's schedule refuses ({why.strip()}): {fix}")
