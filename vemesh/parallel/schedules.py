"""torch's pipeline schedules by the names vemesh uses (``--pp-schedule``), and where each puts its stages.

One owner for what every pipeline user of vemesh asks of a schedule's name: its class in
``torch.distributed.pipelining``, how many stages a PP rank holds, which PP rank holds a stage (round-robin for the
looped schedules, folded back for the V-shaped ones), whether backward is split into input and weight passes, and
which consecutive layers each stage holds (:func:`split_layers`).
"""

from __future__ import annotations

import contextlib
import functools
from types import SimpleNamespace
from typing import Any

__all__ = ["MULTI_STAGE", "SCHEDULES", "V_SHAPED", "ZERO_BUBBLE", "actions", "in_flight", "run_schedule",
           "schedule_class", "split_layers", "stage_indices", "stage_owner", "stages_per_rank"]

#: The ``torch.distributed.pipelining`` schedule class of each ``--pp-schedule`` name. That package is
#: imported when a pipeline is built (it adds about a second to every process's start-up otherwise).
SCHEDULES = {
    "gpipe": "ScheduleGPipe",
    "1f1b": "Schedule1F1B",
    "interleaved-1f1b": "ScheduleInterleaved1F1B",
    "interleaved-zb": "ScheduleInterleavedZeroBubble",
    "zbv": "ScheduleZBVZeroBubble",
    "dualpipev": "ScheduleDualPipeV",
}
#: Schedules that run two stages per PP rank, and those of them that place stages in a V.
MULTI_STAGE = ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
#: Schedules that split backward into an input pass and a later weight pass. torch adds the weight
#: gradients by hand (``weight.grad += dw`` after ``torch.autograd.grad``), so no gradient hook sees
#: them: a DDP wrapper must average once, after the whole schedule, not at the end of each backward.
ZERO_BUBBLE = ("interleaved-zb", "zbv", "dualpipev")


def stages_per_rank(schedule: str) -> int:
    """Virtual stages per PP rank: 2 for the interleaved and V-shaped schedules, else 1."""
    return 2 if schedule in MULTI_STAGE else 1


def stage_owner(stage: int, pp_size: int, schedule: str) -> int:
    """The PP rank that holds ``stage``: round-robin, or folded back for a V (stage 3 of 4 on PP rank 0)."""
    if schedule in V_SHAPED:
        return stage if stage < pp_size else 2 * pp_size - 1 - stage
    return stage % pp_size


def split_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """Consecutive blocks per stage, as even as possible (earlier stages take the remainder).

    >>> split_layers(5, 2)
    [[0, 1, 2], [3, 4]]
    """
    if n_stages > n_layer:
        raise ValueError(f"{n_stages} pipeline stages cannot split {n_layer} layers (each stage needs at least one)")
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def stage_indices(pp_rank: int, pp_size: int, schedule: str) -> list[int]:
    """The stages PP rank ``pp_rank`` holds: rank 1 of 2 holds [1, 3] looped, [1, 2] in a V, [1] with one each."""
    n_stages = pp_size * stages_per_rank(schedule)
    return [s for s in range(n_stages) if stage_owner(s, pp_size, schedule) == pp_rank]


def schedule_class(name: str) -> Any:
    """torch's schedule class for ``name`` (a key of :data:`SCHEDULES`); a ValueError names the valid ones."""
    if name not in SCHEDULES:
        raise ValueError(f"pipeline schedule {name!r}: choose one of {', '.join(SCHEDULES)}")
    from torch.distributed import pipelining  # here: the package adds about a second to a process's start-up

    return getattr(pipelining, SCHEDULES[name])


