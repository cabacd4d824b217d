"""The contiguous gradient buffer behind :class:`~vemesh.ddp.DistributedDataParallel`.

One :class:`GradBuffer` holds the gradients of every parameter that shares a (parameter
dtype, gradient dtype) pair, as views ``param.main_grad`` into one flat tensor. The buffer is cut
into buckets (:mod:`vemesh.parallel.ddp.bucketing`); each bucket's all-reduce over the data-parallel
group starts as soon as all of its gradients are in, and buckets always start in index order,
so every DP rank issues the same collectives in the same order even if a parameter got no
gradient on some ranks.

Each bucket is divided by the DP size and then summed over DP (torch DDP's pre-divide), so the
buffer ends up holding the DP mean. Nothing here knows what a parameter's ``.grad`` is or who
reads the buffer afterwards: :class:`~vemesh.ddp.DistributedDataParallel` keeps ``.grad`` and
``main_grad`` in step, and a ZeRO optimizer (:mod:`vemesh.optim`) reads its slices.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vemesh.parallel.ddp.bucketing import BufferLayout, plan_buckets

__all__ = ["GradBuffer", "local_tensor", "make_buffers"]


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of ``t``: its local shard for a DTensor, ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_grad(p: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """The rank-local data of ``p``'s gradient ``grad``, placed as ``p`` first when it is a DTensor placed otherwise."""
    if isinstance(grad, DTensor):
        if grad.placements != p.placements:  # type: ignore[attr-defined]
            grad = grad.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
        return grad._local_tensor
    return grad


class GradBuffer:
    """Flat gradient storage for a list of parameters, with bucketed async all-reduce.

    Args:
        params: the parameters, in buffer order (reverse registration order, so that the
            gradients computed first by backward land in bucket 0).
        grad_dtype: dtype of the buffer (fp32 when accumulating in fp32).
        group: the data-parallel process group.
        bucket_size: target bucket size in elements.
        divisor: what each bucket is divided by before the sum over ``group`` (default: the group's
            size, giving the mean). Expert parameters are summed over their expert-data-parallel
            group and divided by the whole DP size: each expert saw the tokens of its EP peers too.
    """

    def __init__(
        self, params: list[torch.nn.Parameter], grad_dtype: torch.dtype, group: dist.ProcessGroup, bucket_size: int,
        divisor: int | None = None,
    ) -> None:
        self.params = params
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.divisor = self.dp_size if divisor is None else divisor
        locals_ = [local_tensor(p) for p in params]
        self.layout: BufferLayout = plan_buckets([t.numel() for t in locals_], bucket_size)
        #: The gradient buffer; ``param.main_grad`` are views into it.
        self.data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=locals_[0].device)
        for p, t, (start, end) in zip(params, locals_, self.layout.param_ranges):
            p.main_grad = self.data[start:end].view(t.shape)  # type: ignore[attr-defined]
        self._bucket_of = dict(zip(map(id, params), self.layout.bucket_of_param()))
        self._works: list[dist.Work] = []
        #: the works of the last :meth:`wait`, held until the next. Dropped at once, a work's last reference can be
        #: gloo's worker thread's, released a moment after the collective completes; a script that ends in that
        #: moment aborts at exit, "terminate called without an active exception" (docs/troubleshooting.md). Held
        #: here, it is freed by a thread that holds the GIL.
        self._waited: list[dist.Work] = []
        self.reset()

    def reset(self) -> None:
        """Forget which gradients arrived and which buckets started (not the data)."""
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._ready: set[int] = set()
        self._next_bucket = 0

    def is_ready(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` was marked ready since the last :meth:`reset`."""
        return id(param) in self._ready

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Record that ``param``'s gradient for this pass is final; start every full bucket in order.

        Raises:
            RuntimeError: ``param``'s bucket already started reducing, so a second gradient
                would be lost (e.g. a parameter used both inside and outside a reentrant
                activation checkpoint).
        """
        key = id(param)
        if key in self._ready:
            if self._bucket_of[key] < self._next_bucket:
                raise RuntimeError(
                    "a parameter received a second gradient in one backward pass after its bucket started "
                    "reducing (reentrant activation checkpointing?); use torch.utils.checkpoint with "
                    "use_reentrant=False, or build DistributedDataParallel with overlap_grad_reduce=False"
                )
            return
        self._ready.add(key)
        self._pending[self._bucket_of[key]] -= 1
        while self._next_bucket < len(self._pending) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def start_remaining(self) -> None:
        """Start every bucket not started yet (e.g. holding parameters unused in this pass)."""
        while self._next_bucket < len(self._pending):
            self._launch(self._next_bucket)

    def wait(self) -> None:
        """Wait for every started all-reduce and :meth:`reset`."""
        for work in self._works:
            work.wait()
        self._waited, self._works = self._works, []
        self.reset()

    def _launch(self, index: int) -> None:
        self._next_bucket = index + 1
        if self.dp_size == 1 and self.divisor == 1:
            return
        bucket = self.layout.buckets[index]
        chunk = self.data[bucket.start : bucket.end]
        chunk.div_(self.divisor)  # the sum over DP of x / DP is the mean (exact for power-of-two DP)
        if self.dp_size == 1:
            return
        work = dist.all_reduce(chunk, group=self.group, async_op=True)
        assert work is not None
        self._works.append(work)


def make_buffers(
    params: list[torch.nn.Parameter], experts: frozenset[int], group: dist.ProcessGroup,
    expert_group: dist.ProcessGroup | None, bucket_size: int, *, fp32: bool,
) -> list[GradBuffer]:
    """One buffer per (dense or expert, parameter dtype, gradient dtype), filled in reverse order.

    Backward produces gradients roughly in reverse registration order, so the first ones land in
    bucket 0. An expert buffer (``id(p) in experts``) reduces over ``expert_group``, divided by the
    size of ``group`` (the whole DP group).
    """
    by_kind: dict[tuple[bool, torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
    for p in reversed(params):
        by_kind.setdefault((id(p) in experts, p.dtype, torch.float32 if fp32 else p.dtype), []).append(p)
    dp_size = dist.get_world_size(group)
    return [
        GradBuffer(ps, g, expert_group, bucket_size, divisor=dp_size) if expert else GradBuffer(ps, g, group, bucket_size)
        for (expert, _, g), ps in by_kind.items()
    ]
