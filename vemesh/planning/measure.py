"""Measure what each rank of a run holds and sends: the other side of ``vemesh plan --model``.

:class:`RunMeter` wraps a stretch of training in two of torch's dispatch-level tools and reports
per rank:

* **peak memory**: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), which sees every tensor
  storage that an op creates inside its context, with its category (parameter, gradient, optimizer state,
  activation, temporary). Enter the meter before the model is built and everything the run allocates is counted;
* **bytes and calls per mesh dim**: every collective on the dispatcher (``c10d`` ops of ``torch.distributed``
  calls, the functional collectives of DTensor, FSDP2 and pipelining), attributed to the mesh name whose process
  group it ran on, through torch's own ``CollectiveOp.get_process_group`` (torch's default group: ``world``).

The bytes of one collective are the size of its tensor, as nccl-tests counts it: an all-reduce its buffer, an
all-gather the gathered output, a reduce-scatter its full input, an all-to-all its input, a broadcast its tensor,
a point-to-point transfer the bytes this rank sends (a PP send is counted once, by its sender). Collectives on meta
tensors (a pipeline stage's shape inference) are not counted; the bytes per step are counted from the second step
on, since the first also runs one-time work. :mod:`vemesh.planning.fit` predicts the same figures by the same rules.
"""

from __future__ import annotations

import math
import weakref
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed._tools.fake_collectives import CollectiveOp, collective_ops
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from vemesh.planning.step_time import WORLD
from vemesh.planning.step_tracker import StepTracker, answer_device, device_query
from vemesh.planning.tp_overlap import FedMatmuls

__all__ = ["CollectiveBytes", "RunMeter", "by_mesh_name", "mesh_names", "ops_by_mesh_name", "payload_bytes"]

_c10d = torch.ops.c10d
_func = torch.ops._c10d_functional
_NOT_COUNTED = {_c10d.recv_.default, _c10d.recv_any_source_.default, _c10d.barrier.default,
                _c10d.monitored_barrier_.default, _func.wait_tensor.default}
_OUTPUT_SIZED = {_c10d._allgather_base_.default, _c10d.allgather_.default, _c10d.allgather_into_tensor_coalesced_.default}
#: functional all-gathers: the gathered result is their size
_GATHERED = {_func.all_gather_into_tensor.default, _func.all_gather_into_tensor_coalesced.default,
             _func.all_gather_into_tensor_out.default, torch.ops._c10d_functional_autograd.all_gather_into_tensor.default}


