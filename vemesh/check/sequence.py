"""Sequence parallelism completed, as ``vemesh check`` tries it where a plan shards the sequence over TP and nothing
gathers it back before the Linears that take the whole (:mod:`vemesh.check.positions` says so): the sequence gathered
into the modules that hold them, as torch's ``PrepareModuleInput`` does, whichever way they are called.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard

__all__ = ["gathered_sequence"]


def gathered_sequence(mesh: Any, dim: int) -> Any:
    """A forward pre-hook (``with_kwargs=True``): a module's first tensor argument, given by position or by name (HF's
    attention takes ``hidden_states=``), gathered from each TP rank's part of the sequence (``Shard(dim)``, a plain
    tensor or a DTensor) to the whole sequence on every rank (a ``Replicate()`` DTensor)."""

    def whole(t: torch.Tensor) -> DTensor:
        part = t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, (Shard(dim),), run_check=False)
        return part.redistribute(mesh, (Replicate(),))

    def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        at = next((i for i, a in enumerate(args) if isinstance(a, torch.Tensor)), None)
        if at is not None:
            return (*args[:at], whole(args[at]), *args[at + 1:]), kwargs
        key = next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
        return None if key is None else (args, {**kwargs, key: whole(kwargs[key])})
    return hook
