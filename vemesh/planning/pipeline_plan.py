"""A mesh with PP planned by tracing: every PP rank of the pipeline through torch's schedule.

:func:`predict_pipeline` is :func:`~vemesh.planning.user_model.predict_user` for a mesh with PP: the user's
parallelize function returns the ``PipelineStage`` objects of each PP rank, the step gets torch's schedule for the job's
``--pp-schedule`` (:mod:`vemesh.planning.pipeline_trace` runs it on the fake world), and each PP rank is a rank class.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from vemesh.parallel.schedules import MULTI_STAGE, stage_indices, stages_per_rank
from vemesh.planning.estimate import RankMemory
from vemesh.planning.pipeline_trace import MetaExchange, MissingMeta
from vemesh.planning.results import Counted, MeshFit, RankClass
from vemesh.planning.step_parts import BY_DIFFERENCE_FROM, LOW_HIGH, BlocksNotFound, collapse_actions
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.user_model import blocks_of, trace_arguments, trace_user, user_notes

__all__ = ["predict_pipeline", "trace_pipeline"]


def predict_pipeline(fns: UserFunctions, **job: Any) -> MeshFit:
    """Each PP rank traced through torch's schedule (:func:`trace_pipeline`), and two shortcuts, each checked against
    the whole trace:

    * a model of ``n`` identical blocks (:func:`~vemesh.planning.user_model.repeated_blocks`), 8 a stage or more
      (:data:`~vemesh.planning.step_parts.BY_DIFFERENCE_FROM`; fewer cost less traced whole), ``n`` a multiple of
      the stages ``S`` (or with ``r`` more, held by the first ``r`` stages), is traced with ``3 S`` and ``4 S`` of
      them (``+ r``) (3 and 4 per stage; with 2 the first stage's
      peak falls at another moment of the step than with many, and the difference misses it) and the rest added
      by difference, a block per stage at a time, each part of each stage's action on its own
      (:func:`~vemesh.planning.step_parts.pipeline_parts`, :meth:`Counted.scaled`); a stage whose blocks are not
      found (:func:`~vemesh.planning.step_parts.stage_blocks`) cannot be cut at them, and every block is traced;
    * under a one-stage schedule (GPipe, 1F1B) many micro-batches (more than the two traces run) are traced as
      ``m mod PP + 2 PP`` and ``+ 3 PP`` and the rest added by difference, a pipeline's worth at a time: those
      schedules are in their steady state by then. The multi-stage schedules run every micro-batch: they wait on their sends only at the end of the step,
      so what they hold grows with the micro-batches at a rate that changes along the way.
    """
    kwargs = trace_arguments(**job)
    degrees, pp, m = kwargs["degrees"], kwargs["degrees"]["PP"], kwargs["passes"]
    if fns.loss is None:
        raise ValueError("with PP the planner runs torch's pipeline schedule, which computes the loss on the last "
                         "stage: give --loss MODULE:FUNCTION (loss_fn(output, target), as the schedule takes it)")
    n_stages = pp * stages_per_rank(fns.pp_schedule)
    notes = [f"pipeline: torch's {fns.pp_schedule} schedule over {pp} PP ranks, {m} micro-batches of "
             f"{kwargs['micro_batch_size']}; every PP rank traced"]
    found = blocks_of(fns.factory, fns.names[0])
    counted = None
    if found is not None and found[1] >= BY_DIFFERENCE_FROM * n_stages:
        path, n = found
        extra = n % n_stages  # the first ``extra`` stages hold a block more (vemesh.models.gpt.stages.split_layers)
        try:
            low, high = (_micro_batches(fns, dict(kwargs, blocks=(path, k * n_stages + extra)), notes) for k in LOW_HIGH)
            counted = {r: high[r].scaled(low[r], n // n_stages - LOW_HIGH[1]) for r in range(pp)}
            notes.append(f"blocks: {path} holds {n} identical blocks, {n // n_stages}{'+1' if extra else ''} per stage; "
                         f"{LOW_HIGH[0]} and {LOW_HIGH[1]} per stage traced, the rest added by difference")
        except ValueError as e:  # a parallelize function that cuts its stages by the model's configured depth
            if not isinstance(e.__cause__, (IndexError, KeyError)):
                raise
            notes.append(f"blocks: {path} holds {n} identical blocks, but the stages did not cut fewer of them "
                         f"({type(e.__cause__).__name__}); all {n} traced")
        except BlocksNotFound as e:  # the difference of uncut actions is not exact by construction
            notes.append(f"blocks: {path} holds {n} identical blocks, but {e}, so its actions cannot be cut at them; "
                         f"all {n} traced")
    if counted is None:
        counted = _micro_batches(fns, kwargs, notes)
    notes += user_notes(counted[0], kwargs)
    classes = []
    for rank in range(pp):
        c = counted[rank]
        static = RankMemory(f"PP rank {rank}", c.held["params"], c.held["grads"], c.held["optimizer"], 0)
        classes.append(RankClass(f"PP rank {rank}", static, c.held["activations"], 0, c.sent, c.flops,
                                 c.memory_bytes, c.optimizer_bytes, c.ops, c.dtensor_ops, c.by_op, c.counts))
    return MeshFit(dict(degrees), classes, m, kwargs["micro_batch_size"], notes=tuple(dict.fromkeys(notes)),
                   dp_mode=counted[0].dp_mode, pp_schedule=fns.pp_schedule)


def _micro_batches(fns: UserFunctions, kwargs: dict[str, Any], notes: list[str]) -> dict[int, Counted]:
    """:func:`trace_pipeline` of every micro-batch, or of fewer and the rest by difference (see predict_pipeline)."""
    pp, m = kwargs["degrees"]["PP"], kwargs["passes"]
    short = m % pp + 2 * pp
    if short + (short + pp) >= m or fns.pp_schedule in MULTI_STAGE:  # the two traces would run as many micro-batches
        return trace_pipeline(fns, kwargs, notes)
    two, three = (trace_pipeline(fns, dict(kwargs, passes=k), notes) for k in (short, short + pp))
    notes.append(f"micro-batches: {short} and {short + pp} traced, the other {m - short - pp} added by difference, "
                 f"{pp} at a time")
    # each action's number dropped: the two traces run other counts of them (step_parts.collapse_actions)
    two, three = ({r: replace(c, phases=collapse_actions(c.phases)) for r, c in t.items()} for t in (two, three))
    return {r: three[r].scaled(two[r], (m - short - pp) // pp) for r in range(pp)}


#: whether a pipeline's traces replay micro-batches seen twice alike (:mod:`vemesh.planning.pipeline_replay`)
REPLAY = True


def trace_pipeline(fns: UserFunctions, kwargs: dict[str, Any], notes: list[str] | None = None) -> dict[int, Counted]:
    """Every PP rank traced (:func:`trace_user` with ``pp_rank``), in the order the stages' shapes allow: a rank whose
    stage waits for another's activations is traced again after that one. With :data:`REPLAY` a stage's micro-batches
    seen twice alike are replayed (:mod:`vemesh.planning.pipeline_replay`); a rank whose replay meets a backward it
    has no record of is traced again without."""
    pp = kwargs["degrees"]["PP"]
    exchange = MetaExchange(replay=REPLAY)
    counted: dict[int, Counted] = {}
    pending = list(range(pp))
    while pending:
        waiting, known = [], len(exchange.forward)
        for rank in pending:
            try:
                counted[rank] = _trace_rank(fns, rank, exchange, kwargs)
            except MissingMeta:
                waiting.append(rank)
        if len(waiting) == len(pending) and len(exchange.forward) == known:  # no stage got further
            raise ValueError(f"--parallelize {fns.names[1]}: the stages of PP ranks {waiting} wait for each other's "
                             "activations; each stage must take the previous stage's outputs")
        pending = waiting[::-1]  # the next round from the other end: a V sends back towards PP rank 0
    for stage in exchange.wrongly_derived():  # a stage's gradient shapes guessed wrongly: trace its rank again
        rank = next(r for r in range(pp) if stage in stage_indices(r, pp, fns.pp_schedule))
        counted[rank] = _trace_rank(fns, rank, exchange, kwargs)
    replayed = sum(r.replayed for r in exchange.replays)
    if notes is not None and replayed:
        notes.append(f"micro-batches: {replayed} of {replayed + sum(r.traced for r in exchange.replays)} stage "
                     "forwards and backwards replayed from two traced alike (vemesh.planning.pipeline_replay)")
    return counted


def _trace_rank(fns: UserFunctions, rank: int, exchange: MetaExchange, kwargs: dict[str, Any]) -> Counted:
    """PP rank ``rank`` traced; again without replay when a replayed forward's backward had no record."""
    try:
        return trace_user(fns, pp_rank=rank, exchange=exchange, **kwargs)
    except ValueError:
        if not (exchange.replays and exchange.replays[-1].missed):
            raise
    replay, exchange.replay = exchange.replay, False
    try:
        return trace_user(fns, pp_rank=rank, exchange=exchange, **kwargs)
    finally:
        exchange.replay = replay
