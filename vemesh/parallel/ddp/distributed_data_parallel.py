"""Data parallelism over one mesh dim, with a contiguous gradient buffer, behaving like torch DDP.

On a ``(DP, TP) = (2, 2)`` mesh over ranks ``[[0, 1], [2, 3]]``, rank 0 and rank 2 hold the same TP
shard of each weight and average their shard gradients; rank 1 and rank 3 do the same for the other. The contract
is torch DDP's; stricter: a group that mixes shards or leaves out data ranks raises (:mod:`vemesh.parallel.ddp.groups`).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from vemesh.parallel.context.api import sharded_buffers
from vemesh.parallel.ddp.grad_buffer import GradBuffer, local_grad, local_tensor, make_buffers
from vemesh.parallel.ddp.groups import check_covers_data, check_not_sharded_over, resolve_group
from vemesh.parallel.ddp.support import (GradsOutside, PipelineReducer, broadcast_from_first, check_bucket_size,
                                        check_experts, check_params_kept, check_placement, like, point_grad,
                                        release_params, step_guard, tp_gradients_checked, weak_method, weak_param_hook)
from vemesh.parallel.tp_replicas import inputs_fingerprint, tp_group_beside

__all__ = ["DistributedDataParallel"]


class DistributedDataParallel(nn.parallel.DistributedDataParallel):
    """Average gradients over a data-parallel group through a contiguous gradient buffer.

    A drop-in for ``torch.nn.parallel.DistributedDataParallel`` (an instance of it: ``model.module``, ``isinstance``
    and DCP's ``get_state_dict`` behave as with torch DDP) that takes a mesh dim and TP-sharded DTensor parameters:

    * ``param.grad`` *is* ``param.main_grad``, a view into a flat buffer (fp32 when
      ``accumulate_allreduce_grads_in_fp32``; a copy in the parameter's dtype for bf16/fp16), like torch's
      ``gradient_as_bucket_view``; buckets all-reduce during backward, in order, so when ``loss.backward()``
      returns every ``.grad`` is the DP mean;
    * ``no_sync()`` accumulates locally; gradients accumulate until cleared by any of ``optimizer.zero_grad()``,
      ``model.zero_grad()`` and :meth:`zero_grad_buffer`. A step on gradients never averaged raises: ``no_sync()``'s,
      or those that torch's zero-bubble pipeline schedules add to ``.grad`` by hand (:meth:`finish_grad_sync`).

    Parameters and buffers are broadcast from DP's first rank at construction, buffers again before each forward
    (``broadcast_buffers``) but one after a forward under ``no_sync()`` or ``no_grad``, as torch's, but those a
    ``context_parallel`` holds sharded. A parameter with no gradient on any rank in a step gets a zero one.

    Args:
        module: the module to wrap; its parameters may be DTensors (e.g. TP-sharded).
        data_pg_or_device_mesh: the data-parallel group: a 1-D DeviceMesh (``mesh["DP"]``), a ProcessGroup, a whole
            ``VeDeviceMesh`` (its data dims), or None: the live ``VESCALE_DEVICE_MESH``'s data dims (``DP``, or
            ``dp_cp`` with CP: never TP or PP peers); torch's default group only without a live mesh (as torch's).
            A group holding two ranks of one parameter's shards (a DTensor's TP peers) raises ``ValueError``.
        accumulate_allreduce_grads_in_fp32: accumulate and reduce gradients in fp32 even for bf16/fp16 parameters.
        overlap_grad_reduce: start each bucket's all-reduce during backward.
        use_distributed_optimizer: accepted for veScale compatibility; it changes nothing.
        bucket_size: bucket size in elements (default 6,553,600: 25 MiB of fp32, torch DDP's default).
        broadcast_buffers: broadcast module buffers from DP rank 0 before each forward (torch's default).
        expert_data_parallel: for MoE with expert parallelism: the expert-data-parallel group (``mesh["EDP"]``),
            the ranks of the DP group that hold the same experts. Must come with ``expert_parameters``.
        expert_parameters: the parameters of this rank's experts (they differ across the EP group). Their gradients
            are summed over ``expert_data_parallel`` and divided by the DP size: each expert saw the tokens its EP
            peers sent it, so this is the gradient of the mean loss over the DP group's batch. They are broadcast
            from the first rank of ``expert_data_parallel``, the others from DP's first rank. Left out (both), the
            experts that :class:`~vemesh.parallel.ExpertParallel` sharded are found with the live mesh's ``EDP``.
        replicas: the fault-tolerant replica dim (:func:`vemesh.ft.start_replicas`): after the DP mean, each buffer
            is averaged across the replicas taking part, through torchft; if that fails, the step does not commit
            (:class:`~vemesh.optim.DistributedOptimizer` asks the replicas before stepping).
        check_tp_gradients: after the first averaged backward on a mesh with TP, raise if a plain-tensor replica
            over TP has different gradients there (:mod:`~vemesh.parallel.tp_replicas`).

    Example::

        # (DP, TP) = (2, 2) on 4 ranks: rank 0 averages with rank 2, rank 1 with rank 3.
        model = parallelize_module(model, mesh["TP"], tp_plan)
        model = DistributedDataParallel(model, mesh["DP"])
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
        opt.zero_grad()
        loss_fn(model(x), y).backward()   # param.grad is now the DP mean on every rank
        opt.step()
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
        broadcast_buffers: bool = True,
        expert_data_parallel: DeviceMesh | dist.ProcessGroup | None = None,
        expert_parameters: Iterable[nn.Parameter] | None = None,
        replicas: Any = None,
        check_tp_gradients: bool = True,
    ) -> None:
        nn.Module.__init__(self)  # torch DDP's own __init__ builds its C++ reducer, which this replaces
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, nn.parallel.DistributedDataParallel):
            raise ValueError(f"module is already wrapped in {type(module).__name__}; wrap the inner module once")
        group, described = resolve_group(data_pg_or_device_mesh)
        bucket_size = check_bucket_size(bucket_size)
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError(f"{type(module).__name__} has no trainable parameters (none with requires_grad=True)")
        names = {id(p): n for n, p in module.named_parameters()}
        for p in params:
            if getattr(p, "_vemesh_ddp", lambda: None)() is not None:  # a live wrapper; a freed one is gone
                raise ValueError(f"parameter {names[id(p)]!r} already belongs to a vemesh DistributedDataParallel; wrap "
                                 "the module once (to wrap it again, drop the old wrapper and the optimizers built on it "
                                 "first: del model, opt)")
            if isinstance(p, DTensor) and any(pl.is_partial() for pl in p.placements):
                raise ValueError(f"parameter {names[id(p)]!r} has Partial placements {p.placements}; use Shard or Replicate")
        experts, expert_group = check_experts(group, expert_data_parallel, expert_parameters, params)
        # a group holding two ranks of one parameter's shards (its TP peers, its EP peers) would average
        # different shards: refused before anything is broadcast
        check_not_sharded_over([(names[id(p)], p) for p in params if id(p) not in experts], group, described)
        check_covers_data(group, described)  # the live mesh's data dims (DP, CP) hold other rows: all must average
        if expert_group is not None:
            check_not_sharded_over([(names[id(p)], p) for p in params if id(p) in experts], expert_group,
                                   "expert_data_parallel", "expert-data-parallel")
        if replicas is not None and experts:
            raise ValueError("expert parameters with fault-tolerant replicas are not supported yet; wrap without replicas")
        owner = weakref.ref(self)
        for p in params:
            p._vemesh_ddp = owner  # type: ignore[attr-defined]
        self.module = module
        self.data_parallel_group = group
        self.process_group = group  # torch DDP's name for it
        self.dp_size = dist.get_world_size(group)
        self.dp_rank = dist.get_rank(group)
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.bucket_size = bucket_size
        self.broadcast_buffers = broadcast_buffers
        #: torch DDP's flag, toggled by :meth:`no_sync` (and by libraries that set it directly).
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True  #: torch DDP's: the next forward broadcasts the buffers
        self.reducer = PipelineReducer()
        self._params = params
        #: The parameters whose gradients this wrapper averages, in its buffers' order (read by ZeRO-1 and clipping).
        self.averaged_parameters = tuple(params)
        self._param_names = self.parameter_names = names  #: ``id(p)`` -> the parameter's name in the module
        self._module_params = list(module.parameters())  # to notice parameters replaced after wrapping
        self._in_backward = False
        self._sync_this_pass = True
        self._arrived: set[int] = set()
        self.holds_unsynced_grads = False  #: gradients accumulated under no_sync() were never averaged
        #: The expert-data-parallel group (None without expert parameters), and the experts' ids.
        self.expert_data_parallel_group = expert_group
        self._experts = self.expert_parameter_ids = experts  #: the ``id()`` of every expert parameter (averaged over EDP)
        #: The fault-tolerant replica dim gradients are averaged across after DP (None: no such dim).
        self.replicas = replicas
        self._tp_to_check = tp_group_beside(set(dist.get_process_group_ranks(group))) if check_tp_gradients else None
        self.inputs_seen: torch.Tensor | None = None  #: until the TP check: the forwards' inputs, summed (its cause)

        check_placement(list(module.named_parameters()), experts, group, expert_group)  # ties kept; names, shapes agree
        if self.dp_size > 1:  # every DP rank starts from the first one's parameters and buffers
            dense = [local_tensor(p) for p in module.parameters() if id(p) not in experts]
            broadcast_from_first(dense + self._module_buffers(), group)
            if expert_group is not None and dist.get_world_size(expert_group) > 1:  # experts: from their EDP peer
                broadcast_from_first([local_tensor(p) for p in module.parameters() if id(p) in experts], expert_group)

        #: One contiguous gradient buffer per (dense or expert, parameter dtype, gradient dtype).
        self.grad_buffers: list[GradBuffer] = make_buffers(params, experts, group, expert_group, bucket_size,
                                                           fp32=accumulate_allreduce_grads_in_fp32)
        self._buffer_of = {id(p): b for b in self.grad_buffers for p in b.params}
        # What this wrapper puts in param.grad: the main_grad view, or where the dtype differs from the buffer's a
        # "holder" copy in the parameter's (versions tell whether anyone wrote to it since); a DTensor where needed.
        self._holder: dict[int, torch.Tensor] = {}
        self._holder_version: dict[int, int] = {}
        self._exposed: dict[int, torch.Tensor] = {}
        self._main_grad_like: list[torch.Tensor] = []  # main_grad shaped like each parameter (for norms)
        self._hooks: list[Any] = []
        #: gradients computed without accumulation since the last average (torch's zero-bubble weight pass)
        self.grads_outside = GradsOutside(self._exposed, self._buffer_of, self._holder, self._holder_version)
        for p in params:
            main_grad: torch.Tensor = p.main_grad  # type: ignore[attr-defined]
            self._main_grad_like.append(like(p, main_grad))
            if main_grad.dtype == p.dtype:
                self._exposed[id(p)] = self._main_grad_like[-1]
            else:
                self._holder[id(p)] = torch.zeros_like(main_grad, dtype=p.dtype)
                self._exposed[id(p)] = like(p, self._holder[id(p)])
                self._hooks.append(p.register_hook(weak_param_hook(p, weak_method(self._fold_grad))))
            self._hooks.append(p.register_hook(weak_param_hook(p, self.grads_outside.computed)))
            self._hooks.append(p.register_post_accumulate_grad_hook(weak_method(self._post_accumulate)))
        # every torch optimizer asks this wrapper before it steps (the hook is removed with the wrapper)
        self._hooks.append(register_optimizer_step_pre_hook(step_guard(self)))
        weakref.finalize(self, release_params, params, owner, self._hooks).atexit = False

    # ------------------------------------------------------------------ module
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Run the wrapped module (after broadcasting its buffers, see ``broadcast_buffers``)."""
        if self._in_backward:  # a backward pass raised before its end-of-backward callback ran
            self._abandon_pass()
        if training := torch.is_grad_enabled():
            check_params_kept(self.module, self._module_params, self._buffer_of)
        if self.broadcast_buffers and self.dp_size > 1 and self.require_forward_param_sync:
            held = sharded_buffers()  # a context_parallel's shards differ by CP rank: never broadcast over them
            if buffers := [b for b in self._module_buffers() if id(b) not in held]:
                broadcast_from_first(buffers, self.data_parallel_group)
        # as torch's DDP (evaluations under no_grad too): the forward after one without gradient sync keeps the buffers
        self.require_forward_param_sync = training and self.require_backward_grad_sync
        if self._tp_to_check is not None and training:
            self.inputs_seen = inputs_fingerprint((args, kwargs), self.inputs_seen)
        return self.module(*args, **kwargs)

    def _module_buffers(self) -> list[torch.Tensor]:
        return [local_tensor(b) for b in self.module.buffers()]

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("a vemesh DistributedDataParallel holds process groups and gradient-buffer views and cannot be "
                        "pickled or deep-copied; copy or save model.module (or its state_dict) instead")

    def register_comm_hook(self, state: object, hook: Any) -> None:  # the buckets always average
        raise NotImplementedError("vemesh DistributedDataParallel has no communication hooks; its buckets always all-reduce")

    def join(self, *args: Any, **kwargs: Any) -> Any:  # every DP rank must run the same number of passes
        raise NotImplementedError("vemesh DistributedDataParallel does not support uneven inputs (join); give every DP rank the same number of batches")

    # ------------------------------------------------------------------- hooks
    def _begin_pass(self) -> None:
        """At the first gradient of a backward pass: decide whether it averages, and queue the end."""
        if self._in_backward:
            return
        self._in_backward = True
        self._sync_this_pass = self.require_backward_grad_sync or (self.dp_size == 1 and self.replicas is None)
        self._arrived = set()
        torch.autograd.Variable._execution_engine.queue_callback(self._end_pass)

    def _fold_grad(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        """Tensor pre-hook of a low-precision parameter: fold its new gradient into the fp32 main_grad.

        It runs before autograd adds ``grad`` into p.grad: accumulation keeps fp32 whatever happens to the .grad.
        """
        key = id(p)
        holder = self._holder[key]
        self._begin_pass()
        main: torch.Tensor = p.main_grad  # type: ignore[attr-defined]
        current = p.grad
        new = local_grad(p, grad)
        with torch.no_grad():
            if current is None:  # cleared with set_to_none: the gradient so far is zero
                main.copy_(new)
            elif current is self._exposed[key] and holder._version == self._holder_version.get(key):
                main.add_(new)  # main_grad is the exact value behind .grad
            else:  # .grad was replaced or written to (zero_(), unscale_, clipping): it is the truth
                main.copy_(local_grad(p, current))
                main.add_(new)

    @torch.no_grad()
    def _post_accumulate(self, p: torch.Tensor) -> None:
        self._begin_pass()
        key = id(p)
        self.grads_outside.accumulated(key)
        exposed = self._exposed[key]
        if key in self._holder:
            self._expose(p)
        elif p.grad is not exposed:  # autograd made a new tensor (.grad was None or replaced)
            p.main_grad.copy_(local_grad(p, p.grad))  # type: ignore[attr-defined]
            point_grad(p, exposed, self._param_names[key])
        # else: autograd accumulated in place into the buffer view
        self._arrived.add(key)
        if self._sync_this_pass and self.overlap_grad_reduce:
            self._buffer_of[key].mark_ready(p)  # type: ignore[arg-type]

    def _expose(self, p: torch.Tensor) -> None:
        """Point ``p.grad`` at the buffer view, refreshing the low-precision copy if there is one."""
        key = id(p)
        holder = self._holder.get(key)
        if holder is not None:
            holder.copy_(p.main_grad)  # type: ignore[attr-defined]
            self._holder_version[key] = holder._version
        if p.grad is not self._exposed[key]:
            point_grad(p, self._exposed[key], self._param_names[key])

    def _end_pass(self) -> None:
        """End-of-backward callback: average now, or remember that the gradients are local only."""
        self._in_backward = False
        if self._sync_this_pass:
            self._sync()
        else:
            self.holds_unsynced_grads = True
            for buffer in self.grad_buffers:
                buffer.reset()

    @torch.no_grad()
    def _refresh_main_grad(self, p: nn.Parameter) -> None:
        """Make ``main_grad`` equal ``p.grad`` for a parameter that got no gradient in this pass."""
        key = id(p)
        current = p.grad
        main: torch.Tensor = p.main_grad  # type: ignore[attr-defined]
        if current is None:
            main.zero_()
        elif current is not self._exposed[key] or (
            key in self._holder and self._holder[key]._version != self._holder_version.get(key)
        ):
            main.copy_(local_grad(p, current))

    @torch.no_grad()
    def _sync(self) -> None:
        for buffer in self.grad_buffers:
            for p in buffer.params:
                if id(p) not in self._arrived:
                    self._refresh_main_grad(p)
            buffer.start_remaining()
        for buffer in self.grad_buffers:
            buffer.wait()
            if self.replicas is not None:  # then across the replicas (a failure keeps the step from committing)
                self.replicas.average_(buffer.data)
        for p in self._params:
            self._expose(p)
        self._arrived = set()
        self.holds_unsynced_grads = False
        self.grads_outside.clear(self.grad_buffers)
        self._tp_to_check = tp_gradients_checked(self, self._tp_to_check)

    def _abandon_pass(self) -> None:
        for buffer in self.grad_buffers:
            buffer.wait()
        self._in_backward = False
        self._arrived = set()

    # ------------------------------------------- for vemesh.optim (reads the buffer)
    @torch.no_grad()
    def _grads_into_buffer(self) -> list[str]:
        """Make every ``main_grad`` equal its ``param.grad`` (after outside writes); names of parameters without one."""
        if self._in_backward:
            raise RuntimeError("the optimizer stepped during a backward pass; step after backward returns")
        missing = []
        for p in self._params:
            if p.grad is None:
                missing.append(self._param_names[id(p)])
                continue
            self._refresh_main_grad(p)
            if p.grad is not self._exposed[id(p)]:
                self._expose(p)
        return missing

    def _norm_parts(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The ``main_grad`` of the dense parameters, and of the plain-tensor experts (which differ across the EP
        group); DTensor experts (ExpertParallel's) go with the dense ones: torch's norm sums them over EP."""
        plain = {id(p) for p in self._params if id(p) in self._experts and not isinstance(p, DTensor)}
        dense = [g for p, g in zip(self._params, self._main_grad_like) if id(p) not in plain]
        return dense, [g for p, g in zip(self._params, self._main_grad_like) if id(p) in plain]

    # --------------------------------------------------------------- public API
    def finish_grad_sync(self, force: bool = False) -> None:
        """Average gradients accumulated under :meth:`no_sync` now; otherwise do nothing.

        Backward already averages when it ends (outside ``no_sync()``), so this is only needed
        to average a ``no_sync()`` accumulation without another backward. Safe to call any
        number of times; every DP rank must make the same calls.

        Args:
            force: average every ``param.grad`` now, even if no backward pass left anything
                unaveraged. For code that writes gradients where no gradient hook sees them:
                torch's zero-bubble pipeline schedules compute weight gradients with
                ``torch.autograd.grad`` and add them by hand (``weight.grad += dw``). Averaging
                again is exact for what an earlier pass already averaged (it is the same on
                every rank).
        """
        if self._in_backward:
            raise RuntimeError("finish_grad_sync() was called during a backward pass; call it after backward returns")
        if self.holds_unsynced_grads or force:
            self._sync()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear every gradient, as ``nn.Module.zero_grad``.

        Args:
            set_to_none: set ``param.grad`` to None (the next backward overwrites the buffer);
                otherwise zero the buffer and keep ``param.grad`` as zeroed views.
        """
        with torch.no_grad():
            for p in self._params:
                p.grad = None
            if not set_to_none:
                for buffer in self.grad_buffers:
                    buffer.data.zero_()
                for p in self._params:
                    self._expose(p)
        self.holds_unsynced_grads = False
        self.grads_outside.clear(self.grad_buffers)

    def zero_grad_buffer(self) -> None:
        """veScale's name for ``zero_grad(set_to_none=False)``: zero the buffer in place."""
        self.zero_grad(set_to_none=False)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes started inside the block accumulate locally, without collectives.

        Example::

            with model.no_sync():
                loss_fn(model(x0), y0).backward()   # accumulates only
            loss_fn(model(x1), y1).backward()       # averages the sum of both over DP
        """
        previous, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = previous
