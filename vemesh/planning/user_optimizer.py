"""The optimizer a traced step runs, as the user's loop would: torch's AdamW (vemesh ZeRO-1's over its shards), stepped
as ``--optimizer-implementation`` says or as torch runs it on the job's device, and gradient accumulation as torch
users write it (no gradient sync but on the last micro-batch)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from vemesh.optim import DistributedOptimizer

__all__ = ["no_sync", "optimizer_for", "step_optimizer"]


def step_optimizer(optimizer: torch.optim.Optimizer, device: str, name: str, implementation: str | None = None) -> None:
    """``optimizer.step()``; its failure one line, naming the optimizer and how it runs (``implementation``, else as
    torch runs it on ``device``)."""
    try:
        optimizer.step()
    except Exception as e:
        how = (f" ({implementation}, --optimizer-implementation)" if implementation is not None
               else " (foreach, as torch runs it on cuda)" if device == "cuda" else "")
        hint = ("; its parameters mix DTensors and plain tensors, which torch's foreach and fused kernels refuse: make "
                "them all DTensors (FSDP2 over every module, or distribute the rest), or run the optimizer with "
                "foreach=False, and plan it so with --optimizer-implementation for-loop"
                if "mixed torch.Tensor and DTensor" in str(e) else "")
        raise ValueError(f"{type(optimizer).__name__}{how}.step() failed on what --parallelize {name} returned: "
                         f"{type(e).__name__}: {str(e).splitlines()[0]}{hint}") from e


#: AdamW's keyword for each ``--optimizer-implementation`` (torchtitan's ``optimizer.implementation`` names)
_IMPLEMENTATIONS = {"for-loop": dict(foreach=False), "foreach": dict(foreach=True), "fused": dict(fused=True)}


def optimizer_for(parts: list[nn.Module], mode: str, ddps: list[Any], device: str,
                  implementation: str | None = None) -> torch.optim.Optimizer:
    """torch's AdamW (ZeRO-1's over its shards) as ``implementation`` says, else as torch runs it on ``device``:
    foreach on cuda, the loop over tensors elsewhere (told, not left to torch: a fake tensor is a CPU tensor)."""
    how = _IMPLEMENTATIONS[implementation or ("foreach" if device == "cuda" else "for-loop")]
    if mode == "zero1":  # on a GPU its runs whole, on a CPU cut into 512K chunks
        return DistributedOptimizer(torch.optim.AdamW, models=ddps, main_param_chunk=0 if device == "cuda" else None,
                                    **how)
    return torch.optim.AdamW([p for part in parts for p in part.parameters() if p.requires_grad], **how)


def no_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """Gradient accumulation as torch users write it: no gradient sync but on the last micro-batch."""
    from torch.distributed._composable.replicate import DDP as ComposableDDP
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, (FSDPModule, ComposableDDP)):  # FSDP2's, and torch's composable replicate's (its DDP's)
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
