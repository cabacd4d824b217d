"""The contiguous gradient buffer behind :class:`~vemesh.ddp.DistributedDataParallel`.

One :class:`GradBuffer` holds the gradients of every parameter that shares a (parameter
dtype, gradient dtype) pair, as views ``param.main_grad`` into one flat tensor. The buffer is cut
into buckets (:mod:`vemesh.ddp.bucketing`); each bucket's collective over the data-parallel
group starts as soon as all of its gradients are in, and buckets always start in index order,
so every DP rank issues the same collectives in the same order even if a parameter got no
gradient on some ranks.

With ``keep_param_buffer=True`` (used by the distributed optimizer) the parameters' values
also live in a flat buffer with the same layout, so that the optimizer can all-gather updated
parameters bucket by bucket: plain parameters become views of it (the gather lands straight in
the model), DTensor parameters get a copy after the gather.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .bucketing import BufferLayout, plan_buckets

__all__ = ["GradBuffer", "grad_collective_for_backend", "param_gather_for_backend", "local_tensor"]

GradCollective = Literal["all_reduce", "reduce_scatter"]
ParamGather = Literal["all_gather", "broadcast"]


def grad_collective_for_backend(backend: str, use_distributed_optimizer: bool) -> GradCollective:
    """The collective that reduces a gradient bucket over the data-parallel group.

    Plain DDP always all-reduces. With the distributed optimizer each rank only needs its
    own 1/DP slice of every bucket, so a reduce-scatter moves half the bytes of an all-reduce
    on NCCL. gloo has no native reduce-scatter: torch emulates it, and on this project's CPU
    machine (2 cores, torch 2.13, gloo, 2 ranks) ``reduce_scatter_single`` of 32 MiB took
    101 ms against 38 ms for ``all_reduce`` (``bench/train_step.py``; an earlier probe: 60 vs
    28 ms). So gloo all-reduces the whole bucket and each rank reads its own slice; every
    other backend reduce-scatters.

    Args:
        backend: the process group backend name (``dist.get_backend(group)``).
        use_distributed_optimizer: whether a ZeRO-1 optimizer consumes the gradients.

    Returns:
        ``"all_reduce"`` or ``"reduce_scatter"``.
    """
    if not use_distributed_optimizer or backend == "gloo":
        return "all_reduce"
    return "reduce_scatter"


def param_gather_for_backend(backend: str) -> ParamGather:
    """How the distributed optimizer gathers every rank's updated parameter shard.

    gloo's all-gather is slow on this project's CPU machine: for 32 MiB of fp32 over 2 ranks,
    ``all_gather_single`` took 67-106 ms while one async ``broadcast`` per DP rank of its own
    shard took 17-24 ms (an ``all_reduce`` of the buffer with the other shards zeroed: 44-48 ms).
    So gloo broadcasts; every other backend all-gathers.

    Args:
        backend: the process group backend name.

    Returns:
        ``"broadcast"`` or ``"all_gather"``.
    """
    return "broadcast" if backend == "gloo" else "all_gather"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The rank-local data of ``t``: its local shard for a DTensor, ``t`` itself otherwise."""
    return t._local_tensor if isinstance(t, DTensor) else t


