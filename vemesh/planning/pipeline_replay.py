"""Micro-batches replayed: a stage's forward or backward of a micro-batch, seen twice alike, is not traced again.

In a pipeline step torch's schedule runs every micro-batch through each stage, and a trace dispatches every op of
each (about half a millisecond an op on fake tensors under the planner's counters): the 405B pipelines of
torchtitan's table took 5 to 19 minutes a plan. But a stage's forward of one micro-batch does to the step's figures
what its forward of the next one does, once the step is past its first micro-batches. :class:`Replay` watches each
stage's compute (``forward_maybe_with_nosync`` and ``backward_maybe_with_nosync`` of torch's ``PipelineStage``: the
submodule's forward, its backward, and the data-parallel wrapper's work in them) and records its *effect*:

* the memory: how far above its start the bytes held rose in each part of it (the tracker's ``part``, where the
  stage's blocks begin and end: :func:`vemesh.planning.step_parts.pipeline_parts`), and where they ended;
* every counter's change: the collectives by group and op, the FLOPs by op, the memory-bound bytes, the ops
  dispatched, and what compile's fusion counts (:mod:`vemesh.planning.fusion`);
* the shapes of what it returned (the stage's outputs, its input gradients).

An action is keyed by the stage, by its signature (:mod:`vemesh.planning.stage_signature`: its role, its parameters'
and buffers' shapes and placements, its modules' kinds: activation checkpointing of some blocks), so that the
middle stages of a pipeline, alike on every PP rank, share their records across the ranks' traces of one plan and
across the two steps each trace runs; forward or backward; the action the same stage ran before it (a
data-parallel wrapper's state can depend on it); each FSDP2 unit's state; whether an earlier backward of its stage in the step made the
gradients it adds to (the first allocates them: FSDP2's unsharded ones without gradient sync, DDP's ``.grad``; a
forward predicts which its backward will be from torch's action list, :mod:`vemesh.planning.pipeline_order`); and
whether it is the stage's last backward of the step. Collectives are recorded by
their mesh dim, and replayed on the group of that dim in the trace that replays them. When two
consecutive actions of one key had equal effects (and a forward's effect and its backward's add up: what the forward
kept is what its backward frees), the key's next actions are *replayed*: the bytes allocated and freed as the
record says (an empty storage the size of the rise, then one holding what the forward kept until its backward),
the outputs made at their shapes, every counter advanced by the record. torch's schedule still runs every action:
its receive buffers, sends and losses are real.

The stage that computes the loss is replayed too: its loss runs on the replayed outputs (made by a node of the
autograd graph, :class:`_Source`), and its backward is recorded from where the loss's backward reaches the stage's
outputs. What stays traced: the schedules that split the
backward into input and weight passes (``interleaved-zb``, ``zbv``, ``dualpipev``), the last micro-batch of each
stage (its backward reduces the gradients), and every action whose key has not been seen twice alike. A stage returning
DTensors (the last stage under loss-parallel) is replayed with DTensors of the same mesh, placements and shapes; as
their mesh is of one trace's fake world, only that rank's trace replays such a record. A replayed forward whose backward meets a key
not seen twice alike cannot be traced (its autograd graph was never built): the trace sets :attr:`Replay.missed`,
and the caller traces the rank again without replay (:func:`vemesh.planning.pipeline_plan.trace_pipeline`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.distributed.tensor import DTensor

from vemesh.parallel.schedules import stages_per_rank
from vemesh.planning.pipeline_order import backward_contexts, gradients_may_change
from vemesh.planning.replay_counters import StepCounters, minus
from vemesh.planning.stage_signature import stage_signature

__all__ = ["REPLAYED_SCHEDULES", "Replay", "ReplayMiss"]

#: the schedules whose backward is one pass per micro-batch (the others split it into input and weight passes)
REPLAYED_SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")


class ReplayMiss(Exception):
    """A replayed forward's backward has no record: the rank is traced again without replay."""


