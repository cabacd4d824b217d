"""torch's ``GradScaler`` for models that mix DTensor and plain parameters.

A model under TP and a data-parallel wrapper that keeps plain parameters (vemesh DDP, ZeRO-1, torch DDP) holds
DTensors (the TP-sharded Linears) beside plain tensors (the norms, the embeddings left whole). torch's
``GradScaler.unscale_`` puts every gradient of one device and dtype into one call of
``_amp_foreach_non_finite_check_and_unscale_``, which raises "got mixed torch.Tensor and DTensor" on such a model
(torch's own optimizers do the same: every parameter must be a DTensor). :class:`GradScaler` makes one call per kind
of gradient: the plain ones together, and the DTensors of each mesh and sharding together. DTensor's own handler of
that op then takes the largest ``found_inf`` over the mesh dims the gradients are sharded on, so that an infinity in
one TP rank's shard makes every TP peer skip the step; the plain ones are replicas, alike on every TP peer, and the
data-parallel wrappers average every gradient before it is unscaled, so every rank of the job skips together.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor, Replicate

__all__ = ["GradScaler"]


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler``, used the same way (``scale``, ``unscale_``, ``step``, ``update``, its state dict),
    that also unscales a model mixing DTensor and plain parameters (TP with DDP or ZeRO-1)."""

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        kinds: dict[tuple[Any, ...], list[torch.Tensor]] = {}  # in the optimizer's order: the same calls on each rank
        with torch.no_grad():
            for group in optimizer.param_groups:
                for param in group["params"]:
                    grad = param.grad
                    if grad is None:
                        continue
                    if not allow_fp16 and grad.dtype == torch.float16:
                        raise ValueError("Attempting to unscale FP16 gradients.")  # torch's words
                    if grad.is_sparse:  # as torch: a sparse fp16 gradient coalesced first, its values checked
                        if grad.dtype == torch.float16:
                            param.grad = grad = grad.coalesce()
                        grad = grad._values()
                    kind = (grad.device_mesh, tuple(not isinstance(p, Replicate) for p in grad.placements)) \
                        if isinstance(grad, DTensor) else None
                    kinds.setdefault((grad.device, grad.dtype, kind), []).append(grad)
            per_device: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}
            for (device, _, _), grads in kinds.items():
                if device not in per_device:
                    per_device[device] = (found_inf.to(device, copy=True), inv_scale.to(device, copy=True))
                torch._amp_foreach_non_finite_check_and_unscale_(grads, *per_device[device])
        return {device: inf for device, (inf, _) in per_device.items()}