def _grouped_mm_flops(a_shape: Any, b_shape: Any, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """FLOPs of ``aten._grouped_mm`` (a MoE's experts in one call; torch's FlopCounterMode has no formula for it):
    every output element is a dot product over the contracted dim, except 2-D x 2-D, whose groups split that dim."""
    if len(a_shape) == 2 and len(b_shape) == 2:  # [M, K] x [K, N], K cut into groups: out [G, M, N]
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    return 2 * a_shape[-1] * math.prod(out_shape)


def _attention_flops(q: Any, k: Any, causal: bool, matmuls: int) -> int:
    """``matmuls`` products of ``[T, d] x [d, S]`` per batch and query head (grouped KV heads serve several query
    heads: the work is per query head), half of it under a causal mask (flash attention skips the masked blocks)."""
    b, h, t, d = q
    flops = 2 * matmuls * b * h * t * k[2] * d
    return flops // 2 if causal else flops


def _cpu_flash_flops(q: Any, k: Any, v: Any, dropout_p: float = 0.0, is_causal: bool = False, *args: Any,
                     out_shape: Any = None, **kwargs: Any) -> int:
    """The planner's attention on CPU fake tensors (``_scaled_dot_product_flash_attention_for_cpu``, which torch's
    counter does not know): Q K^T and P V."""
    return _attention_flops(q, k, is_causal, 2)


def _cpu_flash_backward_flops(grad: Any, q: Any, k: Any, v: Any, out: Any, lse: Any, dropout_p: float = 0.0,
                              is_causal: bool = False, *args: Any, out_shape: Any = None, **kwargs: Any) -> int:
    """Its backward, as flash attention's: Q K^T again, and dV, dP, dQ, dK."""
    return _attention_flops(q, k, is_causal, 5)


#: FLOP formulas for the ops torch's FlopCounterMode does not count (by overload packet, in its shape convention)
FLOP_FORMULAS = {torch.ops.aten._grouped_mm: _grouped_mm_flops,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _cpu_flash_flops,
                 torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _cpu_flash_backward_flops}


def _nbytes(value: Any) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def payload_bytes(func: Any, args: tuple, result: Any) -> int:
    """The size of one collective's tensor (see the module docstring for which tensor)."""
    if func in _OUTPUT_SIZED:
        return _nbytes(args[0])
    if func in (_c10d._reduce_scatter_base_.default, _c10d.reduce_scatter_.default):
        return _nbytes(args[1])
    if func in _GATHERED:
        return _nbytes(result)
    return _nbytes(args[0])


def _few_values(op: str, args: tuple, n: int) -> int | None:
    """The values of an all-reduce of fewer than ``2n`` over ``n`` ranks (a loss, a norm), else None (see step_time)."""
    first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
    few = op in ("allreduce_", "all_reduce") and isinstance(first, torch.Tensor) and first.numel() < 2 * n
    return first.numel() if few else None


def _on_meta(args: tuple) -> bool:
    """A collective on meta tensors (a pipeline stage's shape inference) moves no bytes."""
    first = args[0][0] if isinstance(args[0], (list, tuple)) and args[0] else args[0]
    return isinstance(first, torch.Tensor) and first.is_meta


#: the collectives that gloo runs on a copy of their whole input (``args[1]``), which it holds through the call:
#: ``dist.reduce_scatter_tensor`` (FSDP2's gradient reduction) copies its input into a buffer of its own,
#: all-reduces that, and copies this rank's chunk out (a 1 MiB fp32 reduce-scatter on 2 gloo ranks: torch's
#: MemTracker sees 1 MiB more, split from a buffer no op made; the functional collective copies nothing, nor, by its
#: API, nccl: not measured here)
GLOO_COPIES = (_c10d._reduce_scatter_base_.default,)


class CollectiveBytes(TorchDispatchMode):
    """Counts the bytes of every collective by its process group's ``group_name``.

    Counting happens only while :attr:`counting` is true; :func:`by_mesh_name` names the groups.
    """

    def __init__(self, gloo: bool = False) -> None:
        super().__init__()
        #: a plan for gloo (``--device-type cpu``): each ``reduce_scatter_tensor`` holds a copy of its whole input
        #: through the collective, as gloo's does (:data:`GLOO_COPIES`); a run's own gloo makes it itself
        self.gloo = gloo
        self.bytes: dict[str, int] = defaultdict(int)
        self.calls: dict[str, int] = defaultdict(int)
        self.ops: dict[str, set[str]] = defaultdict(set)  #: the ops run on each group (by ``group_name``)
        #: ``[bytes, calls]`` by ``group_name`` and op (what a step-time prediction times); an all-reduce of fewer
        #: values than twice its group's ranks is keyed apart, ``allreduce_[1]``, with its count of values
        self.by_op: dict[str, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))
        self.groups: dict[str, dist.ProcessGroup] = {}
        self.counting = False
        self.fed = FedMatmuls(self.by_op)  #: which gathers and scatters async TP would overlap with their matmuls
        #: the outputs of torch's functional collectives that no op has read yet, each under a number of its own (a
        #: freed one's id is another tensor's later): number -> (a weak reference, bytes); in a run one never read is
        #: never waited on, and torch's work registry holds it (:meth:`unwaited`)
        self.pending: dict[int, tuple[Any, int]] = {}
        self._numbers: dict[int, int] = {}  #: a pending tensor's id -> its number
        self._issued = 0  #: the last number given

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if device_query(func, args):
            return answer_device(args[0])
        if any(t is DTensor for t in types):  # let DTensor turn itself into local ops and collectives first
            return NotImplemented
        copy = torch.empty_like(args[1]) if self.gloo and func in GLOO_COPIES else None  # freed after the call
        result = func(*args, **(kwargs or {}))
        del copy
        if self.pending or func.namespace == "_c10d_functional":
            self._watch_reads(func, args, result)
        if self.counting:
            self.fed.see(func, args, result)
        if self.counting and func in collective_ops and func not in _NOT_COUNTED and not _on_meta(args):
            group = CollectiveOp.get_process_group(func, args)
            name = group.group_name
            size = payload_bytes(func, args, result)
            op = func.__name__.split(".")[0]
            self.bytes[name] += size
            self.calls[name] += 1
            self.ops[name].add(op)
            few = _few_values(op, args, dist.get_world_size(group))
            key = op if few is None else f"{op}[{few}]"  # a loss or a norm: timed apart (step_time.collective_seconds)
            key = self.fed.key_of(func, args, key)
            self.by_op[name][key][0] += size
            self.by_op[name][key][1] += 1
            self.fed.counted(func, result, name, key, size)
            self.groups[name] = group
        return result

    def _watch_reads(self, func: Any, args: tuple, result: Any) -> None:
        """Each functional collective's output, until an op reads it. Under fake tensors torch waits on it at once
        (``_functional_collectives._are_we_tracing``); in a run it is an ``AsyncCollectiveTensor``, waited on when
        an op first reads it (a view keeps it pending), so one that no op reads is never waited on."""
        outputs = result if isinstance(result, (list, tuple)) else (result,)
        if func.namespace == "_c10d_functional" and func is not torch.ops._c10d_functional.wait_tensor.default:
            for t in outputs:
                if isinstance(t, torch.Tensor):
                    self._pend(t, t.untyped_storage().nbytes())
            return
        passes = func is torch.ops._c10d_functional.wait_tensor.default or func is torch.ops.aten.view.default
        for a in args:
            for t in a if isinstance(a, (list, tuple)) else (a,):
                number = self._numbers.get(id(t)) if isinstance(t, torch.Tensor) else None
                if number is None or self.pending[number][0]() is not t:
                    continue
                del self._numbers[id(t)]
                _, nbytes = self.pending.pop(number)
                if passes and isinstance(result, torch.Tensor):  # still not read: the wait's output, or a view
                    self._pend(result, nbytes)

    def _pend(self, t: torch.Tensor, nbytes: int) -> None:
        number = self._issued = self._issued + 1
        self.pending[number] = (weakref.ref(t), nbytes)
        self._numbers[id(t)] = number

    def unwaited(self) -> tuple[int, int]:
        """``(calls, bytes)`` of the functional collectives issued since the last call whose output no op read, and
        forgets them. In a run such an output is never waited on, and torch's work registry holds it: a TP collective
        that a non-reentrant checkpoint's recompute issues before the last tensor it needs (it stops there) and
        whose result is read only after, each step anew (pytorch/torchtitan issue 2763)."""
        calls, nbytes = len(self.pending), sum(n for _, n in self.pending.values())
        self.pending.clear()
        self._numbers.clear()
        return calls, nbytes


