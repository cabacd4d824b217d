"""A replicated module's output read by every TP rank's heads outside torch's styles: its gradient summed over TP.

torch's ``ColwiseParallel`` sums its input's gradient over TP in the backward (the input enters as a replicated
DTensor, whose gradient comes back partial and is all-reduced). A tensor that reaches this rank's heads any other way
gets only this rank's share. DeepSeek-V3's multi-head latent attention is the common case: ``kv_a_proj_with_mqa``
(replicated) returns ``[compressed_kv | k_pe]``; ``compressed_kv`` goes through ``kv_b_proj`` (a ColwiseParallel
Linear, so its gradient is summed), but ``k_pe``, the rotary key every head shares, is expanded to this rank's heads
directly. Each TP rank's backward then gives ``k_pe`` its own heads' share of the gradient, and every parameter before
it (the projection, the norms, the embedding) trains on a partial gradient: silently, with every output right.
Megatron inserts ``copy_to_tensor_model_parallel_region`` there (identity forward, all-reduce backward); torchtitan
runs the attention on DTensors (``NoParallel`` on ``wkv_a``).

:class:`SumGradOverTP` is that as a torch ``ParallelStyle``: on a module in ``parallelize_module``'s plan, the output
features ``start:stop`` pass through unchanged, and their gradient is summed over the plan's (TP) mesh. It uses
torch's own DTensor path: the part becomes a replicated DTensor whose local tensor is handed on with a partial
gradient (``to_local(grad_placements=[Partial()])``), so the backward redistributes it to replicated, an all-reduce.
The module's parameters stay plain tensors, replicated.

``vemesh check`` finds where it is needed (:mod:`vemesh.check.partial`: rows of an unsplit Linear's gradient that
differ from one process while the others match) and tries it.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate
from torch.distributed.tensor.parallel import ParallelStyle

from vemesh.parallel.tp_split import one_tp_dim

__all__ = ["SumGradOverTP"]


class SumGradOverTP(ParallelStyle):
    """The module's output features ``start:stop`` (of its last dim; ``stop`` None: to the end) unchanged in the
    forward, their gradient summed over the TP mesh in the backward. For a replicated module whose output (or part of
    it) reaches this rank's heads outside torch's TP styles, as DeepSeek-V3's shared rotary key::

        parallelize_module(layer, mesh["TP"], {
            "self_attn.q_b_proj": ColwiseParallel(), "self_attn.kv_b_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(),
            "self_attn.kv_a_proj_with_mqa": SumGradOverTP(start=config.kv_lora_rank),  # k_pe, read by every head
        })
    """

    def __init__(self, start: int = 0, stop: int | None = None) -> None:
        super().__init__()
        if type(start) is not int or start < 0 or (stop is not None and (type(stop) is not int or stop <= start)):
            raise ValueError(f"SumGradOverTP(start={start!r}, stop={stop!r}): start must be an int >= 0, and stop "
                             "None (to the last feature) or an int above start")
        self.start, self.stop = start, stop

    def __repr__(self) -> str:
        return f"SumGradOverTP(start={self.start}, stop={self.stop})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        one_tp_dim(repr(self), device_mesh)
        module.register_forward_hook(partial(self._summed, device_mesh))
        return module

    def _summed(self, mesh: DeviceMesh, module: nn.Module, args: Any, out: Any) -> torch.Tensor:
        if not isinstance(out, torch.Tensor) or isinstance(out, DTensor):
            raise TypeError(f"{self!r} on {type(module).__name__}: its output is {type(out).__name__}, not a plain "
                            "tensor (a module under another TP style returns a DTensor; put this style on the "
                            "replicated module whose output is read by every head)")
        width = out.shape[-1]
        stop = width if self.stop is None else self.stop
        if stop > width or self.start >= width:
            raise ValueError(f"{self!r} on {type(module).__name__}: its output has {width} features in its last "
                             "dim; start and stop must lie within them")
        local = DTensor.from_local(out[..., self.start:stop], mesh, [Replicate()], run_check=False)
        summed = local.to_local(grad_placements=[Partial()])
        if self.start == 0 and stop == width:  # the whole output: no copy of it
            return summed
        return torch.cat([out[..., :self.start], summed, out[..., stop:]], dim=-1)  # one copy of the output
