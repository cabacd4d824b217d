"""The parts of a traced step, cut at its stack of identical blocks, so that each part's peak is scaled on its own.

A model of ``n`` identical blocks is traced with 3 and 4 of them and the rest added by difference
(:func:`vemesh.planning.user_model.predict_user`), part by part (:meth:`vemesh.planning.results.Counted.scaled`). A
difference of two peaks is right only when both fall at the same moment of the step, and with few blocks they may
not: Llama 3 8B under FSDP2 with sequences of 1024 peaks at the end of its backward with 2 or 3 blocks (the head's and
the embedding's unsharded fp32 gradients), and with 32 where the forward has ended and every block's activations
are held (without activation checkpointing). Taken as one part, the step's peak was scaled from the wrong moment:
9.49 GiB where tracing all 32 blocks says 20.55.

:func:`step_parts` cuts the step where the blocks begin and end, as the tracker's :attr:`part`:

* ``""``: the forward before the blocks (the embedding);
* ``" blocks"``: the forward of every block but the last, which peaks where their activations are all held;
* ``" last block"``: the last block's forward;
* ``" head"``: what comes after the blocks in the forward (the head, the loss) and in the backward before them;
* ``" last backward"``: the last block's backward, from the gradient of its output to that of its input;
* ``" backward"``: the other blocks' backward, to the gradient of the first block's input;
* ``" tail"``: the rest (the embedding's backward, the gradients' reduction, the loop's own end of the step).

Cut so, each part peaks at the same moment whatever the number of blocks (the middle blocks, alike, join the part of
the blocks before the last: their forward peaks at its end, their backward at its start).

With PP (:func:`pipeline_parts`) each forward and backward a stage runs is a phase of its own, named by its place in
the step's actions (``"step#5 B1"``: the step's sixth action, a backward of stage 1), and cut as above at the stage's
own blocks. The pipeline's traces with 3 and 4 blocks a stage run the same actions, so each part of each action is
scaled on its own: a difference of the whole step's peaks put PP rank 0 of a 24-block test Llama at 0.937 of its
whole trace.

A forward that runs inside the backward (activation checkpointing's recompute) moves nothing. A block whose output
or input needs no gradient leaves the parts after it uncut (the peak is then what it was without them).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["BY_DIFFERENCE_FROM", "LOW_HIGH", "BlocksNotFound", "collapse_actions", "pipeline_parts", "stage_blocks",
           "stage_slots", "step_parts"]

#: the blocks traced when the rest are added by difference (per stage with PP): 3 and 4, so that each part of the
#: step peaks at the same moment in both traces (with 2 the blocks' backward holds no FSDP2 prefetch, which 3 and
#: more do)
LOW_HIGH = (3, 4)
#: the fewest identical blocks traced by difference, per stage with PP: a model (a stage) of 7 or fewer is cheaper
#: traced at once (a pipeline of 5 blocks a stage took 1.45 to 1.55 times as long by difference as traced whole)
BY_DIFFERENCE_FROM = 8


def _needing_grad(value: Any) -> torch.Tensor | None:
    return next((t for t in tree_leaves(value) if isinstance(t, torch.Tensor) and t.requires_grad), None)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


class BlocksNotFound(LookupError):
    """A stage's module holds fewer than two of the model's blocks where :func:`pipeline_parts` looks: its actions
    cannot be cut at them, and a difference of the uncut actions' peaks is not exact by construction."""


