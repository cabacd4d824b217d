"""What a rank of ``vemesh check``'s parallel run watches while the user's plan runs: the width of the plain tensor a
Linear is handed (:func:`input_watch`), and whether a parameter is on the TP mesh (:func:`on_tp`). The records go to
:mod:`vemesh.check.whole_input`, which tries the style each case lacks."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

__all__ = ["input_watch", "on_tp"]

#: what each key of :func:`input_watch` records, and the width it expects (``True``: the whole width)
KEYS = {"whole_input": True,  # a RowwiseParallel Linear handed what one process computes, not this TP rank's part
        "part_input": False,  # a Linear TP left whole handed this rank's part
        "colwise_part": False}  # a ColwiseParallel Linear (input whole on every rank) handed this rank's part


def input_watch(name: str, key: str, width: int, tp: int, went: dict[str, list]) -> Any:
    """A forward pre-hook, run before torch's, for Linear ``name`` of ``width`` input features: where it is handed a
    plain tensor of the width ``key`` names (:data:`KEYS`: ``width``, or ``width // tp``), ``went[key]`` says so once,
    as ``[name, width, width // tp]``."""
    expected = width if KEYS[key] else width // tp

    def hook(module: nn.Module, args: tuple) -> None:
        given = args[0] if args else None
        if key in went or isinstance(given, DTensor) or not isinstance(given, torch.Tensor) or not given.dim() or \
                given.shape[-1] != expected:
            return
        went[key] = [name, width, width // tp]
    return hook


def on_tp(t: Any) -> bool:
    """Whether parameter ``t`` is a DTensor over a mesh with a TP dim (split or replicated by a TP style)."""
    return isinstance(t, DTensor) and "TP" in (t.device_mesh.mesh_dim_names or ())
