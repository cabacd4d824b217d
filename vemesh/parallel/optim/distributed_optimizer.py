"""ZeRO-1: each data-parallel rank keeps optimizer state for 1/DP of the parameters.

:class:`DistributedOptimizer` is a ``torch.optim.Optimizer`` over the models' parameters, so LR
schedulers, ``GradScaler``, ``clip_grad_norm_`` and DCP's ``get_state_dict`` use it as they use
``torch.optim.AdamW``. Under the hood a step is:

1. the models' gradients are already averaged over DP (:class:`~vemesh.ddp.DistributedDataParallel`
   finishes that when ``loss.backward()`` returns) and live in flat buffers;
2. optionally clip by the global norm (:mod:`vemesh.parallel.optim.clip_grad`);
3. an inner torch optimizer of the requested class steps only this rank's slice of each buffer
   (:mod:`vemesh.parallel.optim.param_buffer`): flat fp32 tensors, views of the parameters for fp32
   models, fp32 masters for bf16/fp16 ones;
4. every rank's updated slice is gathered into the parameters.

With DP = 2 and one buffer of 10 elements, rank 0 steps elements ``[0, 5)`` and holds Adam
state for 5 elements; rank 1 steps ``[5, 10)``; after the gather both see all 10.

Each gradient buffer is sharded over its own group: the DP group for dense parameters, the
expert-data-parallel group for the experts of a model wrapped with ``expert_data_parallel``
(only the EDP ranks hold the same experts). Clipping inside :meth:`step` counts every expert once.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vemesh.parallel.ddp.distributed_data_parallel import DistributedDataParallel
from vemesh.parallel.ddp.support import weak_method
from vemesh.parallel.optim.clip_grad import check_sum_groups, pipeline_groups, total_norm
from vemesh.parallel.optim.param_buffer import ParamShard
from vemesh.parallel.optim.state import gather_state_dict, load_local_state, local_state, scatter_state_dict

__all__ = ["DistributedOptimizer"]

#: Largest flat tensor handed to the inner optimizer on a CPU, in elements (2 MiB of fp32). An optimizer
#: makes several passes per tensor; chunks this size stay in cache. Measured on this project's
#: CPU machine, torch.optim.AdamW (default, for-loop implementation) over 4.2M elements:
#: one flat tensor 24.6 ms, 512K-element chunks 12.9 ms, 128K-element chunks 12.6 ms.
#: On a GPU the runs stay whole: torch's foreach and fused optimizers cut their own kernels, and each
#: chunk only adds host work to every step (AdamW reads each tensor's step count for its two bias
#: corrections: on an H200, 1,158 of the 5,627 ops of a 304M-parameter GPT's host-bound step).
MAIN_PARAM_CHUNK = 1 << 19


def _chunks(t: torch.Tensor, size: int | None = None) -> tuple[torch.Tensor, ...]:
    """``t`` cut for the inner optimizer: into ``size`` elements (0: whole; None: :data:`MAIN_PARAM_CHUNK` on a CPU,
    whole elsewhere)."""
    size = (MAIN_PARAM_CHUNK if t.device.type == "cpu" else 0) if size is None else size
    return t.split(size) if size else (t,)


def _check_models(models: Any) -> list[DistributedDataParallel]:
    if models is None:
        raise TypeError("models is required: pass the wrapped models, e.g. models=[DistributedDataParallel(model, mesh['DP'])]")
    if isinstance(models, nn.Module) or not isinstance(models, Sequence) or not models:
        raise TypeError(f"models must be a non-empty list of vemesh DistributedDataParallel, got {models!r:.80}")
    for i, m in enumerate(models):
        if not isinstance(m, DistributedDataParallel):
            raise TypeError(
                f"models[{i}] must be a vemesh DistributedDataParallel, got {type(m).__name__}; "
                "wrap it with vemesh.ddp.DistributedDataParallel(model, mesh['DP'])"
            )
    ranks = [dist.get_process_group_ranks(m.data_parallel_group) for m in models]
    if any(r != ranks[0] for r in ranks):
        raise ValueError(f"all models must share one data-parallel group, got groups with ranks {ranks}")
    experts = {tuple(dist.get_process_group_ranks(m.expert_data_parallel_group))
               for m in models if m.expert_data_parallel_group is not None}
    if len(experts) > 1:
        raise ValueError(f"all models must share one expert-data-parallel group, got groups with ranks {sorted(experts)}")
    return list(models)


def _groups_of(optimizer: Any, params: list[nn.Parameter], kwargs: dict[str, Any]) -> tuple[type, list[list[nn.Parameter]], list[dict[str, Any]]]:
    """The optimizer class, each param group's model parameters, and each group's options."""
    if isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer):
        return optimizer, [params], [{}]
    if not isinstance(optimizer, torch.optim.Optimizer) or isinstance(optimizer, DistributedOptimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer subclass or instance, got {optimizer!r:.80}")
    if kwargs:
        raise ValueError(f"optimizer_kwargs {sorted(kwargs)} are only accepted with an optimizer class, not an instance")
    if optimizer.state:
        raise ValueError(f"optimizer already holds state for {len(optimizer.state)} parameters; pass a freshly built one")
    known = {id(p) for p in params}
    members, options = [], []
    for gid, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in known:
                raise ValueError(
                    f"optimizer param group {gid} holds a tensor of shape {tuple(p.shape)} that is not a trainable "
                    "parameter of the models"
                )
        members.append(list(group["params"]))
        options.append({k: v for k, v in group.items() if k != "params"})
    return type(optimizer), members, options


class DistributedOptimizer(torch.optim.Optimizer):
    """A torch optimizer whose state and update are sharded over the data-parallel group (ZeRO-1).

    Args:
        optimizer: a ``torch.optim.Optimizer`` subclass (built with ``optimizer_kwargs``), or an
            instance built over the models' parameters (its param groups and hyperparameters are
            kept; it must have no state yet).
        models: the :class:`~vemesh.ddp.DistributedDataParallel` models to optimize, over one DP group.
        clip_grad: clip gradients to this global 2-norm inside :meth:`step` (``0.0`` or None: no
            clipping); the norm equals ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
            The last norm is :attr:`grad_norm`.
        overlap_param_gather: leave the parameter gather running after :meth:`step`, to overlap
            with whatever comes before the next forward. It is waited for before the models'
            next forward, ``state_dict()``, the next step, or :meth:`finish_param_gather`;
            parameters read any other way in between may be stale.
        grad_to_fp32: step with fp32 gradients (veScale's flag; only True is possible, because
            the fp32 main params need fp32 gradients).
        optimizer_kwargs: options for ``optimizer`` when it is a class (veScale's form).
        clip_groups: with ``clip_grad``, the groups whose ranks hold other parts of the model (the pipeline
            group), as :func:`~vemesh.optim.clip_grad_norm_`'s ``groups``; required on a mesh with PP > 1.
        main_param_chunk: the most elements of one flat tensor handed to the inner optimizer; 0 keeps each run of
            this rank's slices whole; None (the default) picks by device: 512K on a CPU (:data:`MAIN_PARAM_CHUNK`),
            whole elsewhere. The cut changes no value and no state dict.
        **kwargs: more options for ``optimizer`` when it is a class.

    :attr:`param_groups` hold the models' parameters and drive the shards: change ``lr`` there
    (or attach any LR scheduler). :meth:`state_dict` is torch's per-parameter format, each state
    tensor shaped and sharded like its parameter (plus ``master_param`` for bf16/fp16 models),
    gathered over DP: a collective, so call it on every DP rank, as DCP does. :attr:`state` is
    this rank's shard state, keyed by the inner optimizer's flat tensors (:attr:`optimizer`).

    Example::

        model = DistributedDataParallel(model, VESCALE_DEVICE_MESH["DP"])
        opt = DistributedOptimizer(torch.optim.AdamW, models=[model], optimizer_kwargs={"lr": 3e-4})
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        opt.zero_grad(); loss_fn(model(x), y).backward(); opt.step(); sched.step()
    """

    #: load_state_dict takes fp32 master weights from a ``master_param`` state entry.
    _loads_master_params = True
    #: step() asks fault-tolerant replicas for their commit vote itself (see vemesh.parallel.ddp.support's step guard).
    _asks_replicas = True

    def __init__(
        self,
        optimizer: type[torch.optim.Optimizer] | torch.optim.Optimizer,
        models: Sequence[DistributedDataParallel] | None = None,
        clip_grad: float | None = 0.0,
        overlap_param_gather: bool = False,
        grad_to_fp32: bool = True,
        optimizer_kwargs: Mapping[str, Any] | None = None,
        clip_groups: Sequence[dist.ProcessGroup] | None = None,
        main_param_chunk: int | None = None,
        **kwargs: Any,
    ) -> None:
        self.models = _check_models(models)
        if main_param_chunk is not None and (isinstance(main_param_chunk, bool) or not isinstance(main_param_chunk, int)
                                             or main_param_chunk < 0):
            raise ValueError(f"main_param_chunk must be a number of elements >= 0 (0: whole runs) or None (by device), "
                             f"got {main_param_chunk!r}")
        if clip_grad is None:
            clip_grad = 0.0
        if isinstance(clip_grad, bool) or not isinstance(clip_grad, (int, float)) or clip_grad < 0:
            raise ValueError(f"clip_grad must be a non-negative number (0 or None disables clipping), got {clip_grad!r}")
        if grad_to_fp32 is not True:
            raise ValueError(f"grad_to_fp32={grad_to_fp32!r} is not supported: the fp32 main params step with fp32 gradients")
        clashing = sorted(set(optimizer_kwargs or {}) & set(kwargs))
        if clashing:
            raise ValueError(f"options {clashing} were given both in optimizer_kwargs and as keyword arguments")
        options = {**(optimizer_kwargs or {}), **kwargs}
        self.clip_grad = float(clip_grad)
        self._clip_groups = pipeline_groups(clip_groups, "clip_groups") if self.clip_grad > 0 else []
        check_sum_groups([p for m in self.models for p in m.averaged_parameters], {e for m in self.models for e in m.expert_parameter_ids},
                         self._clip_groups)
        self.overlap_param_gather = bool(overlap_param_gather)
        #: The global gradient norm before clipping at the last :meth:`step` (when ``clip_grad`` is set).
        self.grad_norm: torch.Tensor | None = None
        params = [p for m in self.models for b in m.grad_buffers for p in b.params]
        cls, members, group_options = _groups_of(optimizer, [p for m in self.models for p in m.averaged_parameters], options)
        group_of = {id(p): gid for gid, ps in enumerate(members) for p in ps}
        #: This rank's slices of each gradient buffer (what it steps), read by the state dicts (state.py).
        self.shards = [ParamShard(b, group_of) for m in self.models for b in m.grad_buffers]
        inner_groups: list[dict[str, Any]] = [dict(o, params=[]) for o in group_options]
        #: ``(inner parameter, its gradient)``: one per chunk of each run of this rank's slices.
        self._inner: list[tuple[nn.Parameter, torch.Tensor]] = []
        #: ``(inner parameter, shard index, first buffer element)``, for the per-parameter state dict.
        self.inner_at: list[tuple[nn.Parameter, int, int]] = []
        for si, shard in enumerate(self.shards):
            for (gid, start, _), main, grad in zip(shard.runs, shard.main, shard.grads):
                at = start
                for main_chunk, grad_chunk in zip(_chunks(main, main_param_chunk), _chunks(grad, main_param_chunk)):
                    inner = nn.Parameter(main_chunk)  # shares storage with main
                    inner_groups[gid]["params"].append(inner)  # type: ignore[index]
                    self._inner.append((inner, grad_chunk))
                    self.inner_at.append((inner, si, at))
                    at += main_chunk.numel()
        for group in inner_groups:  # a small model can leave a rank (or a group) with nothing to own
            if not group["params"]:
                group["params"].append(nn.Parameter(torch.zeros(0, device=params[0].device)))
        for inner, grad in self._inner:
            inner.grad = grad  # fixed views: the inner optimizer always sees this rank's gradient slices
        #: The inner torch optimizer, stepping only this rank's flat fp32 shard tensors.
        self.optimizer: torch.optim.Optimizer = cls(inner_groups, **options)
        if isinstance(optimizer, torch.optim.Optimizer):
            self.optimizer.defaults.update(optimizer.defaults)
        self._building = True
        super().__init__(
            [{**{k: v for k, v in g.items() if k != "params"}, "params": ps} for g, ps in zip(self.optimizer.param_groups, members)],
            dict(self.optimizer.defaults),
        )
        self._building = False
        self.committed = True
        #: The data-parallel group the shards are split over.
        self.dp_group = self.models[0].data_parallel_group
        self._pending: list[dist.Work] = []
        self._waited: list[dist.Work] = []  #: the last gather's works, held as DDP's (grad_buffer.GradBuffer.wait)
        if self.overlap_param_gather:
            wait = weak_method(self._wait_gather)  # the modules must not keep this optimizer alive
            for m in self.models:
                m.module.register_forward_pre_hook(lambda *_: wait())
                m.module.register_state_dict_pre_hook(lambda *_, **__: wait())

    # ----------------------------------------------------- torch.optim.Optimizer
    @property  # type: ignore[override]
    def state(self) -> Mapping[Any, Any]:
        """This rank's shard state, read-only, keyed by the inner optimizer's flat tensors."""
        return types.MappingProxyType(self.optimizer.state)

    @state.setter
    def state(self, value: Any) -> None:  # torch.optim.Optimizer.__init__ assigns an empty dict
        if value:
            raise AttributeError("DistributedOptimizer.state is read-only; load state with load_state_dict()")

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only while building: the shards are laid out once, over the models' parameters."""
        if not getattr(self, "_building", False):
            raise NotImplementedError(
                "DistributedOptimizer shards the parameters of its models once; add_param_group is not supported. "
                "Build a new DistributedOptimizer (pass an optimizer instance to choose the param groups)"
            )
        super().add_param_group(param_group)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the models' gradients (see :meth:`DistributedDataParallel.zero_grad`).

        With fault-tolerant replicas (:mod:`vemesh.ft`) it first starts the step's quorum, as torchft's
        ``OptimizerWrapper`` does: a replica that is behind heals from a live peer here.
        """
        replicas = self.models[0].replicas
        if replicas is not None and not replicas.in_step:
            replicas.start_step()
        for m in self.models:
            m.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Clip (if ``clip_grad``), step this rank's slices, and gather the parameters.

        Args:
            closure: re-evaluates the model and returns the loss, as for any torch optimizer.

        Returns:
            The closure's loss, or None.

        With fault-tolerant replicas, the step happens only if torchft's ``should_commit`` says every
        replica reduced without error; otherwise the gradients are dropped and :attr:`committed` is False.

        Raises:
            RuntimeError: gradients accumulated under ``no_sync()`` were never averaged.
            ValueError: some parameters have a gradient and others have none.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._wait_gather()
        replicas = self.models[0].replicas
        #: Whether the last :meth:`step` updated the parameters (False: the replicas voted it down).
        self.committed = replicas is None or replicas.should_commit()
        if not self.committed:  # the gradients are dropped (not self.zero_grad(): that would start the next quorum)
            for m in self.models:
                m.zero_grad()
            return loss
        missing: list[str] = []
        for m in self.models:
            missing += m._grads_into_buffer()
        if missing:
            total = sum(len(m.averaged_parameters) for m in self.models)
            if len(missing) == total:
                return loss  # nothing has a gradient: nothing to do, as a torch optimizer
            raise ValueError(
                f"{len(missing)} of {total} parameters have no gradient (e.g. {missing[0]!r}); DistributedOptimizer steps "
                "flat shards and cannot skip some of them: clear gradients with zero_grad(set_to_none=False), or set "
                "requires_grad=False on parameters that must not change"
            )
        for shard in self.shards:
            if shard.params_changed():
                shard.reload()
            shard.grads_to_main()
        if self.clip_grad > 0:
            parts = [m._norm_parts() for m in self.models]
            dense = [g for d, _ in parts for g in d]
            experts = [g for _, e in parts for g in e]
            edp = next((m.expert_data_parallel_group for m in self.models if m.expert_data_parallel_group is not None), None)
            # each expert's (averaged) gradient sits on its EDP ranks: sum over the whole DP group, divide by EDP
            self.grad_norm = total_norm(dense, groups=self._clip_groups, expert_grads=experts,
                                        expert_groups=[self.dp_group] if edp else [],
                                        expert_copies=dist.get_world_size(edp) if edp else 1)
            torch.nn.utils.clip_grads_with_norm_([p for p, _ in self._inner], self.clip_grad, self.grad_norm)
        for inner, group in zip(self.optimizer.param_groups, self.param_groups):
            inner.update({k: v for k, v in group.items() if k != "params"})
        self.optimizer.step()
        self._start_gather()
        if not self.overlap_param_gather:
            self._wait_gather()
        return loss

    def _start_gather(self) -> None:
        for shard in self.shards:
            self._pending += shard.start_gather()
        self._gathering = True

    def finish_param_gather(self) -> None:
        """Wait for the parameter gather left running by ``overlap_param_gather=True``.

        The models' next forward and ``state_dict()`` wait for it on their own; call this before
        reading parameters any other way (``model.parameters()``, ``p.data``) between
        :meth:`step` and the next forward. Without ``overlap_param_gather`` there is never
        anything to wait for.
        """
        self._wait_gather()

    def _wait_gather(self) -> None:
        if not getattr(self, "_gathering", False):
            return
        for work in self._pending:
            work.wait()
        self._waited, self._pending = self._pending, []
        for shard in self.shards:
            shard.finish_gather()
        self._gathering = False

    def reload_model_params(self) -> None:
        """Re-read the models' parameters now (:meth:`step` also does it when it sees them changed)."""
        self._wait_gather()
        for shard in self.shards:
            shard.reload()

    # ------------------------------------------------------------ state dicts
    def state_dict(self) -> dict[str, Any]:
        """torch's format over the models' parameters (a collective over DP).

        Returns:
            ``{"state": {index: {"exp_avg": ..., "step": ..., "master_param"?: ...}}, "param_groups":
            [{..., "params": [index, ...]}]}``, indices running over :attr:`param_groups` as in
            ``torch.optim.Optimizer.state_dict``; each state tensor is shaped and sharded like its
            parameter, so a plain ``torch.optim.AdamW`` on one process can load it.
        """
        self._wait_gather()
        return gather_state_dict(self)

    def local_state_dict(self) -> dict[str, Any]:
        """This rank's own shard state (no collective): what the same rank of another replica needs to take over."""
        self._wait_gather()
        return local_state(self)

    def load_local_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load :meth:`local_state_dict` of the same rank of a replica with this layout (after its model weights)."""
        self._wait_gather()
        load_local_state(self, state_dict)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load torch's per-parameter format (from :meth:`state_dict`, or any torch optimizer of this class).

        Every rank keeps the elements of its own slices; ``master_param`` entries, when present,
        become the weights (gathered into the models).
        """
        self._wait_gather()
        scatter_state_dict(self, state_dict)