@contextlib.contextmanager
def step_parts(tracker: Any, blocks: list[nn.Module]) -> Iterator[None]:
    """Set ``tracker.part`` as the step passes ``blocks`` (the first and last, in their order; two at least; fewer:
    no parts), while the context is open."""
    if len(blocks) < 2:
        yield
        return

    def to(part: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            tracker.part = part
        return hook

    def enter(part: str, then: str, *, output: bool = False) -> Any:
        """A forward hook: ``part`` from here, ``then`` once the gradient of the block's input (its first tensor that
        needs one, positional or keyword), or of its output, is made."""
        def hook(module: nn.Module, args: Any, kwargs: Any, out: Any = None) -> None:
            if _in_backward():  # activation checkpointing's recompute
                return
            tracker.part = part
            if (t := _needing_grad(out if output else (args, kwargs))) is not None:
                t.register_hook(to(then))
        return hook

    first, last = blocks[0], blocks[-1]
    handles = [first.register_forward_pre_hook(enter(" blocks", " tail"), with_kwargs=True),
               last.register_forward_pre_hook(enter(" last block", " backward"), with_kwargs=True),
               last.register_forward_hook(enter(" head", " last backward", output=True), with_kwargs=True)]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


#: the actions of a stage that :func:`pipeline_parts` names a phase: torch's ``PipelineStage`` methods, by kind
ACTIONS = (("forward_one_chunk", "F"), ("backward_one_chunk", "B"), ("backward_weight_one_chunk", "W"))


def stage_blocks(submod: nn.Module, path: str, kind: type) -> list[nn.Module]:
    """The blocks in a stage's module: the children of the module at ``path`` (where the model holds them), or under
    the stage's wrappers (``module.layers`` of a DDP); else the children of the module with the most children that
    each hold one module of class ``kind`` (a stage that keeps them under a name of its own, ``self.blocks``, each
    perhaps in a wrapper of its own, such as activation checkpointing's), two at least; else none."""
    named = next((m for name, m in submod.named_modules() if name == path or name.endswith("." + path)), None)
    if named is not None and len(list(named.children())) >= 2:
        return list(named.children())

    def holds_one(child: nn.Module) -> bool:
        return sum(isinstance(m, kind) for m in child.modules()) == 1

    best = max(([c for c in m.children() if holds_one(c)] for m in submod.modules()), key=len, default=[])
    return best if len(best) >= 2 else []


@contextlib.contextmanager
def pipeline_parts(tracker: Any, stages: list[Any], blocks: tuple[str, type] | None) -> Iterator[None]:
    """While open, each action of ``stages`` (torch's ``PipelineStage``) runs as a phase of its own, named by its place
    in the step (see the module docstring), and, with ``blocks`` (where the model holds its blocks and their class:
    ``("layers", Block)``), is cut at its stage's blocks (:func:`stage_blocks`) by :func:`step_parts`. Between actions
    the phase is the step's again.

    Raises:
        BlocksNotFound: with ``blocks``, a stage whose module holds fewer than two of them, at the path or under any
            one module.
    """
    counts: dict[str, int] = {}

    def action(real: Any, kind: str, index: int) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            base = tracker.phase
            if base is None:
                return real(*args, **kwargs)
            counts[base] = counts.get(base, 0) + 1
            tracker.phase = f"{base}#{counts[base] - 1} {kind}{index}"
            try:
                return real(*args, **kwargs)
            finally:
                tracker.phase = base
        return run

    with contextlib.ExitStack() as stack:
        for stage in stages:
            if blocks is not None:
                found = stage_blocks(stage.submod, *blocks)
                if not found:
                    raise BlocksNotFound(f"stage {stage.stage_index}'s module holds fewer than two {blocks[1].__name__} "
                                         f"blocks, at {blocks[0]!r} or under any one module")
                stack.enter_context(step_parts(tracker, found))
            for name, kind in ACTIONS:
                if hasattr(stage, name):
                    real, own = getattr(stage, name), name in vars(stage)  # own: a wrapper set on the instance
                    setattr(stage, name, action(real, kind, stage.stage_index))
                    stack.callback(*(setattr, stage, name, real) if own else (delattr, stage, name))
        yield


def collapse_actions(phases: dict[str, Any]) -> dict[str, Any]:
    """``phases`` with each action's number dropped (``"step#5 B1 backward"`` -> ``"step B1 backward"``), each kept
    at its highest: what two pipeline traces of different micro-batch counts both have, to be scaled part by part."""
    out: dict[str, Any] = {}
    for key, value in phases.items():
        base, hash_, rest = key.partition("#")
        name = base + " " + rest.partition(" ")[2] if hash_ else key
        if name not in out or value[0] > out[name][0]:
            out[name] = value
    return out


def stage_slots(phases: dict[str, Any], stages: list[int]) -> dict[str, Any]:
    """``phases`` with each action's stage named by its place among ``stages`` (the stages of the PP rank that ran
    them): ``"step#5 B3 backward"`` -> ``"step#5 B@0 backward"`` on the rank holding stage 3 alone."""
    slots = {s: i for i, s in enumerate(stages)}
    return {re.sub(r" ([FBW])(\d+)", lambda m: f" {m.group(1)}@{slots[int(m.group(2))]}", key): value
            for key, value in phases.items()}
