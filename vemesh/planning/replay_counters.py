"""A pipeline trace's counters as one value, for :mod:`vemesh.planning.pipeline_replay`: a snapshot, the change
between two, and that change played again.

The counters are the trace's: :class:`~vemesh.planning.measure.CollectiveBytes` (by group name, recorded by mesh dim
so that another rank's trace of the same plan can replay them on its own groups), and each step's
:class:`~vemesh.planning.fusion.MemoryBoundBytes`, which counts the FLOPs by torch's ``FlopCounterMode``
formulas, with its compile :class:`~vemesh.planning.fusion.Fusion`.
"""

from __future__ import annotations

from typing import Any

import torch

from vemesh.planning.measure import mesh_names

__all__ = ["StepCounters", "minus", "op_name"]


class StepCounters:
    """The counters of one rank's trace; :attr:`flops` and :attr:`moved` are set at each step."""

    def __init__(self, collectives: Any, mesh: Any) -> None:
        self.collectives, self.mesh = collectives, mesh
        self.flops: Any = None
        self.moved: Any = None
        self._dims: dict[str, str] | None = None  #: group name -> mesh dim, of this trace's fake world

    def snapshot(self) -> tuple:
        """Every counter now: FLOPs by op, memory-bound bytes and ops, compile's counts, collectives by mesh dim (each
        op's bytes and calls; the ops' names a group ran, :attr:`CollectiveBytes.ops`, follow from them)."""
        c = self.collectives
        flops = dict(self.flops.flop_counts.get("Global", {})) if hasattr(self.flops, "flop_counts") else {}
        moved = (self.moved.bytes, self.moved.ops, self.moved.dtensor_ops)
        fusion = getattr(self.moved, "fusion", None)
        fused = (fusion.region, fusion.is_open, fusion.counts()) if fusion is not None else ()
        dim = self._dim
        collectives = {dim(g): (c.bytes.get(g, 0), c.calls.get(g, 0), {op: tuple(v) for op, v in c.by_op.get(g, {}).items()})
                       for g in set(c.bytes) | set(c.by_op)}
        return flops, moved, fused, collectives

    def _dim(self, group_name: str) -> str:
        """A collective's group by its mesh dim (what another rank's trace of the plan knows it by)."""
        if self._dims is None:
            self._dims = mesh_names(self.mesh)
        return self._dims.get(group_name, group_name)

    def _group(self, dim: str) -> str:
        """The group name of ``dim`` in this trace's fake world."""
        self._dim("")
        return next((g for g, d in self._dims.items() if d == dim), dim)

    def restore(self, state: tuple) -> None:
        """The counters as they were (the replay's own allocations are not the step's ops)."""
        flops, moved, fused, collectives = state
        if hasattr(self.flops, "flop_counts"):
            self.flops.flop_counts["Global"].clear()
            self.flops.flop_counts["Global"].update(flops)
        self.moved.bytes, self.moved.ops, self.moved.dtensor_ops = moved
        fusion = getattr(self.moved, "fusion", None)
        if fusion is not None:
            fusion.region, fusion.is_open = fused[0], fused[1]
            fusion.set_counts(fused[2])

    def advance(self, delta: tuple) -> None:
        flops, moved, fused, collectives = delta
        if hasattr(self.flops, "flop_counts"):
            for op, n in flops:
                self.flops.flop_counts["Global"][op] += n
        self.moved.bytes += moved[0]
        self.moved.ops += moved[1]
        self.moved.dtensor_ops += moved[2]
        fusion = getattr(self.moved, "fusion", None)
        if fusion is not None:
            fusion.region += fused[0]
            fusion.is_open = fused[1]
            fusion.set_counts(dict(fused[2]), add=True)
        c = self.collectives
        for dim, (b, n, by_op) in collectives:
            g = self._group(dim)
            c.bytes[g] += b
            c.calls[g] += n
            for op, (ob, on) in by_op:
                c.by_op[g][op][0] += ob
                c.by_op[g][op][1] += on
                c.ops[g].add(op_name(op))

    def fusion_of(self, flat: tuple) -> tuple:
        """Per tensor of ``flat``: (the region that wrote it, relative to the current one, or None for another op;
        its bytes not paid yet), or None when compile's fusion has not seen it written."""
        fusion = getattr(self.moved, "fusion", None)
        if fusion is None:
            return ()
        out = []
        for t in flat:
            if not isinstance(t, torch.Tensor):
                out.append(None)
                continue
            producer, pending = fusion.writer_of(t)
            out.append(None if producer is None else (producer - fusion.region if producer >= 0 else None, pending))
        return tuple(out)

    def pend(self, made: list, fusion_of: tuple) -> None:
        """What compile's fusion knows of the returned tensors: who wrote them, what of them is not paid yet."""
        fusion = getattr(self.moved, "fusion", None)
        if fusion is None:
            return
        for t, known in zip(made, fusion_of):
            if t is None or known is None:
                continue
            relative, pending = known
            fusion.wrote(t, fusion.region + relative if relative is not None else -1, pending)



def minus(after: tuple, before: tuple) -> tuple:
    """The counters' change from ``before`` to ``after`` (:meth:`StepCounters.snapshot`), comparable and hashable."""
    flops = tuple(sorted(((op, n - before[0].get(op, 0)) for op, n in after[0].items() if n != before[0].get(op, 0)),
                         key=lambda item: str(item[0])))
    moved = tuple(a - b for a, b in zip(after[1], before[1]))
    fused = ((after[2][0] - before[2][0], after[2][1],
              tuple(sorted((k, v - before[2][2].get(k, 0)) for k, v in after[2][2].items() if v != before[2][2].get(k, 0))))
             if after[2] else ())
    collectives = []
    for g, (b, n, by_op) in sorted(after[3].items()):
        b0, n0, by0 = before[3].get(g, (0, 0, {}))
        ops = tuple(sorted((op, (v[0] - by0.get(op, (0, 0))[0], v[1] - by0.get(op, (0, 0))[1]))
                           for op, v in by_op.items() if v != by0.get(op, (0, 0))))
        if b != b0 or n != n0 or ops:
            collectives.append((g, (b - b0, n - n0, ops)))
    return flops, moved, fused, tuple(collectives)


def op_name(key: str) -> str:
    """The op a collective counted under ``key`` ran (:class:`~vemesh.planning.measure.CollectiveBytes` keys a few
    values' all-reduce ``allreduce_[1]`` and a matmul's reduce-scatter ``reduce_scatter_tensor@FLOPS``)."""
    return key.split("[")[0].split("@")[0]