@dataclass(frozen=True)
class Effect:
    """What one action did (see the module docstring)."""

    #: the highest bytes held in each part of it (the tracker's :attr:`part`, in the order they ran), over those held
    #: at its start: ``((part, rise), ...)``
    rises: tuple
    net: int  #: the bytes held at its end, over those at its start
    parts: tuple  #: the parameters' and gradients' bytes held at its start and end (``Held``), unchanged to replay
    #: each FSDP2 unit's state (sharded, unsharded) at its start and end: an action that changes it is not replayed
    #: (a replay runs no FSDP2 hook, so the next traced action would meet another state than the trace's)
    state: tuple
    counters: tuple  #: every counter's change
    #: (shape, stride, dtype, requires_grad, dtensor) of each tensor returned (None: not a tensor); of a DTensor, its
    #: local tensor's, and ``dtensor`` is (mesh, placements, shape, stride) (None for a plain tensor)
    returned: tuple
    single: bool  #: the forward returned one tensor, not a tuple
    fusion: tuple  #: per returned tensor: (its producer region relative to the last, bytes pending) or None
    #: the last stage's backward, from when its loss's backward reached its outputs: their gradients' bytes and the
    #: loss's seed gradient, which the stage's backward frees (0 elsewhere)
    consumed: int = 0
    #: the trace that recorded it, when it returned DTensors: their mesh is of that trace's world, so only that trace
    #: replays it (None: any trace of the plan may)
    owner: object = None

    def returned_bytes(self) -> int:
        return sum(_size(*meta[:3]) for meta in self.returned if meta is not None)


def _local(t: Any) -> Any:
    """A DTensor's local tensor (what holds its bytes); any other value as it is."""
    return t._local_tensor if isinstance(t, DTensor) else t


def _meta(t: torch.Tensor) -> tuple:
    local = _local(t)
    dtensor = (t.device_mesh, tuple(t.placements), tuple(t.shape), tuple(t.stride())) if isinstance(t, DTensor) else None
    return tuple(local.shape), tuple(local.stride()), local.dtype, t.requires_grad, dtensor


def _make(meta: tuple, device: torch.device) -> torch.Tensor:
    """A tensor as ``meta`` (:func:`_meta`) describes it: a leaf, of a DTensor's mesh and placements where it was one."""
    shape, stride, dtype, grad, dtensor = meta
    local = torch.empty_strided(shape, stride, dtype=dtype, device=device)
    if dtensor is None:
        return local.requires_grad_(grad)
    mesh, placements, full, full_stride = dtensor
    return DTensor.from_local(local, mesh, placements, run_check=False, shape=torch.Size(full),
                              stride=full_stride).requires_grad_(grad)


def _bytes(t: torch.Tensor) -> int:
    return _local(t).untyped_storage().nbytes()


def _size(shape: tuple, stride: tuple, dtype: torch.dtype) -> int:
    if not shape:
        return dtype.itemsize
    span = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    return span * dtype.itemsize