class GradBuffer:
    """Flat gradient storage for a list of parameters, with bucketed async reduction.

    Args:
        params: the parameters, in buffer order (reverse registration order, so that the
            gradients computed first by backward land in bucket 0).
        grad_dtype: dtype of the buffer (fp32 when accumulating in fp32).
        group: the data-parallel process group.
        bucket_size: target bucket size in elements.
        collective: ``"all_reduce"`` or ``"reduce_scatter"`` (see :func:`grad_collective_for_backend`).
        keep_param_buffer: also keep the parameters' values in a flat buffer (:attr:`param_data`)
            with the same layout, padded so every bucket splits evenly over DP; needed by the
            distributed optimizer.
    """

    def __init__(
        self,
        params: list[torch.nn.Parameter],
        grad_dtype: torch.dtype,
        group: dist.ProcessGroup,
        bucket_size: int,
        collective: GradCollective,
        keep_param_buffer: bool,
    ) -> None:
        self.params = params
        self.group = group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.collective = collective
        self.param_gather = param_gather_for_backend(dist.get_backend(group))
        pad_to = self.dp_size if keep_param_buffer else 1
        locals_ = [local_tensor(p) for p in params]
        self.layout: BufferLayout = plan_buckets([t.numel() for t in locals_], bucket_size, pad_to)
        device = locals_[0].device
        #: The gradient buffer; ``param.main_grad`` are views into it.
        self.data = torch.zeros(self.layout.numel, dtype=grad_dtype, device=device)
        #: The parameter buffer (``keep_param_buffer=True`` only); plain parameters are views into it.
        self.param_data: torch.Tensor | None = None
        if keep_param_buffer:
            self.param_data = torch.zeros(self.layout.numel, dtype=locals_[0].dtype, device=device)
        # DTensor parameters keep their own storage: a DTensor whose local tensor starts at a
        # non-zero storage offset cannot be deep-copied (torch 2.13), which would break
        # copy.deepcopy(model.state_dict()). Their values are copied out after each all-gather.
        self._copied_params: list[tuple[torch.Tensor, torch.Tensor]] = []
        for p, t, (start, end) in zip(params, locals_, self.layout.param_ranges):
            p.main_grad = self.data[start:end].view(t.shape)  # type: ignore[attr-defined]
            if self.param_data is not None:
                view = self.param_data[start:end].view(t.shape)
                with torch.no_grad():
                    view.copy_(t)
                if isinstance(p, DTensor):
                    self._copied_params.append((t, view))
                else:
                    t.data = view
        self._bucket_of = dict(zip(map(id, params), self.layout.bucket_of_param()))
        self._scale = 1.0 / self.dp_size
        self._works: list[dist.Work] = []
        self.zero()

    def reset_state(self) -> None:
        """Forget which gradients arrived and which buckets started (not the data)."""
        self._pending = [len(b.params) for b in self.layout.buckets]
        self._arrived: set[int] = set()
        self._next_bucket = 0

    def zero(self) -> None:
        """Zero the gradients (lazily) and reset the bucket state.

        No memset happens here: the first gradient of each parameter after :meth:`zero`
        overwrites its ``main_grad`` instead of adding to it, and the ``main_grad`` of a parameter
        that got no gradient is zeroed when its bucket starts. Until then ``main_grad`` holds
        stale values. This saves a pass over the whole buffer every step.
        """
        self._written: set[int] = set()
        self._written_in_bucket = [0] * len(self.layout.buckets)
        self.reset_state()

    def accumulate(self, param: torch.nn.Parameter, grad: torch.Tensor) -> None:
        """Add ``grad / DP`` (the local gradient, pre-scaled so that the sum over DP is the mean)."""
        key = id(param)
        main_grad: torch.Tensor = param.main_grad  # type: ignore[attr-defined]
        if key in self._written:
            main_grad.add_(grad, alpha=self._scale)
        else:
            torch.mul(grad, self._scale, out=main_grad)
            self._written.add(key)
            self._written_in_bucket[self._bucket_of[key]] += 1

    def arrived(self, param: torch.nn.Parameter) -> bool:
        """Whether ``param`` was already marked ready since the last :meth:`wait`."""
        return id(param) in self._arrived

    def mark_ready(self, param: torch.nn.Parameter) -> None:
        """Record that ``param``'s gradient for this step is complete; start full buckets."""
        key = id(param)
        assert key not in self._arrived, "parameter marked ready twice"
        self._arrived.add(key)
        self._pending[self._bucket_of[key]] -= 1
        while self._next_bucket < len(self._pending) and self._pending[self._next_bucket] == 0:
            self._launch(self._next_bucket)

    def start_remaining(self) -> None:
        """Start every bucket not started yet (e.g. holding parameters unused this step)."""
        while self._next_bucket < len(self._pending):
            self._launch(self._next_bucket)

    def wait(self) -> None:
        """Wait for every started collective and reset the bucket state."""
        for work in self._works:
            work.wait()
        self._works = []
        self.reset_state()

    def _launch(self, index: int) -> None:
        self._next_bucket = index + 1
        bucket = self.layout.buckets[index]
        if self._written_in_bucket[index] < len(bucket.params):  # parameters with no gradient this step
            for i in bucket.params:
                p = self.params[i]
                if id(p) not in self._written:
                    p.main_grad.zero_()  # type: ignore[attr-defined]
                    self._written.add(id(p))
            self._written_in_bucket[index] = len(bucket.params)
        if self.dp_size == 1:
            return
        chunk = self.data[bucket.start : bucket.end]
        if self.collective == "all_reduce":
            work = dist.all_reduce(chunk, group=self.group, async_op=True)
        else:
            lo, hi = bucket.shard(self.dp_rank, self.dp_size)
            work = dist.reduce_scatter_single(self.data[lo:hi], chunk, group=self.group, async_op=True)
        assert work is not None
        self._works.append(work)

    @torch.no_grad()
    def copy_params_in(self) -> None:
        """Refresh :attr:`param_data` from DTensor parameters (plain ones are views of it already)."""
        if self._copied_params:
            torch._foreach_copy_([v for _, v in self._copied_params], [t for t, _ in self._copied_params])

    @torch.no_grad()
    def copy_params_out(self) -> None:
        """Write :attr:`param_data` into DTensor parameters after a gather."""
        if self._copied_params:
            torch._foreach_copy_([t for t, _ in self._copied_params], [v for _, v in self._copied_params])

    def start_param_gather(self) -> list[dist.Work]:
        """Gather every rank's shard of :attr:`param_data` into the full buffer, per bucket.

        Uses ``all_gather_single`` or one ``broadcast`` per DP rank (see :func:`param_gather_for_backend`).

        Returns:
            The async work handles (empty when DP size is 1).
        """
        assert self.param_data is not None, "GradBuffer was built without keep_param_buffer"
        works: list[dist.Work | None] = []
        if self.dp_size == 1:
            return []
        for bucket in self.layout.buckets:
            if self.param_gather == "broadcast":
                for r in range(self.dp_size):
                    lo, hi = bucket.shard(r, self.dp_size)
                    works.append(
                        dist.broadcast(self.param_data[lo:hi], group=self.group, group_src=r, async_op=True)
                    )
            else:
                lo, hi = bucket.shard(self.dp_rank, self.dp_size)
                out = self.param_data[bucket.start : bucket.end]
                works.append(dist.all_gather_single(out, self.param_data[lo:hi], group=self.group, async_op=True))
        return [w for w in works if w is not None]
