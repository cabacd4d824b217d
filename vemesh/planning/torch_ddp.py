"""torch's own ``DistributedDataParallel`` planned as it runs: its C++ reducer, on the fake world.

A parallelize function that wraps the model (or a pipeline stage) in torch's DDP, or applies torch's composable
``replicate`` (torchtitan's DDP, which builds torch's DDP at the first forward: built here before the step), gets
torch's reducer in the trace, as in a run: its buckets (a flat copy of the gradients in the parameters' dtype, made when DDP is built; ``.grad``
beside them under torch's default, views into them with ``gradient_as_bucket_view=True``), each bucket's all-reduce as
its gradients are ready, and ``no_sync``. Three steps of a run cannot happen on fake tensors, and the planner stands
in for each:

* DDP's constructor checks that every rank holds parameters of the same shapes
  (``_verify_param_shape_across_processes``) by reading the values an all-gather brought. On the fake world every
  rank is the one traced, so there is nothing to compare: the check is skipped while the user's function runs
  (:func:`shapes_not_compared`).
* The reducer's built-in all-reduce hands its C++ future a value that the fake process group never gives. A comm hook
  of the planner's does what the built-in does (each bucket divided by the group's size and all-reduced in place,
  on the fake group, whose collectives the trace counts), and tells the trace which storages are buckets: they are
  counted as gradients (:class:`~vemesh.planning.fake_world.Held`).
* After the first step the reducer cuts its buckets again, in the order the gradients came, and agrees on that order
  across ranks by reading a tensor's values: not done here (:class:`_NoRebuild`). The rebuild moves the same bytes
  into buckets of the same caps, so a step holds and sends what it did; only the calls per step follow the
  first step's cut.

A real run of torch's DDP over DP 2 (``bench/plan_user_run.py``) peaked at the plan's bytes to the byte, with the
gradients beside the buckets and as views into them. What the planner does not run is refused in one line: a comm hook
of the user's (a compression hook, DDP's ``mixed_precision``), whose own work it would not count, and
``find_unused_parameters=True`` or ``static_graph=True``, under which the reducer reads which parameters each rank
used (its backward failed as if the user's step had read a value).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vemesh.parallel.ddp import DistributedDataParallel

__all__ = ["run_as_planned", "shapes_not_compared", "torch_ddps"]


def torch_ddps(parts: list[nn.Module]) -> list[nn.Module]:
    """torch's DDP modules in ``parts`` (the model, or a PP rank's stage modules), vemesh's (a subclass) left out, and
    the modules torch's composable ``replicate`` was applied to (torchtitan's DDP: torch's DDP, built at the first
    forward; not the ``replicate`` of ``replicate_with_fsdp``, FSDP2's engine)."""
    from torch.distributed._composable.contract import _get_registry
    from torch.distributed.fsdp import FSDPModule

    return [m for part in parts for m in part.modules()
            if isinstance(m, nn.parallel.DistributedDataParallel) and not isinstance(m, DistributedDataParallel)
            or "replicate" in (_get_registry(m) or {}) and not isinstance(m, FSDPModule)]


def _ddp_of(wrapped: nn.Module) -> nn.parallel.DistributedDataParallel:
    """``wrapped`` if it is torch's DDP; else the DDP torch's composable ``replicate`` builds at the module's first
    forward, built now (its comm hooks registered), so that the planner's hook is the one it runs."""
    if isinstance(wrapped, nn.parallel.DistributedDataParallel):
        return wrapped
    from torch.distributed._composable.replicate import replicate

    state = replicate.state(wrapped)
    if state._init_args or state._init_kwargs:
        with shapes_not_compared():
            state.lazy_init()
    return state._ddp


@contextlib.contextmanager
def shapes_not_compared() -> Iterator[None]:
    """Inside, torch's DDP is built without comparing the ranks' parameter shapes (see the module docstring)."""
    import torch.nn.parallel.distributed as ddp_module

    real = ddp_module._verify_param_shape_across_processes
    ddp_module._verify_param_shape_across_processes = _one_rank
    try:
        yield
    finally:
        ddp_module._verify_param_shape_across_processes = real


def _one_rank(process_group: Any, tensors: Any, logger: Any = None) -> None:
    """The shapes are this rank's on every rank of a fake world: nothing to compare."""


def run_as_planned(wrapped: list[nn.Module], buckets: list[torch.Tensor], name: str) -> None:
    """Each DDP of ``wrapped`` (:func:`torch_ddps`) set to run on the fake world (see the module docstring): the
    planner's comm hook, which adds each bucket to ``buckets`` the first time it all-reduces it, and no bucket rebuild.
    Raises ``ValueError`` (one line) where the user's function gave DDP a comm hook or mixed precision of its own."""
    seen: set[int] = set()
    for ddp in map(_ddp_of, wrapped):
        flags = [f for f in ("find_unused_parameters", "static_graph") if getattr(ddp, f, False)]
        if flags:  # else the backward fails in C++ as if the user's step read a value (.item())
            raise ValueError(f"--parallelize {name} built torch's DistributedDataParallel with {'=True and '.join(flags)}"
                             "=True, under which its reducer reads which parameters each rank used: values a plan's "
                             "fake tensors do not have: plan it without (the bytes it holds differ by about a flag per "
                             "parameter)")
        if ddp._comm_hooks or getattr(ddp, "mixed_precision", None) is not None:
            what = "a comm hook" if ddp._comm_hooks else "mixed_precision (its own cast and hook)"
            raise ValueError(f"--parallelize {name} gave torch's DistributedDataParallel {what}: the planner runs "
                             "torch's reducer with its plain all-reduce and would not count the hook's own work; plan "
                             "the job without it (the bytes it keeps are torch's default's or fewer)")
        try:
            ddp.register_comm_hook((ddp.process_group, buckets, seen), _all_reduce)
        except RuntimeError as e:  # a built-in hook (register_comm_hook's twin) was registered: once only
            raise ValueError(f"--parallelize {name} gave torch's DistributedDataParallel a built-in comm hook "
                             f"(torch: {str(e).splitlines()[0]}): the planner runs torch's reducer with its plain "
                             "all-reduce; plan the job without it") from None
        ddp.reducer = _NoRebuild(ddp.reducer)


def _all_reduce(state, bucket):  # type: ignore[no-untyped-def]
    """torch's default: the bucket divided by the group's size and all-reduced, in place; done when it returns.
    (Not annotated: torch's ``register_comm_hook`` reads the annotations, and with this module's postponed ones it
    would meet strings where it looks for ``dist.GradBucket``.)"""
    group, buckets, seen = state
    tensor = bucket.buffer()
    if (key := tensor.untyped_storage()._cdata) not in seen:
        seen.add(key)
        buckets.append(tensor)
    tensor.div_(dist.get_world_size(group))
    dist.all_reduce(tensor, group=group)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(tensor)
    return done


class _NoRebuild:
    """torch's reducer, but for its bucket rebuild after the first step (see the module docstring)."""

    def __init__(self, reducer: Any) -> None:
        object.__setattr__(self, "_reducer", reducer)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._reducer, name)

    def _rebuild_buckets(self) -> bool:
        return False