class Replay:
    """Replays a pipeline trace's micro-batches (see the module docstring). ``tracker`` is the trace's
    :class:`~vemesh.planning.step_tracker.StepTracker`, ``collectives`` its
    :class:`~vemesh.planning.measure.CollectiveBytes`; :meth:`begin_step` gives each step's FLOP and memory-bound
    counters (:func:`vemesh.planning.fusion.step_counters`)."""

    def __init__(self, tracker: Any, collectives: Any, mesh: Any, schedule: str, pp: int, pp_rank: int,
                 n_microbatches: int, records: dict[tuple, list[Effect]] | None = None) -> None:
        self.tracker, self.n = tracker, n_microbatches
        self.counters = StepCounters(collectives, mesh)  #: the trace's counters, snapshot and advanced
        #: (stage, micro-batch) -> the kind of the action its stage runs before its backward, in torch's action list
        self.contexts = backward_contexts(schedule, pp, pp_rank, n_microbatches)
        self.one_stage = stages_per_rank(schedule) == 1
        #: (stage, micro-batch) whose backward may start holding other gradient bytes than its forward did
        self.unsure = gradients_may_change(schedule, pp, pp_rank, n_microbatches)
        #: (stage, micro-batch) whose backward follows another backward of its stage in the step: it adds to the
        #: gradients the first one made (FSDP2's unsharded ones without gradient sync, DDP's ``.grad``)
        self.accumulating = {k for k, after_backward in backward_contexts(schedule, pp, pp_rank, n_microbatches,
                                                                            after_backward=True).items()
                             if after_backward}
        #: key -> the effects of its last two traced actions; shared by the ranks of one plan (a stage is keyed by its
        #: signature, not its index: the middle stages of a pipeline do alike)
        self.seen: dict[tuple, list[Effect]] = records if records is not None else {}
        self.signature: dict[int, tuple] = {}  #: stage -> what tells it apart (:func:`stage_signature`)
        self.previous: dict[int, str] = {}  #: stage -> the kind of its last action ("F", "B")
        self.micro_batch: dict[int, int] = {}  #: stage -> the micro-batch its action runs now
        self.kept: dict[tuple[int, int], Any] = {}  #: (stage, micro-batch) -> what a replayed forward keeps
        self.handed: list[Any] = []  #: what a replayed last stage's loss's backward handed its outputs
        self._window: Any = None  #: the traced action's window on the bytes held
        self.seed: Any = None  #: a replayed last stage's backward: the gradient its loss's backward started from
        self._seed_bytes = 0  #: a traced last stage's backward: the bytes of that gradient, freed at its end
        self.units: dict[int, list[Any]] = {}  #: stage -> its FSDP2 parameter groups
        self.replayed = 0  #: actions replayed (for the plan's note)
        self.traced = 0  #: actions of the watched stages traced
        self.missed = False
        self.token = object()  #: this trace, as the owner of the records whose DTensors are of its world

    def begin_step(self, flops: Any, moved: Any) -> None:
        """A new step: its counters. The records of the steps before serve it: what differs at a step's start (the
        first step's lazy initialization, the gradients not yet accumulated) differs in the records or in the keys."""
        self.counters.flops, self.counters.moved = flops, moved
        self.previous.clear()

    def attach(self, stages: list[Any]) -> None:
        """Watch every stage."""
        for stage in stages:
            self._attach(stage)

    def _attach(self, stage: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        index = stage.stage_index
        groups = (m._get_fsdp_state()._fsdp_param_group for m in stage.submod.modules() if isinstance(m, FSDPModule))
        self.units[index] = [g for g in groups if g is not None]
        self.signature[index] = stage_signature(stage)
        forward_chunk, backward_chunk = stage.forward_one_chunk, stage.backward_one_chunk
        forward, backward = stage.forward_maybe_with_nosync, stage.backward_maybe_with_nosync

        def forward_one_chunk(fwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.micro_batch[index] = fwd_chunk_id
            return forward_chunk(fwd_chunk_id, *args, **kwargs)

        def backward_one_chunk(bwd_chunk_id: int, *args: Any, **kwargs: Any) -> Any:
            self.micro_batch[index] = bwd_chunk_id
            return backward_chunk(bwd_chunk_id, *args, **kwargs)

        def forward_maybe_with_nosync(*args: Any, **kwargs: Any) -> Any:
            mb = self.micro_batch[index]
            key = (self.signature[index], "F", self.previous.get(index), False, self._state(index), None)
            after = (index, mb) in self.accumulating
            back = (self.signature[index], "B", self.contexts.get((index, mb)), False, self._state(index), after)
            self.previous[index] = "F"
            # a backward after another of its stage starts with the gradients that one made: with one stage a rank,
            # what its record says (the backward checks it again)
            effect, undo = self._replayable(key), self._replayable(back, predicted=after and self.one_stage)
            # the last stage's backward record must start where its loss's backward ends (one output, hooked)
            if mb < self.n - 1 and (index, mb) not in self.unsure and effect is not None and undo is not None and \
                    _balanced(effect, undo) and _from_start(effect) and (undo.consumed > 0 or not stage.is_last):
                return self._replay_forward(index, mb, effect, sourced=stage.is_last)
            result = self._trace(key, index, lambda: forward(*args, **kwargs), forward=True)
            if stage.is_last and isinstance(result, torch.Tensor) and result.requires_grad:
                result.register_hook(self._split)  # where the loss's backward hands over to the stage's
            return result

        def backward_maybe_with_nosync(backward_type: str, bwd_kwargs: dict, last_backward: bool = False) -> Any:
            mb = self.micro_batch[index]
            key = (self.signature[index], "B", self.previous.get(index), last_backward, self._state(index),
                   (index, mb) in self.accumulating)
            self.previous[index] = "B"
            if (index, mb) in self.kept:
                effect = self._replayable(key)
                if effect is None or backward_type != "full":
                    self.missed = True
                    raise ReplayMiss(f"stage {index}: the backward of replayed micro-batch {mb} ({key}) has no record")
                if stage.is_last:  # the loss's backward runs, into the replayed outputs (their .grad), its seed
                    loss = bwd_kwargs["stage_output"]  # held as torch's backward holds it until the stage's ends
                    self.seed = torch.ones_like(loss)
                    torch.autograd.backward(loss, self.seed)
                return self._replay_backward(index, mb, effect)
            loss = bwd_kwargs["stage_output"] if stage.is_last else None
            self._seed_bytes = _bytes(loss) if isinstance(loss, torch.Tensor) else 0
            return self._trace(key, index, lambda: backward(backward_type, bwd_kwargs, last_backward), forward=False)

        stage.forward_one_chunk, stage.backward_one_chunk = forward_one_chunk, backward_one_chunk
        stage.forward_maybe_with_nosync, stage.backward_maybe_with_nosync = forward_maybe_with_nosync, \
            backward_maybe_with_nosync

    # -- records ----------------------------------------------------------------------------------------------------

    def _replayable(self, key: tuple, predicted: bool = False) -> Effect | None:
        """The record to replay for ``key``, if its last two were alike and it starts from the parameter and gradient
        bytes held now (``predicted``: from those its record says)."""
        seen = self.seen.get(key, [])
        alike = len(seen) == 2 and _alike(seen[0], seen[1]) and seen[1].parts[0] == seen[1].parts[1] and \
            seen[1].state[0] == seen[1].state[1]
        mine = seen[1].owner in (None, self.token) if alike else False
        if not (alike and mine and (predicted or seen[1].parts[0] == self._parts())):
            return None
        return min(seen, key=lambda e: e.counters[1][1])  # the fewer ops: the other met FakeTensor's cold cache

    def _trace(self, key: tuple, index: int, run: Callable[[], Any], *, forward: bool) -> Any:
        self.traced += 1
        start, parts, before, state = self._held(), self._parts(), self.counters.snapshot(), self._state(index)
        window = self._window = _Window(start, self.tracker)
        self.tracker.watch = window.see
        try:
            result = run()
        finally:
            self.tracker.watch, self._window = None, None
        if window.split is not None:  # the last stage's backward: from where the loss's backward ended
            start, parts, before, consumed = window.split
        else:
            consumed = 0
        returned = result if forward else result[0]
        single = isinstance(returned, torch.Tensor)
        flat = (returned,) if single else tuple(returned) if isinstance(returned, (tuple, list)) else None
        if flat is None:  # not a shape a replay can make: never replayed
            self.seen[key] = []
            return result
        metas = tuple(_meta(t) if isinstance(t, torch.Tensor) else None for t in flat)
        dtensors = any(isinstance(t, DTensor) for t in flat)
        rises = tuple((part, peak - start) for part, peak in window.parts)
        effect = Effect(rises, self._held() - start, (parts, self._parts()), (state, self._state(index)),
                        minus(self.counters.snapshot(), before), metas, single,
                        self.counters.fusion_of(tuple(_local(t) for t in flat)), consumed,
                        self.token if dtensors else None)
        self.seen[key] = [*self.seen.get(key, []), effect][-2:]
        return result

    def _split(self, grad: torch.Tensor) -> None:
        """The loss's backward reached the last stage's output (``grad``): the stage's backward starts here."""
        window = self._window
        if window is None or window.split is not None:
            return
        held = self._held()
        window.split = (held, self._parts(), self.counters.snapshot(), _bytes(grad) + self._seed_bytes)
        window.restart(held)

    # -- replays ----------------------------------------------------------------------------------------------------

    def _replay_forward(self, index: int, mb: int, effect: Effect, sourced: bool = False) -> Any:
        kept_bytes = effect.net - effect.returned_bytes()
        outputs, kept = self._play(effect, kept_bytes, sourced=sourced)
        self.kept[(index, mb)] = kept
        return outputs[0] if effect.single else tuple(outputs)

    def _replay_backward(self, index: int, mb: int, effect: Effect) -> tuple[tuple, None]:
        def release() -> None:
            self.kept.pop((index, mb))  # what the forward kept for this backward is freed in it
            self.seed = None
            self.handed.clear()  # the gradients the loss's backward handed the outputs: used up in the stage's
        grads, _ = self._play(effect, 0, release)
        return tuple(grads), None

    def _play(self, effect: Effect, kept_bytes: int, release: Callable[[], None] | None = None,
              sourced: bool = False) -> tuple[list, Any]:
        """Allocate and free as ``effect`` did; its counters advanced, none of the allocations counted. ``sourced``:
        the outputs come out of a :class:`_Source` (the loss's graph then holds a node, not the outputs)."""
        self.replayed += 1
        before = self.counters.snapshot()
        device = self._device()
        start = self._held()
        for part, rise in effect.rises:  # each part's peak, as the tracker's part: the start plus its rise
            if release is not None and start + rise < self._held():  # a backward's later parts, past what its
                release()  # forward kept: freed here (before the part begins, which the tracker sees at what is
                release = None  # held then), or those parts would peak at the start, not below it
            self.tracker.part = part
            torch.empty(max(start + rise - self._held(), 0), dtype=torch.uint8, device=device)  # held, freed at once
        if release is not None:
            release()
        made = [_make(meta, device) if meta is not None else None for meta in effect.returned]
        if sourced:  # made without autograd's leaf (which the graph would hold), out of a node fed a 0-byte leaf
            seed = torch.empty(0, device=device, requires_grad=True)
            made = [_Source.apply(self.handed, seed, t.detach()) if t is not None and t.requires_grad else t
                    for t in made]
        kept = torch.empty(kept_bytes, dtype=torch.uint8, device=device) if kept_bytes > 0 else None
        self.counters.restore(before)
        self.counters.advance(effect.counters)
        self.counters.pend([_local(t) if t is not None else None for t in made], effect.fusion)
        return made, kept

    # -- what is measured -------------------------------------------------------------------------------------------

    def _held(self) -> int:
        from torch.distributed._tools.mem_tracker import _MemRefType

        return sum(s["Total"] - s.get(_MemRefType.OTH, 0) for s in self.tracker._curr_mem_snap.values())

    def _parts(self) -> tuple:
        held = self.tracker.on_step_peak() if self.tracker.on_step_peak is not None else {}
        return tuple(sorted(held.items()))

    def _state(self, index: int) -> tuple:
        return tuple((g.is_sharded, g.is_sharded_post_forward, g.is_unsharded) for g in self.units.get(index, ()))

    def _device(self) -> torch.device:
        devices = list(self.tracker._curr_mem_snap)
        return devices[0] if devices else torch.device("cpu")

def _alike(a: Effect, b: Effect) -> bool:
    """Two effects equal but for the count of ops dispatched, which varies by a few an action with what is not the
    step's: FakeTensor's device queries (``prim.device``, dispatched when its cache misses) and FSDP2's profiler marks
    (``record_function``, as its state machine runs them); a replay adds the smaller count."""
    def without_ops(e: Effect) -> Effect:
        flops, moved, *rest = e.counters
        return replace(e, counters=(flops, (moved[0], 0, moved[2]), *rest))
    return without_ops(a) == without_ops(b)


def _from_start(forward: Effect) -> bool:
    """No part of a forward's record peaks below the bytes held at its start. A replay frees nothing that was held
    before it (a replayed backward frees what its replayed forward kept, and nothing else), so a part that fell below
    the start would be played at the start: a forward so recorded is traced, never replayed (none of the test
    pipelines has one; a backward's later parts, past what its forward kept, do fall, and are played so)."""
    return all(rise >= 0 for _, rise in forward.rises)


def _balanced(forward: Effect, backward: Effect) -> bool:
    """A forward's record and its backward's add up: what the forward kept besides its outputs, the backward frees,
    and it ends holding its input gradients."""
    kept = forward.net - forward.returned_bytes()
    return kept >= 0 and backward.net == backward.returned_bytes() - kept - backward.consumed


class _Source(torch.autograd.Function):
    """A replayed last stage's output, made by a node of the autograd graph (as a traced stage's output is) rather
    than a leaf: a leaf would be held by the loss's graph, which torch's schedule keeps to the end of the step. Its
    backward keeps the gradient it is handed (``handed``) until the replayed stage's backward uses it up."""

    @staticmethod
    def forward(ctx: Any, handed: list, seed: torch.Tensor, made: torch.Tensor) -> torch.Tensor:
        ctx.handed = handed
        return made

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[None, None, None]:
        ctx.handed.append(grad)
        return None, None, None


class _Window:
    """The highest bytes held while an action runs, in each part of it that the tracker's :attr:`part` names (the
    tracker calls :meth:`see` at each update)."""

    def __init__(self, start: int, tracker: Any) -> None:
        self.tracker = tracker
        self.parts: list[list] = []  #: ``[part, highest bytes held]``, a row each time the part changes
        self.split: tuple | None = None  #: (bytes held, parts, counters, gradient bytes) where a last stage's starts
        self.restart(start)

    def restart(self, held: int) -> None:
        """The action starts again here, holding ``held``."""
        self.parts = [[self.tracker.part, held]]

    def see(self, held: int) -> None:
        part = self.tracker.part
        if part != self.parts[-1][0]:
            self.parts.append([part, held])
        elif held > self.parts[-1][1]:
            self.parts[-1][1] = held
