"""Data parallelism over one mesh dim, with a contiguous gradient buffer.

:class:`DistributedDataParallel` wraps a module (possibly tensor-parallel, with DTensor
parameters from torch's ``parallelize_module``) and averages its gradients over a data-parallel
group. On a ``(DP, TP) = (2, 2)`` mesh over ranks ``[[0, 1], [2, 3]]``, rank 0 and rank 2 hold
the same TP shard of each weight and average their shard gradients with each other; rank 1 and
rank 3 do the same for the other shard.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from .bucketing import DEFAULT_BUCKET_SIZE
from .grad_buffer import GradBuffer, grad_collective_for_backend, local_tensor

__all__ = ["DistributedDataParallel"]


def _resolve_group(data_pg_or_device_mesh: DeviceMesh | dist.ProcessGroup | None) -> dist.ProcessGroup:
    if data_pg_or_device_mesh is None:
        return dist.group.WORLD  # type: ignore[return-value]
    if isinstance(data_pg_or_device_mesh, DeviceMesh):
        mesh = data_pg_or_device_mesh
        if mesh.ndim != 1:
            raise ValueError(
                f"data_pg_or_device_mesh must be a 1-D DeviceMesh (e.g. mesh['DP']), got a {mesh.ndim}-D mesh "
                f"with shape {tuple(mesh.shape)} and dim names {mesh.mesh_dim_names}"
            )
        return mesh.get_group()
    if isinstance(data_pg_or_device_mesh, dist.ProcessGroup):
        return data_pg_or_device_mesh
    raise TypeError(
        "data_pg_or_device_mesh must be a 1-D DeviceMesh, a ProcessGroup or None, "
        f"got {type(data_pg_or_device_mesh).__name__}"
    )


def _check_bucket_size(bucket_size: int | None) -> int:
    if bucket_size is None:
        return DEFAULT_BUCKET_SIZE
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise TypeError(f"bucket_size must be an int number of elements or None, got {bucket_size!r}")
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of elements or None, got {bucket_size}")
    return bucket_size


class DistributedDataParallel(nn.Module):
    """Average gradients over a data-parallel group through a contiguous gradient buffer.

    Each trainable parameter gets ``param.main_grad``, a view into a flat buffer (fp32 when
    ``accumulate_allreduce_grads_in_fp32``). A post-accumulate-grad hook adds every new local
    gradient (the local shard for DTensor parameters) into ``main_grad``, pre-scaled by ``1/DP``
    (exact for power-of-two DP), and frees ``param.grad``. Buckets are reduced over DP
    asynchronously as soon as they are complete (``overlap_grad_reduce=True``), always in bucket
    order; :meth:`finish_grad_sync` starts the rest and waits.

    After :meth:`finish_grad_sync`, and unless ``use_distributed_optimizer``, every ``param.grad``
    is the DP-averaged gradient: a view of the buffer (or a copy in the parameter's dtype), a
    DTensor with the parameter's placements for DTensor parameters. Any torch optimizer works.
    Call :meth:`zero_grad_buffer` (or ``model.zero_grad()``) before the next step's backward; a
    backward without it raises ``RuntimeError`` instead of silently adding to last step's
    gradients. The buffer is zeroed lazily (the first gradient of a step overwrites).

    With ``use_distributed_optimizer=True`` each bucket is padded to split evenly over DP, the
    parameters' values also live in a flat parameter buffer with the same layout,
    ``param.grad`` is left unset, and :class:`vemesh.optim.DistributedOptimizer` reads the
    reduced gradients from the buffer. The bucket collective is chosen per backend by
    :func:`~vemesh.ddp.grad_buffer.grad_collective_for_backend` (gloo: all-reduce, measured
    faster than its emulated reduce-scatter; others: reduce-scatter).

    Parameters are broadcast from the first rank of the DP group at construction. Module
    buffers (e.g. batch-norm statistics) are not synchronised. A parameter that got no gradient
    on any rank in a step gets a zero gradient (not ``None``), so every DP rank's optimizer
    sees the same thing. With DP size 1 and nothing to convert (same gradient and parameter
    dtype, no distributed optimizer) the wrapper is a pass-through: no buffer, no hooks, and
    autograd's own ``param.grad`` (``None`` for unused parameters).

    Args:
        module: the module to wrap; its parameters may be DTensors (e.g. TP-sharded).
        data_pg_or_device_mesh: the data-parallel group: a 1-D DeviceMesh (``mesh["DP"]``), a
            ProcessGroup, or None for the default group.
        accumulate_allreduce_grads_in_fp32: accumulate and reduce gradients in fp32 even for
            bf16/fp16 parameters.
        overlap_grad_reduce: start each bucket's collective during backward.
        use_distributed_optimizer: prepare the buffers for :class:`vemesh.optim.DistributedOptimizer`.
        bucket_size: bucket size in elements (default 6,553,600: 25 MiB of fp32, torch DDP's default).

    Example::

        # (DP, TP) = (2, 2) on 4 ranks: rank 0 averages with rank 2, rank 1 with rank 3.
        model = parallelize_module(model, mesh["TP"], tp_plan)
        model = DistributedDataParallel(model, mesh["DP"])
        loss_fn(model(x), y).backward()
        model.finish_grad_sync()      # param.grad now DP-averaged on every rank
        optimizer.step()
        model.zero_grad_buffer()
    """

    def __init__(
        self,
        module: nn.Module,
        data_pg_or_device_mesh: DeviceMesh | dist.ProcessGroup | None = None,
        *,
        accumulate_allreduce_grads_in_fp32: bool = True,
        overlap_grad_reduce: bool = True,
        use_distributed_optimizer: bool = False,
        bucket_size: int | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
            raise ValueError(f"module is already wrapped in {type(module).__name__}; wrap the inner module once")
        group = _resolve_group(data_pg_or_device_mesh)
        bucket_size = _check_bucket_size(bucket_size)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters (none with requires_grad=True)")
        names = {id(p): n for n, p in module.named_parameters()}
        for p in params:
            if getattr(p, "_vemesh_ddp_wrapped", False):
                raise ValueError(
                    f"parameter {names[id(p)]!r} already belongs to a vemesh DistributedDataParallel; wrap the module once"
                )
            if isinstance(p, DTensor) and any(pl.is_partial() for pl in p.placements):
                raise ValueError(f"parameter {names[id(p)]!r} has Partial placements {p.placements}; use Shard or Replicate")
        for p in params:
            p._vemesh_ddp_wrapped = True  # type: ignore[attr-defined]
        self.module = module
        self.data_parallel_group = group
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.bucket_size = bucket_size
        self._sync_enabled = True
        self._grads_synced = False
        self._params = params
        self._param_names = names

        def grad_dtype(p: torch.Tensor) -> torch.dtype:
            return torch.float32 if accumulate_allreduce_grads_in_fp32 else p.dtype

        # DP=1 without an optimizer that reads the buffer: autograd's own .grad is already the answer.
        self._pass_through = (
            self.dp_size == 1 and not use_distributed_optimizer and all(grad_dtype(p) == p.dtype for p in params)
        )
        self.buffers: list[GradBuffer] = []
        self._buffer_of: dict[int, GradBuffer] = {}
        self._hooks: list[Any] = []
        self._grad_views: list[tuple[nn.Parameter, torch.Tensor, torch.Tensor]] = []
        if self._pass_through:
            return
        collective = grad_collective_for_backend(dist.get_backend(group), use_distributed_optimizer)
        by_dtype: dict[tuple[torch.dtype, torch.dtype], list[nn.Parameter]] = {}
        for p in reversed(params):  # backward produces gradients roughly in reverse order
            by_dtype.setdefault((p.dtype, grad_dtype(p)), []).append(p)
        for (_, gdtype), group_params in by_dtype.items():
            buffer = GradBuffer(group_params, gdtype, group, bucket_size, collective, use_distributed_optimizer)
            self.buffers.append(buffer)
            self._buffer_of.update((id(p), buffer) for p in group_params)
        self._broadcast_params()
        for p in params:
            self._hooks.append(p.register_post_accumulate_grad_hook(self._make_hook(p)))
        if not use_distributed_optimizer:
            self._grad_views = [self._make_grad_view(p) for p in params]

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module."""
        return self.module(*args, **kwargs)

    @torch.no_grad()
    def _broadcast_params(self) -> None:
        """Make every DP rank start from the parameters of the first rank of the DP group."""
        if self.dp_size == 1:
            return
        for buffer in self.buffers:
            if buffer.param_data is not None:
                dist.broadcast(buffer.param_data, group=self.data_parallel_group, group_src=0)
                buffer.copy_params_out()
                continue
            tensors = [local_tensor(p).detach() for p in buffer.params]
            flat = torch.cat([t.reshape(-1) for t in tensors])
            dist.broadcast(flat, group=self.data_parallel_group, group_src=0)
            for t, chunk in zip(tensors, flat.split([t.numel() for t in tensors])):
                t.copy_(chunk.view(t.shape))

    def _make_hook(self, param: nn.Parameter) -> Any:
        buffer = self._buffer_of[id(param)]

        def hook(p: torch.Tensor) -> None:
            grad = p.grad
            if grad is None:
                return
            if self._grads_synced:
                raise RuntimeError(
                    f"gradient for {self._param_names[id(p)]!r} arrived after finish_grad_sync() and before "
                    "zero_grad_buffer(); call model.zero_grad_buffer() (or DistributedOptimizer.zero_grad()) "
                    "at the start of each step"
                )
            sync = self.overlap_grad_reduce and self._sync_enabled
            if sync and buffer.arrived(param):
                raise RuntimeError(
                    f"{self._param_names[id(p)]!r} got a second gradient while its bucket may be reducing; with "
                    "overlap_grad_reduce=True run all but the last backward of a step inside model.no_sync()"
                )
            if isinstance(grad, DTensor):
                if grad.placements != p.placements:  # type: ignore[attr-defined]
                    grad = grad.redistribute(p.device_mesh, p.placements)  # type: ignore[attr-defined]
                grad = grad._local_tensor
            buffer.accumulate(param, grad)
            p.grad = None
            if sync:
                buffer.mark_ready(param)

        return hook

    @torch.no_grad()
    def _make_grad_view(self, p: nn.Parameter) -> tuple[nn.Parameter, torch.Tensor, torch.Tensor]:
        """``(param, local grad holder, what to assign to param.grad)``, built once."""
        main_grad: torch.Tensor = p.main_grad  # type: ignore[attr-defined]
        holder = main_grad if main_grad.dtype == p.dtype else torch.empty_like(main_grad, dtype=p.dtype)
        grad = holder
        if isinstance(p, DTensor):
            grad = DTensor.from_local(
                holder, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride()
            )
        return p, holder, grad

    def finish_grad_sync(self) -> None:
        """Start any bucket not started yet, wait for all, and expose the averaged gradients.

        Every DP rank must call this once per step (after the last backward). Calling it again
        before :meth:`zero_grad_buffer` does nothing. Without the distributed optimizer every
        ``param.grad`` then holds the DP-averaged gradient on every rank.
        """
        if self._pass_through or self._grads_synced:
            return
        for buffer in self.buffers:
            buffer.start_remaining()
        for buffer in self.buffers:
            buffer.wait()
        for p, holder, grad in self._grad_views:
            if holder is not p.main_grad:  # type: ignore[attr-defined]
                holder.copy_(p.main_grad)  # type: ignore[attr-defined]
            p.grad = grad
        self._grads_synced = True

    def zero_grad_buffer(self) -> None:
        """Zero the gradient buffers and set every ``param.grad`` to None (start of a step)."""
        for buffer in self.buffers:
            buffer.zero()
        for p in self._params:
            p.grad = None
        self._grads_synced = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Same as :meth:`zero_grad_buffer` (``set_to_none`` is accepted for torch compatibility)."""
        self.zero_grad_buffer()

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (no collectives) for the backward passes inside the block.

        Example::

            with model.no_sync():
                loss_fn(model(x0), y0).backward()   # accumulates only
            loss_fn(model(x1), y1).backward()       # buckets reduce the sum of both
            model.finish_grad_sync()
        """
        previous = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = previous