def mesh_names(mesh: Any) -> dict[str, str]:
    """Each group's ``group_name`` to the mesh name whose group it is (see :func:`by_mesh_name`); torch's default
    group is ``"world"`` unless a mesh name's group is every rank (a training loop's own all-reduce of its loss)."""
    names: dict[str, str] = {}
    for name in mesh.layout.names:
        try:
            group = mesh.get_group(name)
        except (ValueError, RuntimeError, KeyError):
            continue
        names.setdefault(group.group_name, name)
    if dist.is_initialized():
        names.setdefault(dist.group.WORLD.group_name, WORLD)
    return names


def ops_by_mesh_name(by_op: dict[str, dict[str, list[int]]], mesh: Any) -> dict[str, dict[str, tuple[int, int]]]:
    """The collective counter's ``[bytes, calls]`` by group and op, keyed by mesh name."""
    names = mesh_names(mesh)
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for group, ops in by_op.items():
        dim = out.setdefault(names.get(group, "other"), {})
        for op, (b, n) in ops.items():
            old = dim.get(op, (0, 0))
            dim[op] = (old[0] + b, old[1] + n)
    return out


def by_mesh_name(counts: dict[str, int], mesh: Any) -> dict[str, int]:
    """``counts`` by ``group_name`` re-keyed by the mesh name whose group it is (``"other"`` for the rest).

    A group that serves several names (a dim and a flattening of it alone) goes to the first: dims
    first, then flattened and split names, in the order they were made.
    """
    names = mesh_names(mesh)
    out: dict[str, int] = defaultdict(int)
    for group_name, n in counts.items():
        out[names.get(group_name, "other")] += n
    return dict(sorted(out.items()))


