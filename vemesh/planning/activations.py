"""Activations and in-model traffic of one micro-batch, traced on fake tensors: the planner's dynamic half.

:func:`trace_stage` builds the GPT example's model with a few blocks under torch's ``FakeTensorMode``
(no memory, no compute, so the 70B width costs what 2 blocks of it cost), applies the example's own
tensor parallelism (``vemesh.models.gpt.apply_tp``), ``ExpertParallel`` and ``context_parallel`` on torch's
fake backend, and runs one micro-batch forward and backward inside torch's ``MemTracker`` and
:class:`~vemesh.planning.measure.CollectiveBytes`. It reports what the planner scales by the number of
blocks and the schedule's micro-batches in flight:

* ``retained``: the bytes held when the forward has ended (what backward needs, the output, the loss);
* ``peak``: the highest bytes of the forward and backward, parameters and gradients left out (the
  planner counts those once, as the wrappers hold them);
* ``sent``: the bytes of the TP and CP collectives, by mesh name.

A trace of 1 and of 2 blocks gives the per-block figures by difference (blocks are identical). The
trace needs no process group of the caller's: it makes a fake world of TP x CP ranks and destroys it.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from vemesh.mesh.manager import VeDeviceMesh
from vemesh.models.gpt import model as model_module
from vemesh.models.gpt.parallelize import apply_tp
from vemesh.parallel import ExpertParallel, context_parallel
from vemesh.planning.fake_world import local_shards, quiet_sharding_propagation
from vemesh.planning.measure import CollectiveBytes, by_mesh_name, ops_by_mesh_name
from vemesh.planning.fusion import step_counters
from vemesh.planning.routing import routing
from vemesh.planning.step_tracker import StepTracker
from vemesh.planning.wrapper_costs import build_gpt

__all__ = ["ROLES", "Trace", "add_ops", "trace_stage"]

#: What a pipeline stage holds besides its blocks: ``whole`` (no PP), ``first``, ``middle``, ``last``.
ROLES = ("whole", "first", "middle", "last")


@dataclass(frozen=True)
class Trace:
    """One micro-batch through a stage (see the module docstring); what a step-time prediction needs when traced
    ``timed`` (else 0): the FLOPs, the memory-bound bytes, the ops dispatched, and the collectives by mesh name and
    op, ``(bytes, calls)``."""

    retained: int
    peak: int
    sent: tuple[tuple[str, int], ...]
    flops: int = 0
    memory_bytes: int = 0
    ops: int = 0
    dtensor_ops: int = 0
    by_op: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict, compare=False)
    #: what :class:`vemesh.planning.fusion.Fusion` counts (the transcendental ops' bytes, attention's FLOPs by shape)
    counts: dict[str, int] = field(default_factory=dict, compare=False)

    def plus(self, other: Trace, times: int) -> Trace:
        """This trace and ``times`` x ``other`` (a per-block difference)."""
        mine, theirs = dict(self.sent), dict(other.sent)
        return Trace(self.retained + times * other.retained, self.peak + times * other.peak,
                     tuple((k, mine.get(k, 0) + times * theirs.get(k, 0)) for k in sorted(set(mine) | set(theirs))),
                     self.flops + times * other.flops, self.memory_bytes + times * other.memory_bytes,
                     self.ops + times * other.ops, self.dtensor_ops + times * other.dtensor_ops,
                     add_ops(self.by_op, other.by_op, times), _add(self.counts, other.counts, times))

    def __sub__(self, other: Trace) -> Trace:
        mine, theirs = dict(self.sent), dict(other.sent)
        return Trace(self.retained - other.retained, self.peak - other.peak,
                     tuple((k, mine.get(k, 0) - theirs.get(k, 0)) for k in sorted(set(mine) | set(theirs))),
                     self.flops - other.flops, self.memory_bytes - other.memory_bytes, self.ops - other.ops,
                     self.dtensor_ops - other.dtensor_ops, add_ops(self.by_op, other.by_op, -1),
                     _add(self.counts, other.counts, -1))


def _add(a: dict[str, int], b: dict[str, int], times: int) -> dict[str, int]:
    """``a + times x b``, key by key."""
    return {k: a.get(k, 0) + times * b.get(k, 0) for k in sorted(set(a) | set(b))}


def add_ops(a: dict[str, dict[str, tuple[int, int]]], b: dict[str, dict[str, tuple[int, int]]],
            times: int) -> dict[str, dict[str, tuple[int, int]]]:
    """``a + times x b`` of ``(bytes, calls)`` by mesh name and op."""
    out = {}
    for dim in sorted(set(a) | set(b)):
        x, y = a.get(dim, {}), b.get(dim, {})
        out[dim] = {op: (x.get(op, (0, 0))[0] + times * y.get(op, (0, 0))[0],
                         x.get(op, (0, 0))[1] + times * y.get(op, (0, 0))[1]) for op in sorted(set(x) | set(y))}
    return out


@contextmanager
def _fake_world(tp: int, cp: int, ep: int = 1) -> Iterator[object | None]:
    """A fake world of EP x CP x TP ranks (rank 0) with its vemesh mesh, or None when all are 1.

    (In a run EP folds over the DP x CP ranks; a trace needs only a group of its size.)
    """
    if tp == 1 and cp == 1 and ep == 1:
        yield None
        return
    if dist.is_initialized():
        raise RuntimeError("the planner traces TP and CP on torch's fake backend, in a world of its own; "
                           "call it before init_process_group (or in another process)")
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=0, world_size=ep * tp * cp, store=FakeStore())
    try:
        mesh = VeDeviceMesh()
        dims = [(n, s) for n, s in (("EP", ep), ("CP", cp), ("TP", tp)) if s > 1]
        mesh.init_device_mesh("cpu", tuple(s for _, s in dims), mesh_dim_names=tuple(n for n, _ in dims))
        yield mesh
    finally:
        dist.destroy_process_group()


def trace_stage(config: tuple[tuple[str, int], ...], *, blocks: int, role: str, micro_batch: int, tp: int = 1,
                cp: int = 1, sequence_parallel: bool = False, dtype: str = "fp32", checkpointing: bool = False,
                ep: int = 1, load_factor: float = 1.0, timed: bool = False) -> Trace:
    """One micro-batch of ``micro_batch`` sequences through a stage of ``blocks`` blocks (``timed``: also what a
    step-time prediction needs, see :class:`Trace`).

    ``config`` is the GPTConfig fields as sorted pairs (hashable, for the cache); ``role`` one of
    :data:`ROLES`; the sequence is ``block_size // cp`` tokens on this rank; ``checkpointing`` recomputes
    each block in backward, as the example's ``--activation-checkpointing``; ``load_factor``
    is the busiest EP rank's share of the slots over the balanced one (:mod:`vemesh.planning.routing`). Up to 2 blocks are traced
    as they are. More are the role's 2-block trace plus, per extra block, the difference between a
    2- and a 1-block middle stage: the blocks are identical, and each extra block's saved activations
    are held through the backward of the last two, where the peak of the 2-block stage is.
    """
    args = (micro_batch, tp, cp, sequence_parallel, dtype, checkpointing, ep, load_factor, timed)
    if blocks <= 2:
        return _trace(config, blocks, role, *args)
    two = _trace(config, 2, role, *args)
    per_block = _trace(config, 2, "middle", *args) - _trace(config, 1, "middle", *args)
    # each extra block's saved activations are held through the peak: it grows by what a block retains
    return replace(two.plus(per_block, blocks - 2), peak=two.peak + (blocks - 2) * per_block.retained)


@functools.lru_cache(maxsize=256)
def _trace(config: tuple[tuple[str, int], ...], blocks: int, role: str, micro_batch: int, tp: int, cp: int,
           sequence_parallel: bool, dtype: str, checkpointing: bool, ep: int = 1, load_factor: float = 1.0,
           timed: bool = False) -> Trace:
    from torch.distributed.tensor.parallel import parallelize_module

    if role not in ROLES:
        raise ValueError(f"role must be one of {', '.join(ROLES)}; got {role!r}")
    cfg = model_module.GPTConfig(**dict(config, n_layer=blocks, dropout=0.0))
    width = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    tokens = cfg.block_size // cp
    with _fake_world(tp, cp, ep) as mesh, FakeTensorMode(allow_non_fake_inputs=True), \
            routing(load_factor), local_shards():
        model = build_gpt(cfg, width)
        model.checkpoint_blocks = checkpointing  # the example's --activation-checkpointing
        if role in ("middle", "last"):
            model.wte = model.wpe = None
        if role in ("first", "middle"):
            model.ln_f = model.lm_head = None
        if ep > 1:
            for moe in model.moe_layers():
                parallelize_module(moe.experts, mesh["EP"], ExpertParallel())
        if tp > 1:
            model = apply_tp(model, mesh["TP"], sequence_parallel=sequence_parallel)
        tracker, counter = StepTracker(module_hooks=False), CollectiveBytes()  # no per-module statistics: faster
        tracker.track_weights(model)
        # with CP the step runs as the example's does, inside context_parallel (ring attention; this rank's
        # positions); the tokens are made at this rank's length, so only the position table is cut
        buffers = [model.pos] if cp > 1 and model.wte is not None else []
        cut = context_parallel(mesh["CP"], buffers=buffers, buffer_seq_dims=[0] * len(buffers),
                               load_balance=False) if cp > 1 else contextlib.nullcontext()
        def forward() -> tuple[torch.Tensor, torch.Tensor | None]:
            if role in ("whole", "first"):
                x = torch.randint(0, cfg.vocab_size, (micro_batch, tokens))
            else:
                x = torch.zeros(micro_batch, tokens // (tp if sequence_parallel else 1), cfg.n_embd, dtype=width,
                                requires_grad=True)  # what the stage before sends (sequence-sharded under SP)
            out = model(x)
            if role in ("whole", "last"):
                targets = torch.randint(0, cfg.vocab_size, (micro_batch, tokens))
                return F.cross_entropy(out.float().view(-1, out.size(-1)), targets.view(-1)), None  # the example's loss
            return out, torch.zeros_like(out)  # the gradient a later stage sends back

        # DTensor's sharding propagation runs each op it has not seen on fake tensors of the global shapes; counted,
        # a process's first TP stage had 2.6 times its FLOPs (the traced plan keeps it out the same way)
        with tracker, counter, cut, quiet_sharding_propagation(), step_counters(timed) as (flop_counter, memory_bound):
            counter.counting = True
            out, grad = forward()
            retained = _total(tracker.get_tracker_snapshot("current"), "Parameter")
            out.backward(grad)
            peak = tracker.peak_besides_weights
        sent = by_mesh_name(counter.bytes, mesh) if mesh is not None else {}
        by_op = ops_by_mesh_name(counter.by_op, mesh) if mesh is not None else {}
    return Trace(retained, peak, tuple(sorted(sent.items())), flop_counter.get_total_flops(), memory_bound.bytes,
                 memory_bound.ops, memory_bound.dtensor_ops, by_op,
                 memory_bound.counts())


def _total(snapshot: dict, *minus: str) -> int:
    total = 0
    for categories in snapshot.values():
        named = {str(getattr(k, "value", k)): v for k, v in categories.items()}
        total += named["Total"] - sum(named.get(m, 0) for m in minus)
    return total
