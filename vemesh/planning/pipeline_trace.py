"""A pipeline on the fake world: torch's own schedule, run on fake tensors, one PP rank per trace.

With PP, the user's parallelize function returns this rank's stages (``torch.distributed.pipelining.PipelineStage``,
as torch and torchtitan build them), and the planner runs the step through torch's schedule class for
``--pp-schedule``: its own action list, its receive buffers, its forward and backward of each micro-batch (its
split into input and weight passes for the zero-bubble schedules), its FSDP2 unshard and reshard, its gradient
reduction. Nothing here models a schedule; torch's code runs.

Two things torch's stages do at their first step need the other ranks, which a plan (one rank of a fake world at
a time) does not have:

* the warm-up vote on whether shapes are static (``.item()`` of a received tensor): here every stage infers its
  shapes (torch's dynamic mode, which also checks any shapes the user gave);
* the shapes each stage receives: the activations from the stage before, the gradients from the stage after.
  A :class:`MetaExchange`, one per plan, carries what each stage sends to the stage that reads it, across the
  traces of the PP ranks. A rank whose stage needs activations from a stage not traced yet stops
  (:class:`MissingMeta`) and is traced again after it. Gradients from a stage not traced yet are derived from the
  stage's own outputs (torch's ``_derive_grad_metas``), and checked against what that stage sends when it is traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from vemesh.parallel.schedules import MULTI_STAGE, schedule_class, stage_indices, stages_per_rank
from vemesh.planning.pipeline_replay import REPLAYED_SCHEDULES, Replay

__all__ = ["MetaExchange", "MissingMeta", "build_schedule", "pipeline_stages", "sends_hold_tensors"]


class MissingMeta(Exception):
    """Stage ``dst`` needs the activations' shapes of stage ``src``, which no trace has run yet."""

    def __init__(self, src: int, dst: int) -> None:
        super().__init__(f"stage {dst} needs the shapes stage {src} sends")
        self.src, self.dst = src, dst


class MetaExchange:
    """What each stage sends to its neighbour at the first step (its outputs' shapes forward, its input gradients'
    shapes backward), kept across the traces of one plan."""

    def __init__(self, replay: bool = False) -> None:
        self.replay = replay  #: whether the traces replay micro-batches (:mod:`vemesh.planning.pipeline_replay`)
        self.replays: list[Any] = []  #: each rank's trace's :class:`~vemesh.planning.pipeline_replay.Replay`
        self.records: dict[tuple, list[Any]] = {}  #: what the ranks' traces recorded, shared among them
        self.forward: dict[int, Any] = {}  #: stage -> what it sent to the stage after
        self.backward: dict[int, Any] = {}  #: stage -> what it sent to the stage before
        self.derived: dict[int, Any] = {}  #: stage -> the gradient shapes it derived while the stage after was untraced

    def attach(self, stage: Any) -> None:
        """Route ``stage``'s sends and receives of shapes through this exchange instead of the process group."""
        index = stage.stage_index

        def send(meta: Any, dst_stage: int) -> None:
            (self.forward if dst_stage == index + 1 else self.backward)[index] = meta

        def recv(src_stage: int) -> Any:
            if src_stage == index - 1:
                if src_stage not in self.forward:
                    raise MissingMeta(src_stage, index)
                return self.forward[src_stage]
            if src_stage in self.backward:
                return self.backward[src_stage]
            from torch.distributed.pipelining._utils import _derive_grad_metas, _StageBackwardMeta

            meta = _StageBackwardMeta(backward_metas=_derive_grad_metas(stage._stage_meta.outputs))
            self.derived[index] = meta
            return meta

        stage._send_meta, stage._recv_meta = send, recv

    def replay_for(self, stages: list[Any], tracker: Any, counter: Any, mesh: Any, schedule: str, pp: int,
                   pp_rank: int, n_microbatches: int) -> Any:
        """The :class:`~vemesh.planning.pipeline_replay.Replay` of one rank's trace, watching ``stages`` when this
        plan replays and the schedule's backward is one pass."""
        replay = Replay(tracker, counter, mesh, schedule, pp, pp_rank, n_microbatches, self.records)
        if self.replay and schedule in REPLAYED_SCHEDULES:
            replay.attach(stages)
        self.replays.append(replay)
        return replay

    def wrongly_derived(self) -> list[int]:
        """The stages whose derived gradient shapes differ from what the stage after them sent."""
        return [s for s, meta in self.derived.items() if s + 1 in self.backward and self.backward[s + 1] != meta]


