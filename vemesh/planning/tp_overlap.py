"""Which of a trace's all-gathers and reduce-scatters async TP overlaps, and with which matmuls: the pairs that
torch's micro-pipeline pass fuses (``torch/_inductor/fx_passes/micro_pipeline_tp.py``), found on the eager trace.

torch's async TP (``torch._inductor.config._micro_pipeline_tp``, symmetric memory on the TP group, under
``torch.compile``) rewrites two patterns into one op that runs the collective a shard at a time under the matmul:

* an all-gather whose result is the first operand of matmuls (``A`` of ``A @ B``; gathered along its last dim
  only when a shard has 1024 values or more there): ``fused_all_gather_matmul`` runs the gather under those matmuls;
* a reduce-scatter whose input is one matmul's output: ``fused_matmul_reduce_scatter``.

Every other all-gather and reduce-scatter stays as it was: the one that reduces a *sum* of matmuls (the gradient
of an input that feeds several Linears: ``wq``, ``wk`` and ``wv``; ``w1`` and ``w3``), and the gather that only a
transposed read uses (a weight gradient's).

:class:`FedMatmuls` follows each functional all-gather's result and each matmul's output through views and the
``cat`` that a gather or scatter along a dim other than 0 makes. A collective it pairs is counted under its op's
name with ``@FLOPS``, the FLOPs per call of the matmuls it feeds or is fed by (``all_gather_into_tensor@2147483648``);
:mod:`vemesh.planning.step_time` hides such a call behind those FLOPs' time under ``--async-tp``, and no other call.
"""

from __future__ import annotations

from typing import Any

import torch

from vemesh.planning.step_time import fed_flops, op_name
from vemesh.planning.storages import StorageTables, storage_key

__all__ = ["FedMatmuls"]

_aten = torch.ops.aten
_func = torch.ops._c10d_functional
_GATHER, _SCATTER = _func.all_gather_into_tensor.default, _func.reduce_scatter_tensor.default


class FedMatmuls:
    """Pairs a trace's functional all-gathers and reduce-scatters with the matmuls torch's async TP would fuse them
    with (see the module docstring), re-keying the pairs in a :class:`~vemesh.planning.measure.CollectiveBytes`'
    ``by_op``."""

    def __init__(self, by_op: dict[str, dict[str, list[int]]]) -> None:
        self.by_op = by_op
        self._gathered: dict[int, list[Any]] = {}  #: storage -> [group, key, bytes] of the gather that wrote it
        self._products: dict[int, int] = {}  #: storage -> FLOPs of the matmul that wrote it
        self._storages = StorageTables(self._gathered, self._products)

    def key_of(self, func: Any, args: tuple, op: str) -> str:
        """The key a collective is counted under: a reduce-scatter of one matmul's output names its FLOPs."""
        if func is _SCATTER and isinstance(args[0], torch.Tensor):
            flops = self._products.get(storage_key(args[0]))
            if flops:
                return f"{op}@{flops}"
        return op

    def counted(self, func: Any, result: Any, group: str, key: str, size: int) -> None:
        """A collective was counted under ``key``: an all-gather's result is followed to the matmuls it feeds."""
        if func is _GATHER and isinstance(result, torch.Tensor):
            self._gathered[self._storages.watch(result)] = [group, key, size]

    def see(self, func: Any, args: tuple, result: Any) -> None:
        """Any op, after it ran (not on DTensors): matmuls and the ``cat`` of one storage's chunks."""
        packet = func.overloadpacket
        if packet in (_aten.mm, _aten.addmm) and isinstance(result, torch.Tensor):
            a, b = (args[0], args[1]) if packet is _aten.mm else (args[1], args[2])
            flops = 2 * a.shape[0] * a.shape[1] * b.shape[1]
            record = self._gathered.get(storage_key(a))
            if record is not None and a.is_contiguous():  # A as gathered, not transposed (a weight gradient's read)
                self._move(record, flops)
            self._products[self._storages.watch(result)] = flops
        elif packet is _aten.cat and isinstance(result, torch.Tensor):
            chunks = [t for t in args[0] if isinstance(t, torch.Tensor)]
            keys = {storage_key(t) for t in chunks}
            dim = args[1] if len(args) > 1 else 0
            if len(keys) == 1:  # the chunks of one storage, put back along another dim
                source = keys.pop()
                last = dim in (-1, result.dim() - 1)
                if source in self._gathered and not (last and chunks[0].shape[-1] < 1024):  # torch's lower bound
                    self._gathered[self._storages.watch(result)] = self._gathered[source]
                elif source in self._products:
                    self._products[self._storages.watch(result)] = self._products[source]

    def _move(self, record: list[Any], flops: int) -> None:
        group, key, size = record
        ops = self.by_op.get(group, {})
        old = ops.get(key)
        if old is None or old[1] < 1 or old[0] < size:  # counted before the counter was cleared: not this count's
            return
        old[0], old[1] = old[0] - size, old[1] - 1
        if old == [0, 0]:
            del ops[key]
        record[1] = f"{op_name(key)}@{fed_flops(key) + flops}"
        new = ops.setdefault(record[1], [0, 0])
        new[0], new[1] = new[0] + size, new[1] + 1