class RunMeter:
    """Peak memory (MemTracker) and collective bytes per mesh name over a stretch of a run.

    >>> meter = RunMeter()                             # doctest: +SKIP
    >>> with meter:                                    # doctest: +SKIP
    ...     model, optimizer = build()                 # counted from the first allocation
    ...     for step in range(3):
    ...         with meter.step():                     # only the steps' collectives are counted
    ...             train_step()
    >>> meter.result(VESCALE_DEVICE_MESH)["peak"]      # doctest: +SKIP
    """

    def __init__(self) -> None:
        self.tracker = StepTracker(module_hooks=False)
        self.counter = CollectiveBytes()
        self.steps = 0

    def __enter__(self) -> RunMeter:
        self.tracker.__enter__()
        self.counter.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.counter.__exit__(*exc)
        self.tracker.__exit__(*exc)

    def exclude(self, *tensors: torch.Tensor) -> None:
        """Leave these tensors' storages out of the peak: host data that batches are cut from, not device memory."""
        self.tracker.track_external(*tensors)  # category "Other", which the step peak leaves out

    def begin_step(self) -> None:
        """Count the collectives from here to :meth:`end_step` as one training step's."""
        self.counter.counting = self.tracker.in_step = True

    def end_step(self) -> None:
        self.counter.counting = self.tracker.in_step = False
        self.steps += 1
        if self.steps == 1:  # the first step also runs one-time work (a pipeline's shape inference): kept apart
            self._first = (dict(self.counter.bytes), dict(self.counter.calls))
            self.counter.bytes.clear()
            self.counter.calls.clear()

    @contextmanager
    def step(self) -> Iterator[None]:
        """``with meter.step():`` is :meth:`begin_step` ... :meth:`end_step`."""
        self.begin_step()
        try:
            yield
        finally:
            self.end_step()

    def result(self, mesh: Any) -> dict[str, Any]:
        """``{"peak": bytes, "run_peak": bytes, "bytes_per_step": {name: bytes}, "steps": n}``.

        ``peak`` is the highest bytes held during the training steps (what the planner predicts);
        ``run_peak`` the highest of the whole metered stretch (evaluation and sampling included).
        """
        snapshot = self.tracker.get_tracker_snapshot("peak")
        steady = self.steps > 1  # bytes per step from the second step on; from the first if it is the only one
        counted, calls = (self.counter.bytes, self.counter.calls) if steady else getattr(self, "_first", ({}, {}))
        n = self.steps - 1 if steady else 1
        return {
            "peak": self.tracker.step_peak,
            "run_peak": max((s["Total"] for s in snapshot.values()), default=0),
            "bytes_per_step": {k: v / n for k, v in by_mesh_name(counted, mesh).items()},
            "calls_per_step": {k: v / n for k, v in by_mesh_name(calls, mesh).items()},
            "steps": self.steps,
        }


def report(meter: RunMeter, mesh: Any, rank_class: str, path: str | None = None) -> str | None:
    """Gather every rank's measurement; on global rank 0 write them to ``path`` (JSON) and return a table.

    Per rank class the table shows the largest peak of its ranks and the mean bytes per step of each
    mesh name (the ranks of an EP group send different shares of an all-to-all; their mean is what
    the planner predicts).
    """
    import json

    mine = dict(meter.result(mesh), rank=dist.get_rank(), rank_class=rank_class)
    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, mine)
    if dist.get_rank() != 0:
        return None
    classes: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for row in rows:
        classes[row["rank_class"]].append(row)
    summary = {}
    for name, members in classes.items():
        dims = sorted({d for r in members for d in r["bytes_per_step"]})
        summary[name] = {
            "ranks": [r["rank"] for r in members],
            "peak": max(r["peak"] for r in members),
            "bytes_per_step": {d: sum(r["bytes_per_step"].get(d, 0) for r in members) / len(members) for d in dims},
            "calls_per_step": {d: sum(r["calls_per_step"].get(d, 0) for r in members) / len(members) for d in dims},
        }
    if path:
        with open(path, "w") as f:
            json.dump({"classes": summary, "ranks": rows}, f, indent=1)
    lines = ["memory report (measured during the training steps: torch's MemTracker peak; the bytes of the "
             "collectives per step by mesh dim):"]
    for name, s in summary.items():
        sent = ", ".join(f"{d} {_mib(b)}" for d, b in s["bytes_per_step"].items()) or "none"
        lines.append(f"  {name} (ranks {_ranks(s['ranks'])}): peak {_mib(s['peak'])}; collectives per step: {sent}")
    return "\n".join(lines)


def _mib(n: float) -> str:
    return f"{n / 2**20:.2f} MiB"


def _ranks(ranks: list[int]) -> str:
    return ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
