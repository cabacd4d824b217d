"""A mesh with PP planned by tracing: every PP rank of the pipeline through torch's schedule.

:func:`predict_pipeline` is :func:`~vemesh.planning.user_model.predict_user` for a mesh with PP: the user's
parallelize function returns each PP rank's ``PipelineStage``\ s, the step gets torch's schedule for the job's
``--pp-schedule`` (:mod:`vemesh.planning.pipeline_trace` runs it on the fake world), and each PP rank is a rank class.
"""

from __future__ import annotations

from typing import Any

from vemesh.parallel.schedules import MULTI_STAGE, stage_indices
from vemesh.planning.estimate import RankMemory
from vemesh.planning.pipeline_trace import MetaExchange, MissingMeta
from vemesh.planning.results import Counted, MeshFit, RankClass
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.user_model import trace_arguments, trace_user

__all__ = ["predict_pipeline", "trace_pipeline"]


def predict_pipeline(fns: UserFunctions, **job: Any) -> MeshFit:
    """Each PP rank traced through torch's schedule (:func:`trace_pipeline`). Under a one-stage schedule (GPipe,
    1F1B) many micro-batches are traced as ``m mod PP + 2 PP`` and ``+ 3 PP`` and the rest added by difference, a
    pipeline's worth at a time, as blocks are: those schedules are in their steady state by then (checked against
    the whole trace). The multi-stage schedules run every micro-batch: they wait on their sends only at the end of
    the step, so what they hold grows with the micro-batches at a rate that changes along the way."""
    kwargs = trace_arguments(**job)
    degrees, pp, m = kwargs["degrees"], kwargs["degrees"]["PP"], kwargs["passes"]
    if fns.loss is None:
        raise ValueError("with PP the planner runs torch's pipeline schedule, which computes the loss on the last "
                         "stage: give --loss MODULE:FUNCTION (loss_fn(output, target), as the schedule takes it)")
    short = m % pp + 2 * pp
    notes = [f"pipeline: torch's {fns.pp_schedule} schedule over {pp} PP ranks, {m} micro-batches of "
             f"{kwargs['micro_batch_size']}; every PP rank traced"]
    if m >= short + 2 * pp and fns.pp_schedule not in MULTI_STAGE:
        two, three = (trace_pipeline(fns, dict(kwargs, passes=k)) for k in (short, short + pp))
        counted = {r: three[r].scaled(two[r], (m - short - pp) // pp) for r in range(pp)}
        notes.append(f"micro-batches: {short} and {short + pp} traced, the other {m - short - pp} added by "
                     f"difference, {pp} at a time")
    else:
        counted = trace_pipeline(fns, kwargs)
    classes = []
    for rank in range(pp):
        c = counted[rank]
        static = RankMemory(f"PP rank {rank}", c.held["params"], c.held["grads"], c.held["optimizer"], 0)
        classes.append(RankClass(f"PP rank {rank}", static, c.held["activations"], 0, c.sent, c.flops,
                                 c.memory_bytes, c.optimizer_bytes, c.ops, c.dtensor_ops, c.by_op))
    return MeshFit(dict(degrees), classes, m, kwargs["micro_batch_size"], notes=tuple(notes),
                   dp_mode=counted[0].dp_mode, pp_schedule=fns.pp_schedule)


def trace_pipeline(fns: UserFunctions, kwargs: dict[str, Any]) -> dict[int, Counted]:
    """Every PP rank traced (:func:`trace_user` with ``pp_rank``), in the order the stages' shapes allow: a rank whose
    stage waits for another's activations is traced again after that one."""
    pp = kwargs["degrees"]["PP"]
    exchange = MetaExchange()
    counted: dict[int, Counted] = {}
    pending = list(range(pp))
    while pending:
        waiting, known = [], len(exchange.forward)
        for rank in pending:
            try:
                counted[rank] = trace_user(fns, pp_rank=rank, exchange=exchange, **kwargs)
            except MissingMeta:
                waiting.append(rank)
        if len(waiting) == len(pending) and len(exchange.forward) == known:  # no stage got further
            raise ValueError(f"--parallelize {fns.names[1]}: the stages of PP ranks {waiting} wait for each other's "
                             "activations; each stage must take the previous stage's outputs")
        pending = waiting[::-1]  # the next round from the other end: a V sends back towards PP rank 0
    for stage in exchange.wrongly_derived():  # a stage's gradient shapes guessed wrongly: trace its rank again
        rank = next(r for r in range(pp) if stage in stage_indices(r, pp, fns.pp_schedule))
        counted[rank] = trace_user(fns, pp_rank=rank, exchange=exchange, **kwargs)
    return counted
