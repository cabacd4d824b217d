"""What ``vemesh check`` runs in full precision, and says so: FSDP2's ``MixedPrecisionPolicy``
(:func:`in_full_precision`) and the step's ``torch.autocast`` (:func:`autocast_off`). Below fp32 the two runs differ by
the dtype's rounding, more than the check's tolerance, whatever the plan; the check is of the parallelization, as it
runs compiled modules eagerly."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from vemesh.parallel.tp_split import unwrap

__all__ = ["autocast_off", "in_full_precision"]


@contextlib.contextmanager
def autocast_off(seen: set[str]) -> Iterator[None]:
    """``torch.autocast`` (and ``torch.amp.autocast``, the ``torch.cpu.amp`` one, a decorator's) to a 16-bit dtype
    entered disabled while the block runs, the dtype added to ``seen``: a step under autocast to bf16 differs from one
    process by bf16's rounding (4e-3 on a TP-split MLP), more than the check's tolerance, whatever the plan. As for
    FSDP2's mixed precision (:func:`in_full_precision`), the check is of the parallelization. An autocast entered
    with ``enabled=False`` (HF's rotary embeddings, kept in fp32) is left as it is."""
    from torch.amp.autocast_mode import autocast

    enter = autocast.__enter__

    def entered(self: Any) -> Any:
        if self._enabled and self.fast_dtype in (torch.bfloat16, torch.float16):
            seen.add(str(self.fast_dtype).removeprefix("torch."))
            self._enabled = False
        return enter(self)

    autocast.__enter__ = entered
    try:
        yield
    finally:
        autocast.__enter__ = enter


def in_full_precision(model: Any) -> list[str]:
    """FSDP2's ``MixedPrecisionPolicy`` on ``model`` (on any module under it; under PP, any stage's) set to compute,
    reduce and return in the parameters' own dtype, as one process does; the dtypes below fp32 it had (torchtitan's
    bf16 ``param_dtype``), sorted. A forward in bf16 against one process's fp32 differs by bf16's rounding (2.7e-2 on
    a 6-layer Llama's query gradients), more than the check's tolerance, whatever the plan: the check is of the
    parallelization, as it runs compiled modules eagerly."""
    from torch.distributed.fsdp import FSDPModule

    modules = [m for part in (model if not isinstance(model, nn.Module) else [model]) for m in unwrap(part).modules()]
    low = set()
    for state in (m._get_fsdp_state() for m in modules if isinstance(m, FSDPModule)):
        policy = state._mp_policy
        low |= {d for d in (policy.param_dtype, policy.reduce_dtype, policy.output_dtype)
                if d is not None and d.is_floating_point and torch.finfo(d).bits < 32}
        state._mp_policy = full = replace(policy, param_dtype=None, reduce_dtype=None, output_dtype=None)
        for group in [state._fsdp_param_group] if state._fsdp_param_group is not None else []:
            group.mp_policy = full
            for param in group.fsdp_params:
                param.mp_policy = full
                param.init_dtype_attrs(full)
    return sorted(str(d).removeprefix("torch.") for d in low)
