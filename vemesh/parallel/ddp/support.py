"""Helpers of :class:`~vemesh.ddp.DistributedDataParallel`: argument checks, broadcasts, and the
hooks that hold their wrapper weakly."""

from __future__ import annotations

import weakref
from collections.abc import Container, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import is_fake
from torch.distributed.tensor import DTensor

from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
from vemesh.parallel.ddp.bucketing import DEFAULT_BUCKET_SIZE
from vemesh.parallel.ddp.grad_buffer import local_tensor
from vemesh.parallel.ddp.groups import resolve_group
from vemesh.parallel.experts.style import is_expert
from vemesh.parallel.ties import check_ties
from vemesh.parallel.tp_replicas import check_tp_gradients

__all__ = ["check_bucket_size", "broadcast_from_first",
           "PipelineReducer", "like", "weak_method", "release_params", "check_experts", "check_params_kept",
           "weak_param_hook", "check_replicas", "check_placement", "tp_gradients_checked", "GradsOutside"]

def weak_method(method: Any) -> Any:
    """``method`` as a plain function that holds its object weakly (a no-op once the object is gone).

    Hooks that a parameter keeps (tensor hooks, post-accumulate-grad hooks) live on the C++ side of
    the tensor, where Python's garbage collector cannot see them. A hook holding its wrapper strongly
    closes an uncollectable cycle (parameter -> hook -> wrapper -> parameter), and the wrapper, its
    buffers and its process groups then live until the interpreter is torn down, when gloo's worker
    threads can no longer take the GIL and the process aborts at exit.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any, **kwargs: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args, **kwargs)

    return call


def weak_param_hook(p: torch.Tensor, fold: Any) -> Any:
    """A tensor hook for ``p`` that calls ``fold(p, grad)``, holding ``p`` weakly (``fold`` comes from
    :func:`weak_method`): the hook lives on the parameter, which must not keep itself or its wrapper alive."""
    param = weakref.ref(p)

    def pre_hook(grad: torch.Tensor) -> None:
        q = param()
        if q is not None:
            fold(q, grad)

    return pre_hook


def release_params(params: Sequence[torch.Tensor], owner: Any, hooks: Sequence[Any]) -> None:
    """Once the wrapper ``owner`` (a weak reference) is freed: its hooks come off its parameters, and
    the parameters drop their views into its gradient buffer (``main_grad``), so the buffer's memory
    goes too, and are free to be wrapped again."""
    for handle in hooks:
        handle.remove()
    for p in params:
        if getattr(p, "_vemesh_ddp", None) is owner:
            for attr in ("main_grad", "_vemesh_ddp"):
                if hasattr(p, attr):
                    delattr(p, attr)


class GradsOutside:
    """The parameters whose gradient autograd computed without adding it to ``.grad`` since the wrapper last averaged
    or cleared: ``torch.autograd.grad``, as torch's zero-bubble pipeline schedules run their weight pass before they
    add its result by hand (``weight.grad += dw``), where no hook of the wrapper sees it. A tensor hook on every
    parameter (:meth:`computed`) fires for both; the post-accumulate hook (:meth:`accumulated`) only for a backward."""

    def __init__(self, *tables: dict) -> None:
        # a DDP wrapper's tables by parameter id, filled in place as it wraps (for :meth:`written`): what it put in
        # .grad, its buffer, the low-precision copy and that copy's version when it wrote it; none for FSDP2's watch
        self._tables = tables
        self.ids: set[int] = set()  #: computed outside accumulation since the last average or clear
        self._now: set[int] = set()  # computed in the running graph task, not accumulated (yet)
        self._task = -1  # the graph task whose end is queued to collect them
        self._versions: dict[int, int] = {}  # each gradient buffer's version at the last average or clear

    def computed(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        self._now.add(id(p))
        task = torch._C._current_graph_task_id()
        if task != self._task:  # once per graph task (an aborted one leaves nothing queued behind it)
            self._task = task
            torch.autograd.Variable._execution_engine.queue_callback(self._graph_ended)

    def accumulated(self, key: int) -> None:
        self._now.discard(key)

    def _graph_ended(self) -> None:
        self.ids |= self._now
        self._now = set()

    def clear(self, buffers: Sequence[Any]) -> None:
        """After an average (or a clear): nothing computed outside is pending; the buffers' versions are noted."""
        self.ids = set()
        self._versions = {id(b): b.data._version for b in buffers}

    def written(self, p: torch.Tensor) -> bool:
        """Whether ``p.grad`` was computed outside accumulation and changed since the wrapper averaged it: replaced,
        or written in place (its buffer's or its low-precision copy's version moved on)."""
        key, (exposed, buffer_of, holder, holder_version) = id(p), self._tables
        if key not in self.ids or p.grad is None:
            return False
        buffer = buffer_of[key]
        return (p.grad is not exposed[key] or buffer.data._version != self._versions.get(id(buffer))
                or (key in holder and holder[key]._version != holder_version.get(key)))