def run_schedule(schedule: Any, name: str, chunks: list[Any], *args: Any, **kwargs: Any) -> Any:
    """``schedule.step(*args, **kwargs)`` for stages whose modules (``chunks``) are vemesh DDP.

    Under a zero-bubble schedule (:data:`ZERO_BUBBLE`) torch adds the weight gradients by hand, where no gradient
    hook sees them, so DDP's averaging is held back through every pass (``no_sync``) and run once after the whole
    schedule (``finish_grad_sync(force=True)``). Other schedules, and chunks that are not DDP, step as they are.
    """
    late = [c for c in chunks if hasattr(c, "finish_grad_sync")] if name in ZERO_BUBBLE else []
    with contextlib.ExitStack() as local:
        for chunk in late:
            local.enter_context(chunk.no_sync())
        out = schedule.step(*args, **kwargs)
    for chunk in late:
        chunk.finish_grad_sync(force=True)
    return out


@functools.lru_cache(maxsize=256)
def actions(name: str, pp: int, n_microbatches: int) -> dict[int, tuple[Any, ...]]:
    """torch's own action list of schedule ``name`` for ``pp`` ranks: ``{rank: (action or None, ...)}`` in time order,
    each action ``_Action(stage_index, computation_type, microbatch_index)`` (F, B, I, W, ...). Read from the class
    built over placeholder stages (the list depends only on the ranks, stages and micro-batches)."""
    cls = schedule_class(name)
    n_stages = pp * stages_per_rank(name)

    def stage(index: int) -> Any:  # what a schedule reads of its stages while it lays out the actions
        return SimpleNamespace(num_stages=n_stages, stage_index=index, group_size=pp, group_rank=0, submod=None,
                               has_backward=True, is_first=index == 0, is_last=index == n_stages - 1)

    mine = [stage(s) for s in stage_indices(0, pp, name)]
    order = cls(mine if name in MULTI_STAGE else mine[0], n_microbatches).pipeline_order
    if name in MULTI_STAGE:
        return {rank: tuple(order[rank]) for rank in range(pp)}
    # A one-stage schedule runs the micro-batches in order, the k-th forward (or backward) of a rank on micro-batch k;
    # torch 2.13's list for them (drawn for display; its runtime does not read it) numbers PP rank > 0's forwards
    # from 1 (rank 1 of 1F1B: 1F1, 1B0, ..., 1F4 of 4 micro-batches), so its kinds are kept and renumbered.
    out = {}
    for rank in range(pp):
        seen: dict[Any, int] = {}
        steps = []
        for a in order[rank]:
            if a is not None and a.computation_type.value in ("F", "B"):
                k = seen.get(a.computation_type, 0)
                seen[a.computation_type] = k + 1
                a = a._replace(microbatch_index=k)
            steps.append(a)
        out[rank] = tuple(steps)
    return out


def in_flight(name: str, pp: int, n_microbatches: int) -> list[int]:
    """The most micro-batch chunks whose activations each PP rank holds at once in schedule ``name``: counted along
    torch's action list (a forward adds one; a full backward, or the weight pass of a split one, frees one)."""
    out = []
    for rank, steps in sorted(actions(name, pp, n_microbatches).items()):
        held = most = 0
        for action in steps:
            kind = getattr(action, "computation_type", None)
            kind = getattr(kind, "value", kind)
            if kind == "F":
                held += 1
                most = max(most, held)
            elif kind in ("B", "W"):
                held -= 1
        out.append(most)
    return out


def build_stages(model: Any, mesh: Any, schedule: str, cut: Any, wrap: Any) -> list[Any]:
    """This PP rank's stages of ``model`` under ``schedule``: each stage ``cut(model, stage, n_stages)`` (a copy that
    holds that stage's blocks), wrapped by ``wrap(part, mesh)`` and given to torch's ``PipelineStage`` on the group of
    ``mesh["PP"]`` (the presets' and the planner's way; a real run passes its own device)."""
    import torch
    from torch.distributed.pipelining import PipelineStage  # here: the package adds about a second to start-up

    pp = mesh.get_strategy_size("PP")
    n_stages = pp * stages_per_rank(schedule)
    mine = stage_indices(mesh.lookup_rank("PP"), pp, schedule)
    parts = [cut(model, s, n_stages) for s in mine]
    return [PipelineStage(wrap(part, mesh), s, n_stages, torch.device("cpu"), group=mesh["PP"].get_group())
            for part, s in zip(parts, mine)]