def pipeline_stages(returned: Any, name: str, pp_rank: int, pp: int, schedule: str) -> list[Any]:
    """The stages ``--parallelize`` returned on PP rank ``pp_rank``, checked against the schedule's placement."""
    from torch.distributed.pipelining.stage import _PipelineStageBase

    stages = [returned] if isinstance(returned, _PipelineStageBase) else returned
    if not isinstance(stages, (list, tuple)) or not stages or \
            not all(isinstance(s, _PipelineStageBase) for s in stages):
        raise ValueError(f"--parallelize {name} returned {type(returned).__name__}; with PP it returns this rank's "
                         "pipeline stages: a torch.distributed.pipelining.PipelineStage, or a list of them (one per "
                         f"stage this rank holds: {stages_per_rank(schedule)} for --pp-schedule {schedule})")
    want = stage_indices(pp_rank, pp, schedule)
    got = [s.stage_index for s in stages]
    n_stages = pp * stages_per_rank(schedule)
    if sorted(got) != want or any(s.num_stages != n_stages for s in stages):
        raise ValueError(f"--parallelize {name} returned stages {got} of {stages[0].num_stages} on PP rank {pp_rank}; "
                         f"--pp-schedule {schedule} over PP {pp} runs {n_stages} stages and places {want} on this rank "
                         "(vemesh.parallel.schedules.stage_indices)")
    return sorted(stages, key=lambda s: s.stage_index)


def build_schedule(stages: list[Any], schedule: str, n_microbatches: int, loss_fn: Callable[..., Any],
                   exchange: MetaExchange) -> Any:
    """torch's ``schedule`` class over ``stages``, its shapes carried by ``exchange`` (see the module docstring)."""
    from torch.distributed.pipelining.stage import InferenceMode, PipelineStage

    for stage in stages:
        if isinstance(stage, PipelineStage):  # torch's tracer frontend's stages (pipe.build_stage) know their shapes
            exchange.attach(stage)
    run = schedule_class(schedule)(stages if schedule in MULTI_STAGE else stages[0], n_microbatches, loss_fn=loss_fn)

    def infer_shapes(stages: list[Any], has_backward: bool, p2p_done: bool) -> None:
        for stage in stages:  # what the vote decides when shapes are not all given: infer them (and check those given)
            stage._inference_mode = InferenceMode.DYNAMIC

    run._warmup_p2p = infer_shapes
    return run


class _Held:
    """A send or receive that keeps its tensors as the backend's work does: gloo's until the work object is dropped
    (waited on or not: measured, a waited send's tensor is freed only when its work goes), nccl's until it is waited
    on (``released_at_wait``: its work unstashes the tensors there for the caching allocator, torch's default; read
    in torch's ``ProcessGroupNCCL``, not measured: no GPU here)."""

    def __init__(self, work: Any, tensors: list[Any], released_at_wait: bool) -> None:
        self.work, self.tensors, self.released_at_wait = work, tensors, released_at_wait

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if self.released_at_wait:
            self.tensors = []
        return self.work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.work, name)


@contextlib.contextmanager
def sends_hold_tensors(device: str = "cpu") -> Iterator[None]:
    """Inside, the schedules' sends and receives hold their tensors as the backend of ``device`` does (:class:`_Held`:
    gloo's on "cpu" until the work is dropped, nccl's until it is waited on). On the fake backend a send is done at
    once and keeps nothing; on gloo or nccl its work keeps the tensor. torch's multi-stage schedules wait on their sends
    only at the end of the step, so every input gradient sent back is held until then; its 1F1B keeps the works of the
    last send its warm-up fires alone until its steady state ends, so on gloo that micro-batch's output is held past
    its backward (HF Llama with eager attention over PP 2: the first PP rank's peak, one hidden state more,
    measured)."""
    from torch.distributed.pipelining import schedules

    real = schedules._batch_p2p

    def batch_p2p(p2p_ops: list[Any], desc: str | None = None) -> list[Any]:
        tensors = [op.tensor for op in p2p_ops]
        return [_Held(work, tensors, device != "cpu") for work in real(p2p_ops, desc)]

    schedules._batch_p2p = batch_p2p
    try:
        yield
    finally:
        schedules._batch_p2p = real