def step_guard(ddp: Any) -> Any:
    """The optimizer step pre-hook a wrapper owns (:func:`refuse_unapplied_step`), holding the wrapper weakly."""
    owner = weakref.ref(ddp)

    def hook(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        wrapper = owner()
        if wrapper is not None:
            refuse_unapplied_step(wrapper, optimizer)

    return hook


def refuse_unapplied_step(ddp: Any, optimizer: torch.optim.Optimizer) -> None:
    """What a wrapper's optimizer step pre-hook checks: no torch optimizer steps on ``ddp``'s gradients that skipped
    the DP average, or that were averaged across fault-tolerant replicas which did not vote to commit the step."""
    asks = getattr(optimizer, "_asks_replicas", False)  # ZeRO-1 asks the replicas itself
    if not ddp.holds_unsynced_grads and (ddp.replicas is None or asks) and not ddp.grads_outside.ids:
        return  # the common case
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    mine = [p for p in ddp.averaged_parameters if id(p) in ids]
    if not mine:
        return
    if ddp.replicas is not None and not asks and ddp.replicas.vote is not True:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() would apply gradients averaged across fault-tolerant replicas "
            f"without their vote to commit ({'voted down' if ddp.replicas.vote is False else 'no vote yet'}): a "
            "failed cross-replica reduce leaves a partial sum. Use vemesh.optim.DistributedOptimizer, or step only "
            "when replicas.should_commit() returns True"
        )
    names = [ddp.parameter_names[id(p)] for p in mine if p.grad is not None]
    if ddp.holds_unsynced_grads and names:
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() would use gradients of {len(names)} parameters (e.g. "
            f"{names[0]!r}) that were accumulated inside DistributedDataParallel.no_sync() and never averaged "
            "over the data-parallel group; run the last backward of the step outside no_sync(), or call "
            "model.finish_grad_sync() before stepping"
        )
    by_hand = [ddp.parameter_names[id(p)] for p in mine if ddp.grads_outside.written(p)]
    if by_hand and (ddp.dp_size > 1 or ddp.replicas is not None):
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() would use gradients of {len(by_hand)} parameters (e.g. "
            f"{by_hand[0]!r}) that torch.autograd.grad computed and that were written into .grad by hand after "
            "DistributedDataParallel last averaged, so they were never averaged over the data-parallel group: torch's "
            "zero-bubble pipeline schedules (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, ScheduleDualPipeV) "
            "do so in their weight pass. Call model.finish_grad_sync(force=True) on each stage's wrapper after "
            "schedule.step(), or step the schedule with vemesh.parallel.schedules.run_schedule"
        )


def check_params_kept(module: torch.nn.Module, wrapped: list[torch.Tensor], trained: Container[int]) -> None:
    """``RuntimeError`` if ``module``'s parameters are no longer ``wrapped``: their gradients would never be averaged
    (``parallelize_module`` or ``fully_shard`` applied after wrapping, for instance); or if one's ``requires_grad``
    is not what it was then (``trained``: the ids of those that required grad)."""
    now = list(module.parameters())
    if len(now) == len(wrapped) and all(a is b and a.requires_grad is (id(a) in trained) for a, b in zip(now, wrapped)):
        return
    kept = {id(p) for p in wrapped}
    flipped = next(((n, p) for n, p in module.named_parameters()
                    if id(p) in kept and p.requires_grad is not (id(p) in trained)), None)
    if flipped is not None:
        name, p = flipped
        what = ("requires grad, but did not when DistributedDataParallel wrapped the module: its gradient would "
                "never be averaged" if p.requires_grad else
                "stopped requiring grad after DistributedDataParallel wrapped the module: it would still get a "
                "gradient (zeros) and be stepped, where torch's optimizers skip a parameter without one")
        raise RuntimeError(f"parameter {name!r} {what}. Change requires_grad before wrapping: build DDP (and the "
                           "optimizer) again after freezing or unfreezing parameters")
    name = next((n for n, p in module.named_parameters() if id(p) not in kept), "?")
    raise RuntimeError(
        f"the wrapped module's parameters changed after DistributedDataParallel wrapped it (e.g. {name!r} is a new "
        "tensor: parallelize_module, fully_shard or load_state_dict(assign=True) ran on the module since): their "
        "gradients would never be averaged. Apply tensor parallelism and sharding first, then wrap with DDP"
    )


