"""FSDP2 under a zero-bubble pipeline schedule: a step on gradients it never reduced is refused.

torch's zero-bubble schedules (``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``)
split each backward: the weight pass computes the weights' gradients with ``torch.autograd.grad`` and adds them to
``.grad`` by hand (``weight.grad += dw``). torch's FSDP2 misses them (torch 2.13): a Hugging Face Llama over PP 2 x
DP 2 under ZBV was 6e-3 from one process after 3 steps, where 1F1B was exact. vemesh's DDP has
``finish_grad_sync(force=True)`` for them; FSDP2 has nothing to call, so the step raises.

How it is seen: each FSDP2 parameter's unsharded tensor (the one autograd differentiates, made at the first
all-gather and kept; hooked after the module's first forward, whose hook then comes off) gets a tensor hook, which fires for ``backward()`` and ``torch.autograd.grad`` alike, and a
post-accumulate hook, which fires for ``backward()`` only (:class:`vemesh.parallel.ddp.support.GradsOutside`). A
gradient computed and never accumulated is a weight pass's.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.optim.optimizer import register_optimizer_step_pre_hook

from vemesh.parallel.ddp.support import GradsOutside

__all__ = ["watch_weight_passes"]

#: the sharded modules watched: (module, what its unsharded parameters saw, their names by id)
_WATCHED: list[tuple[weakref.ref, GradsOutside, dict[int, str]]] = []
_HOOK: list[Any] = []


def watch_weight_passes(module: nn.Module) -> None:
    """Watch ``module`` (just sharded by torch's ``fully_shard`` over more than one rank): its parameters' unsharded
    tensors are hooked after its first forward, and an optimizer step over its parameters raises once a gradient
    of them was computed outside accumulation."""
    seen, names, handle = GradsOutside(), {}, []

    def arm(mod: nn.Module, args: Any, out: Any) -> None:
        group = getattr(torch_fully_shard.state(mod), "_fsdp_param_group", None)
        params = getattr(group, "fsdp_params", ())
        for fsdp_param in params:
            tensor = getattr(fsdp_param, "_unsharded_param", None)
            if tensor is None or id(tensor) in names:
                continue
            names[id(tensor)] = fsdp_param._param_fqn or "?"
            tensor.register_hook(lambda grad, t=tensor: seen.computed(t, grad))
            tensor.register_post_accumulate_grad_hook(lambda t: seen.accumulated(id(t)))
        if len(names) == len(params):  # FSDP2 keeps each unsharded tensor from its first all-gather on: done
            handle.pop().remove()

    # run eagerly, as FSDP2's own hooks are, where the module is compiled (``block.compile(fullgraph=True)``,
    # torchtitan's habit): dynamo cannot trace a hook that registers hooks and removes its own handle
    handle.append(module.register_forward_hook(torch._dynamo.disable(arm, recursive=True,
                                                                     reason="vemesh's FSDP2 weight-pass watch")))
    _WATCHED.append((weakref.ref(module), seen, names))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_refuse))


def _refuse(optimizer: Any, args: Any, kwargs: Any) -> None:
    _WATCHED[:] = [entry for entry in _WATCHED if entry[0]() is not None]
    stepped = None
    for ref, seen, names in _WATCHED:
        if not seen.ids:
            continue
        stepped = stepped or {id(p) for group in optimizer.param_groups for p in group["params"]}
        module = ref()
        if module is None or not any(id(p) in stepped for p in module.parameters()):
            continue
        name = names.get(next(iter(seen.ids)), "?")
        raise RuntimeError(
            f"{type(optimizer).__name__}.step() would use gradients that FSDP2 never reduced over the data ranks (e.g. "
            f"that of {name!r}): a zero-bubble pipeline schedule (ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble, "
            "ScheduleDualPipeV) adds its weight pass's gradients by hand, and torch's FSDP2 misses them. Use "
            "Schedule1F1B, ScheduleInterleaved1F1B or ScheduleGPipe with FSDP2, or vemesh's DDP (with "
            "finish_grad_sync(force=True)) with a zero-bubble schedule"
        )
