"""A mesh with PP planned by tracing: every PP rank of the pipeline through torch's schedule.

:func:`predict_pipeline` is :func:`~vemesh.planning.user_model.predict_user` for a mesh with PP: the user's
parallelize function returns the ``PipelineStage`` objects of each PP rank, the step gets torch's schedule for the job's
``--pp-schedule`` (:mod:`vemesh.planning.pipeline_trace` runs it on the fake world), and each PP rank is a rank class.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from vemesh.parallel.schedules import MULTI_STAGE, stage_indices, stages_per_rank
from vemesh.planning.estimate import RankMemory
from vemesh.planning.pipeline_order import check_micro_batches
from vemesh.planning.pipeline_replay import REPLAYED_SCHEDULES
from vemesh.planning.pipeline_trace import MetaExchange, MissingMeta
from vemesh.planning.results import Counted, MeshFit, RankClass
from vemesh.planning.step_parts import BY_DIFFERENCE_FROM, LOW_HIGH, BlocksNotFound, collapse_actions, stage_slots
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.user_model import stage_signatures, trace_arguments, trace_user
from vemesh.planning.user_notes import user_notes
from vemesh.planning.user_template import blocks_of

__all__ = ["predict_pipeline", "shared_records", "trace_pipeline"]

#: each pipeline planned, and how long it took, at INFO (``vemesh plan`` prints them on stderr in a search)
_log = logging.getLogger(__name__)

#: inside :func:`shared_records`: the replays' records of every plan made there, by what a stage's action depends on
#: besides its own key (:func:`_context`)
_SHARED: dict[tuple, dict[tuple, list[Any]]] | None = None


@contextlib.contextmanager
def shared_records() -> Iterator[None]:
    """Inside, the pipelines planned share their replays' records across meshes (a search's PP meshes): a stage's
    action recorded on one mesh is replayed on another whose stage has the same role and parameters' local shapes,
    under the same TP, CP, EP, micro-batch, dtype and data-parallel wrapper (:func:`_context`)."""
    global _SHARED
    outer, _SHARED = _SHARED, {} if _SHARED is None else _SHARED
    try:
        yield
    finally:
        _SHARED = outer


def _context(fns: UserFunctions, kwargs: dict[str, Any]) -> tuple:
    """What a replay's record depends on besides its key (a stage's role, its parameters' local shapes, the action and
    the wrapper's state: :mod:`vemesh.planning.pipeline_replay`): the functions, the job, whether the plan cuts its
    actions at the blocks (a plan by difference names each action's parts, before, in and after its blocks
    (:func:`~vemesh.planning.step_parts.pipeline_parts`), and a replay plays the parts its record names), and the mesh
    but for its PP (a stage's index is not in its record) and, under DDP and ZeRO-1, the size of its DP: only whether
    it has one (their first forward broadcasts the buffers; their backward without gradient sync sends nothing, and the last
    micro-batch's, which syncs, is always traced). FSDP2's shards depend on it, and its DP stays."""
    degrees = dict(kwargs["degrees"], PP=None)
    if kwargs["dp_mode"] in ("ddp", "zero1"):  # not a user's own wrapping (dp_mode None), which may depend on DP
        degrees["DP"] = degrees["DP"] > 1
    cut = kwargs["blocks"][0] if kwargs.get("blocks") else None
    return (fns, cut, tuple(sorted(degrees.items())), kwargs["dp_replicate"], kwargs["micro_batch_size"],
            kwargs["dtype"], kwargs["dp_mode"], kwargs["load_factor"], kwargs["timed"], kwargs["device"],
            kwargs.get("optimizer_implementation"))


def _records(fns: UserFunctions, kwargs: dict[str, Any]) -> dict[tuple, list[Any]] | None:
    """The records this plan shares (inside :func:`shared_records`), else None (its own)."""
    if _SHARED is None:
        return None
    key = _context(fns, kwargs)
    try:
        return _SHARED.setdefault(key, {})
    except TypeError:  # a user's function that cannot be hashed: this plan's records are its own
        return None


def predict_pipeline(fns: UserFunctions, **job: Any) -> MeshFit:
    """Each PP rank traced through torch's schedule (:func:`trace_pipeline`), and two shortcuts, each checked against
    the whole trace:

    * a model of ``n`` identical blocks (:func:`~vemesh.planning.user_template.repeated_blocks`), 8 a stage or more
      (:data:`~vemesh.planning.step_parts.BY_DIFFERENCE_FROM`; fewer cost less traced whole), ``n`` a multiple of
      the stages ``S`` (or with ``r`` more, held by the first ``r`` stages), is traced with ``3 S`` and ``4 S`` of
      them (``+ r``) (3 and 4 per stage; with 2 the first stage's
      peak falls at another moment of the step than with many, and the difference misses it) and the rest added
      by difference, a block per stage at a time, each part of each stage's action on its own
      (:func:`~vemesh.planning.step_parts.pipeline_parts`, :meth:`Counted.scaled`); a stage whose blocks are not
      found (:func:`~vemesh.planning.step_parts.stage_blocks`) cannot be cut at them, and every block is traced;
    * under a one-stage schedule (GPipe, 1F1B) many micro-batches (more than :data:`WHOLE_UP_TO` times what the two
      traces run, with replays; without, more than they run) are traced as
      ``m mod PP + 2 PP`` and ``+ 3 PP`` and the rest added by difference, a pipeline's worth at a time: those
      schedules are in their steady state by then. The multi-stage schedules run every micro-batch: they wait on their sends only at the end of the step,
      so what they hold grows with the micro-batches at a rate that changes along the way;
    * under a one-stage schedule, of each run of 5 or more alike middle PP ranks (7 PP ranks or more:
      :data:`RANKS_BY_DIFFERENCE_FROM`) the first three and the last are traced and the rest added by difference
      (:func:`_rank_plan`).
    """
    kwargs = trace_arguments(**job)
    degrees, pp, m = kwargs["degrees"], kwargs["degrees"]["PP"], kwargs["passes"]
    check_micro_batches(fns.pp_schedule, pp, m * kwargs["micro_batch_size"], kwargs["micro_batch_size"])
    if fns.loss is None:
        raise ValueError("with PP the planner runs torch's pipeline schedule, which computes the loss on the last "
                         "stage: give --loss MODULE:FUNCTION (loss_fn(output, target), as the schedule takes it)")
    n_stages = pp * stages_per_rank(fns.pp_schedule)
    mesh = " x ".join(f"{d}={n}" for d, n in degrees.items() if n > 1)
    _log.info("tracing %s through torch's %s schedule, %d micro-batches", mesh, fns.pp_schedule, m)
    started = time.perf_counter()
    notes = [f"pipeline: torch's {fns.pp_schedule} schedule over {pp} PP ranks, {m} micro-batches of "
             f"{kwargs['micro_batch_size']}; every PP rank traced"]
    found = blocks_of(fns.factory, fns.names[0])
    counted = None
    if found is not None and found[1] >= BY_DIFFERENCE_FROM * n_stages:
        path, n = found
        extra = n % n_stages  # the first ``extra`` stages hold a block more (vemesh.models.gpt.stages.split_layers)
        try:
            low, high = (_micro_batches(fns, dict(kwargs, blocks=(path, k * n_stages + extra)), notes) for k in LOW_HIGH)
            counted = {r: _scaled(high[r], low[r], n // n_stages - LOW_HIGH[1], r, fns, pp) for r in range(pp)}
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
    if any(note.startswith("PP ranks ") for note in notes):
        notes[0] = notes[0].replace("every PP rank traced", "the first and last PP ranks traced, and the middle ones "
                                    "traced or added by difference")
    notes += user_notes(counted[0], kwargs)
    _log.info("traced %s in %.1f s", mesh, time.perf_counter() - started)
    classes = []
    for rank in range(pp):
        c = counted[rank]
        static = RankMemory(f"PP rank {rank}", c.weights, c.held["grads"], c.held["optimizer"], 0)
        classes.append(RankClass(f"PP rank {rank}", static, c.held["activations"], 0, c.sent, c.flops,
                                 c.memory_bytes, c.optimizer_bytes, c.ops, c.dtensor_ops, c.by_op, c.counts))
    return MeshFit(dict(degrees), classes, m, kwargs["micro_batch_size"], notes=tuple(dict.fromkeys(notes)),
                   dp_mode=counted[0].dp_mode, pp_schedule=fns.pp_schedule)


def _micro_batches(fns: UserFunctions, kwargs: dict[str, Any], notes: list[str]) -> dict[int, Counted]:
    """:func:`trace_pipeline` of every micro-batch, or of fewer and the rest by difference (see predict_pipeline)."""
    pp, m = kwargs["degrees"]["PP"], kwargs["passes"]
    short = m % pp + 2 * pp
    shared = _records(fns, kwargs)
    replayed = REPLAY and fns.pp_schedule in ONE_STAGE_REPLAYED
    if replayed and pp >= PRELUDE_FROM[0] and m >= PRELUDE_FROM[1]:
        shared = {} if shared is None else shared
        _prelude(fns, kwargs, shared)
    both = short + (short + pp)  # what the two traces run together
    if both >= m or fns.pp_schedule in MULTI_STAGE or (replayed and m <= WHOLE_UP_TO * both):
        return trace_pipeline(fns, kwargs, notes, records=shared)
    derived = _rank_plan(fns, kwargs)  # the stages do not change with the micro-batches
    # the second pipeline replays what the first recorded of the same stages
    records: dict[tuple, list[Any]] = {} if shared is None else shared
    two, three = (trace_pipeline(fns, dict(kwargs, passes=k), notes, derived, records) for k in (short, short + pp))
    notes.append(f"micro-batches: {short} and {short + pp} traced, the other {m - short - pp} added by difference, "
                 f"{pp} at a time")
    # each action's number dropped: the two traces run other counts of them (step_parts.collapse_actions)
    two, three = ({r: _slots(c, r, fns, pp) for r, c in t.items()} for t in (two, three))
    return {r: three[r].scaled(two[r], (m - short - pp) // pp) for r in range(pp)}


#: under a replayed one-stage schedule, every micro-batch is traced (most of them replayed) up to this many times
#: the micro-batches of the two traces by difference: a pipeline costs its traced actions and its stages, a replay
#: little. The 70B GPT of docs/planning.md over PP 8 x TP 8 (BENCHMARKS.md, 2026-12-03): 64 micro-batches in 54.7 s
#: against 73.9 s by difference, 256 in 118.3 s against 123.5 s (the two traces run 40), the same peaks
WHOLE_UP_TO = 4
#: the PP ranks and micro-batches of :func:`_prelude`'s pipeline
PRELUDE = (4, 6)
#: the PP ranks and micro-batches from which a pipeline under a one-stage schedule runs its prelude. What it saves
#: grows with the warm-up, PP, as long as the micro-batches fill it: below these its two rank traces cost about what
#: they save (PP 5, 18 micro-batches: the pipeline's PP ranks 0 and 1 traced 26 and 22 actions without it, 8 and 8
#: with it, and the prelude 34)
PRELUDE_FROM = (8, 18)
#: the one-stage schedules whose actions replay (:mod:`vemesh.planning.pipeline_replay`)
ONE_STAGE_REPLAYED = tuple(s for s in REPLAYED_SCHEDULES if s not in MULTI_STAGE)


def _prelude(fns: UserFunctions, kwargs: dict[str, Any], records: dict[tuple, list[Any]]) -> None:
    """The first and middle stages' records made on a short pipeline first, so that the pipeline's own traces of
    them replay from their first step on.

    A role's first trace (PP rank 0; PP rank 1, whose records its alike middle ranks replay) replays nothing of its
    first step: a forward replays only when its backward's record exists, and under 1F1B the warm-up forwards'
    backwards come later in the step (the cool-down's, after another backward, last of all); under GPipe every
    forward comes before every backward. Its first step's actions are then all traced: at PP 16 and 32
    micro-batches, 66 of PP rank 0's 128. Here PP ranks 0 and 1 of a pipeline of ``PRELUDE[0]`` stages of the same blocks each (a model
    of that many times a stage's blocks), over the same TP, CP, DP and micro-batch, run ``PRELUDE[1]`` micro-batches
    into ``records``: each of those keys is seen twice in their two steps. A record is keyed by what its action
    depends on, not by the pipeline's length (:func:`_context`), as a search's meshes share theirs. For each count of
    blocks a stage the pipeline's first stages hold (the presets give the first ``n mod S`` stages a block more),
    one such pipeline. None where the model's blocks are not found, or where the user's functions fail on the short
    model (a stage cut by the model's configured depth, as :func:`predict_pipeline` meets it too): the pipeline's
    ranks then record their own, as without a prelude. A stage cut otherwise than the short pipeline's finds no
    record of its own signature (:mod:`vemesh.planning.stage_signature`), and is traced as without."""
    pp = kwargs["degrees"]["PP"]
    found = kwargs.get("blocks") or blocks_of(fns.factory, fns.names[0])
    if found is None:
        return
    path, n = found
    base, extra = divmod(n, pp)
    small, m = PRELUDE
    for count in sorted({base + (extra > 0), base} if extra < pp - 1 else {base + 1}, reverse=True):
        short = dict(kwargs, degrees=dict(kwargs["degrees"], PP=small), world_size=kwargs["world_size"] // pp * small,
                     passes=m, blocks=(path, small * count), cut_at_blocks="blocks" in kwargs)
        exchange = MetaExchange(replay=True)
        exchange.records = records
        started = time.perf_counter()
        try:
            for rank in (0, 1):
                _trace_rank(fns, rank, exchange, short)
        except ValueError as e:  # what the user's functions raise on a model of other depth: no prelude
            if not isinstance(e.__cause__, (IndexError, KeyError)):
                raise
            return
        _log.debug("recorded the stages of %d blocks on a pipeline of %d in %.1f s", count, small,
                   time.perf_counter() - started)


def _slots(counted: Counted, rank: int, fns: UserFunctions, pp: int) -> Counted:
    """``counted`` (PP rank ``rank``'s) with each action's phase named by its kind and its stage's place on the rank,
    its number dropped (:func:`~vemesh.planning.step_parts.stage_slots`,
    :func:`~vemesh.planning.step_parts.collapse_actions`), as a rank added by difference names them."""
    stages = stage_indices(rank, pp, fns.pp_schedule)
    return replace(counted, phases=collapse_actions(stage_slots(counted.phases, stages)))


def _scaled(high: Counted, low: Counted, times: int, rank: int, fns: UserFunctions, pp: int) -> Counted:
    """``high.scaled(low, times)``, their phases named alike first where they are not (a rank traced in one and
    added by difference in the other: :func:`_slots`)."""
    if set(high.phases) != set(low.phases):
        high, low = _slots(high, rank, fns, pp), _slots(low, rank, fns, pp)
    return high.scaled(low, times)


#: whether a pipeline's traces replay micro-batches seen twice alike (:mod:`vemesh.planning.pipeline_replay`)
REPLAY = True


def trace_pipeline(fns: UserFunctions, kwargs: dict[str, Any], notes: list[str] | None = None,
                   derived: dict[int, tuple[int, int]] | None = None,
                   records: dict[tuple, list[Any]] | None = None) -> dict[int, Counted]:
    """Every PP rank traced (:func:`trace_user` with ``pp_rank``), in the order the stages' shapes allow: a rank whose
    stage waits for another's activations is traced again after that one. With :data:`REPLAY` a stage's micro-batches
    seen twice alike are replayed (:mod:`vemesh.planning.pipeline_replay`); a rank whose replay meets a backward it
    has no record of is traced again without. Under a one-stage schedule, alike middle ranks are added by difference
    (``derived``, by default :func:`_rank_plan`'s). ``records``: the replays' records, shared with other pipelines of
    the same stages (the same plan with other counts of micro-batches: a record is keyed by what its action depends
    on, not by the step's length)."""
    pp = kwargs["degrees"]["PP"]
    exchange = MetaExchange(replay=REPLAY)
    if records is not None:
        exchange.records = records
    counted: dict[int, Counted] = {}
    derived = _rank_plan(fns, kwargs) if derived is None else derived
    pending = [r for r in range(pp) if r not in derived]
    while pending:
        waiting, known = [], len(exchange.forward)
        for rank in pending:
            try:
                counted[rank] = _trace_rank(fns, rank, exchange, kwargs)
            except MissingMeta:
                waiting.append(rank)
            for alike, (_, b) in derived.items():  # an alike stage sends what its traced likeness sent
                for sent in (exchange.forward, exchange.backward):
                    if b in sent and alike not in sent:
                        sent[alike] = sent[b]
        if len(waiting) == len(pending) and len(exchange.forward) == known:  # no stage got further
            raise ValueError(f"--parallelize {fns.names[1]}: the stages of PP ranks {waiting} wait for each other's "
                             "activations; each stage must take the previous stage's outputs")
        pending = waiting[::-1]  # the next round from the other end: a V sends back towards PP rank 0
    for stage in exchange.wrongly_derived():  # a stage's gradient shapes guessed wrongly: trace its rank again
        rank = next(r for r in range(pp) if stage in stage_indices(r, pp, fns.pp_schedule))
        if rank not in derived:
            counted[rank] = _trace_rank(fns, rank, exchange, kwargs)
    replayed = sum(r.replayed for r in exchange.replays)
    if notes is not None and replayed:
        notes.append(f"micro-batches: {replayed} of {replayed + sum(r.traced for r in exchange.replays)} stage "
                     "forwards and backwards replayed from two traced alike (vemesh.planning.pipeline_replay)")
    if derived:
        counted = _by_difference(fns, kwargs, exchange, counted, derived, notes)
    return counted


#: a one-stage schedule's PP ranks (GPipe, 1F1B) go by difference from this many (see :func:`_rank_plan`)
RANKS_BY_DIFFERENCE_FROM = 7


def _rank_plan(fns: UserFunctions, kwargs: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """The PP ranks added by difference, each as ``rank: (a, b)``: PP rank ``b`` (traced) plus ``rank - b`` times what
    ``b`` has over ``a = b - 1`` (traced).

    Under a one-stage schedule (GPipe, 1F1B) a middle PP rank runs the schedule's actions on its own stage, and the
    next rank of an alike stage (:func:`~vemesh.planning.user_model.stage_signatures`: the same modules, parameters,
    buffers and placements, built on the fake world without a step; for the planner's presets, whose cut is theirs,
    what :attr:`~vemesh.planning.user_code.UserFunctions.stage_kinds` says: the same blocks, wrapped alike) holds one micro-batch's activations fewer in
    flight at each moment of the step, and sends and computes the same. Of each run of alike middle ranks the first
    three and the last are traced, the third and the last check the difference of the first two
    (:func:`_by_difference`: a figure that leaves the line past the third rank is caught at the last), and the rest
    are added by it. The multi-stage schedules are traced on every rank: their ranks' steps differ in other ways (a
    difference of the two PP ranks before put interleaved 1F1B's PP rank 4 of 8 at 1.015 of its trace's peak, ZBV's PP rank
    3 at 0.979). Not told apart: a stage whose forward does other work with the same modules and parameters (a branch
    on its stage's index), past the first three of its run, that comes back to the line by its last."""
    pp = kwargs["degrees"]["PP"]
    if fns.pp_schedule in MULTI_STAGE or pp < RANKS_BY_DIFFERENCE_FROM:
        return {}
    runs: list[list[int]] = []
    last = None
    for rank in range(1, pp - 1):
        if fns.stage_kinds is not None:  # a preset: its own cut says what each rank holds, no stage built
            signature = fns.stage_kinds(rank, pp, kwargs["blocks"][1] if kwargs.get("blocks") else None)
        else:
            signature = stage_signatures(fns, pp_rank=rank, **kwargs)
        if runs and signature == last:
            runs[-1].append(rank)
        else:
            runs.append([rank])
        last = signature
    return {r: (run[0], run[1]) for run in runs if len(run) > 4 for r in run[3:-1]}


def _by_difference(fns: UserFunctions, kwargs: dict[str, Any], exchange: MetaExchange, counted: dict[int, Counted],
                   derived: dict[int, tuple[int, int]], notes: list[str] | None) -> dict[int, Counted]:
    """``counted`` with the ``derived`` ranks added (see :func:`_rank_plan`), each action's phase named by the kind and
    its stage's place on its rank, not by its number in the step (the ranks run them in another order). The third
    traced rank of each run, and its last, must equal the difference of the first two, in every figure; where either
    does not, the run's other ranks are traced."""
    pp = kwargs["degrees"]["PP"]
    alike = {r: _slots(c, r, fns, pp) for r, c in counted.items()}
    out = dict(counted)
    for first in sorted({a for a, _ in derived.values()}):
        ranks = sorted(r for r, (a, _) in derived.items() if a == first)
        low, high, last = alike[first], alike[first + 1], ranks[-1] + 1
        off = next((r for r in (first + 2, last) if high.scaled(low, r - first - 1) != alike[r]), None)
        if off is None:
            out.update({r: high.scaled(low, r - first - 1) for r in ranks})
            if notes is not None:
                notes.append(f"{_ranks(ranks)}: alike stages, added by difference of PP ranks {first} and "
                             f"{first + 1} (PP ranks {first + 2} and {last}, traced, equal it)")
        else:  # in order, each from what the rank before sent, not from what an alike stage did
            for r in ranks:
                exchange.forward.pop(r, None), exchange.backward.pop(r, None)
            out.update({r: _trace_rank(fns, r, exchange, kwargs) for r in ranks})
            if notes is not None:
                notes.append(f"{_ranks(ranks)}: alike stages, but PP rank {off} is not on the difference of PP "
                             f"ranks {first} and {first + 1}; traced")
    return out


def _ranks(ranks: list[int]) -> str:
    return f"PP rank {ranks[0]}" if len(ranks) == 1 else f"PP ranks {ranks[0]} to {ranks[-1]}"


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