def point_grad(p: torch.Tensor, view: torch.Tensor, name: str) -> None:
    """``p.grad = view`` (the wrapper's view of its gradient buffer); a ``RuntimeError`` naming the parameter if its
    dtype or device changed after wrapping, where autograd's would only name the two dtypes."""
    try:
        p.grad = view
    except RuntimeError as e:
        if (p.dtype, p.device) == (view.dtype, view.device):
            raise
        raise RuntimeError(
            f"parameter {name!r} is {p.dtype} on {p.device}, but was {view.dtype} on {view.device} when "
            "DistributedDataParallel wrapped the module (.to(), .double(), .half() or .cuda() ran on it since): its "
            "gradient buffer cannot hold the new gradients. Convert the model before wrapping it; to convert a wrapped "
            "one, drop the wrapper and the optimizers built on it (del model, opt), convert, and wrap again") from e


def check_bucket_size(bucket_size: int | None) -> int:
    if bucket_size is None:
        return DEFAULT_BUCKET_SIZE
    if isinstance(bucket_size, bool) or not isinstance(bucket_size, int):
        raise TypeError(f"bucket_size must be an int number of elements or None, got {bucket_size!r}")
    if bucket_size <= 0:
        raise ValueError(f"bucket_size must be a positive number of elements or None, got {bucket_size}")
    return bucket_size


@torch.no_grad()
def broadcast_from_first(tensors: Sequence[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Give ``tensors`` the values of the group's first rank, one flat broadcast per dtype.

    Only tensors whose value differs are written: a buffer that autograd saved (an embedding's position indices)
    keeps its version, so a pipeline's later micro-batches do not invalidate the backward of the earlier ones.
    """
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.broadcast(flat, group=group, group_src=0)
        pairs = [(t, c.view(t.shape)) for t, c in zip(same, flat.split([t.numel() for t in same]))]
        changed = [(t, c) for t, c in pairs if is_fake(c) or not torch.equal(t, c)]  # a planner's fake: no values
        if changed:
            torch._foreach_copy_([t for t, _ in changed], [c for _, c in changed])


def like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a tensor like ``p``: a DTensor with ``p``'s mesh and placements if ``p`` is one."""
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


class PipelineReducer:
    """The one piece of torch DDP's reducer that ``torch.distributed.pipelining`` calls on a DDP stage.

    A pipeline stage calls ``submod.reducer.prepare_for_backward(outputs)`` before the last
    micro-batch's backward (and runs the others inside ``no_sync()``). vemesh decides whether to
    average when each backward pass starts, from ``require_backward_grad_sync``, so there is
    nothing to prepare.
    """

    def prepare_for_backward(self, outputs: Any) -> None:
        """Nothing to do (see the class docstring)."""





def check_experts(
    group: dist.ProcessGroup, expert_data_parallel: Any, expert_parameters: Any, params: list[torch.nn.Parameter],
) -> tuple[frozenset[int], dist.ProcessGroup | None]:
    """The expert parameters' ids and the expert-data-parallel group, checked against the DP group."""
    if (expert_data_parallel is None) != (expert_parameters is None):
        given, missing = ("expert_data_parallel", "expert_parameters") if expert_parameters is None else \
            ("expert_parameters", "expert_data_parallel")
        raise ValueError(f"{given} was given without {missing}; pass both (the EDP group, e.g. mesh['EDP'], "
                         "and the experts' parameters) or neither")
    if expert_data_parallel is None:
        tagged = [p for p in params if is_expert(p)]
        if not tagged:
            return frozenset(), None
        expert_data_parallel, expert_parameters = _mesh_edp(), tagged  # ExpertParallel's experts: average over EDP
    expert_group, _ = resolve_group(expert_data_parallel, "expert_data_parallel")
    experts = list(expert_parameters)
    trainable = {id(p) for p in params}
    for p in experts:
        if id(p) not in trainable:
            raise ValueError(f"expert_parameters holds a tensor of shape {tuple(p.shape)} that is not a trainable parameter "
                             "of the module")
    dense_ranks = dist.get_process_group_ranks(group)
    edp_ranks = dist.get_process_group_ranks(expert_group)
    if not set(edp_ranks) <= set(dense_ranks) or len(dense_ranks) % len(edp_ranks):
        raise ValueError(f"the expert-data-parallel group {edp_ranks} must be part of the data-parallel group "
                         f"{dense_ranks}, with a size that divides it (EP x EDP = DP)")
    if not experts:
        raise ValueError("expert_parameters is empty; leave expert_data_parallel and expert_parameters out for a dense model")
    return frozenset(map(id, experts)), expert_group


def _mesh_edp() -> dist.ProcessGroup:
    """The live mesh's EDP group, for experts that ExpertParallel sharded; ``ValueError`` without one."""

    if mesh.is_initialized() and mesh.layout.has("EDP"):
        return mesh.get_group("EDP")
    raise ValueError(
        "the module holds experts sharded by ExpertParallel, whose gradients average over EDP (the data ranks that "
        "hold the same experts), and VESCALE_DEVICE_MESH has no EDP dim: build the mesh with ParallelDims(..., ep=N), "
        "or pass expert_data_parallel= and expert_parameters="
    )


def check_replicas(named: list[tuple[str, torch.Tensor]], group: dist.ProcessGroup, what: str, hint: str) -> None:
    """Raise on every rank unless every rank of ``group`` holds the same parameter names and local shapes.

    torch DDP verifies shapes across its ranks the same way. Here it also catches parameters that are
    not replicas at all (each EP rank's experts carry their own numbers): averaging them, or
    broadcasting one rank's over the others, would train silently wrong.
    """
    if dist.get_world_size(group) == 1 or dist.get_backend(group) == "fake":
        return
    mine = [(n, tuple(local_tensor(p).shape)) for n, p in named]
    everyone: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(everyone, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    for rank, theirs in zip(ranks, everyone):
        if theirs != mine:
            ours, other = next(((a, b) for a, b in zip(mine + [None] * len(theirs), theirs + [None] * len(mine)) if a != b))
            raise ValueError(
                f"the {what} parameters differ across the ranks {ranks}: rank {dist.get_rank()} has "
                f"{ours[0] + ' ' + str(ours[1]) if ours else 'nothing more'} where rank {rank} has "
                f"{other[0] + ' ' + str(other[1]) if other else 'nothing more'}; {hint}"
            )


def check_placement(named: list[tuple[str, torch.Tensor]], experts: frozenset[int], group: dist.ProcessGroup,
                    expert_group: dist.ProcessGroup | None) -> None:
    """No tie was broken (:func:`~vemesh.parallel.ties.check_ties`); the dense parameters are replicas over the DP
    group, the experts over the EDP group (see :func:`check_replicas`)."""
    check_ties(named, "vemesh DistributedDataParallel")
    check_replicas([(n, p) for n, p in named if id(p) not in experts], group, "data-parallel",
                   "parameters that differ by rank, such as the experts of expert parallelism, go in "
                   "expert_parameters, with expert_data_parallel")
    if expert_group is not None:
        check_replicas([(n, p) for n, p in named if id(p) in experts], expert_group, "expert-data-parallel",
                       "each rank of expert_data_parallel must hold the same experts")


def tp_gradients_checked(ddp: Any, tp: dist.ProcessGroup | None) -> None:
    """At a DistributedDataParallel's averaged backward: :func:`~vemesh.parallel.tp_replicas.check_tp_gradients`
    of its plain-tensor dense parameters over ``tp`` (None: nothing to check). Returns what to check next time: None
    (the structure that makes a replica's gradient partial is fixed)."""
    if tp is not None:
        check_tp_gradients([(ddp.parameter_names[id(p)], p, p.grad) for p in ddp.averaged_parameters
                            if id(p) not in ddp.expert_parameter_ids and not isinstance(p, DTensor)], tp,
                           [ddp.data_parallel_group], "wrap with check_tp_gradients=False", inputs=ddp.inputs_seen)
    return None
