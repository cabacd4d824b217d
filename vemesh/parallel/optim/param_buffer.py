"""One DP rank's ZeRO-1 share of a gradient buffer: the parameter buffer, main params and gathers.

For each :class:`~vemesh.parallel.ddp.grad_buffer.GradBuffer` of a wrapped model, :class:`ParamShard`
lays the parameters' values out in a flat *parameter buffer* with the same offsets as the
gradients, padded to split evenly over DP (:mod:`vemesh.parallel.optim.shards`). Plain parameters become
views of it, so a gather lands straight in the model; DTensor parameters keep their own storage
and get a copy after each gather. This rank's slice of it holds the *main params* that the inner
torch optimizer steps: views of the parameter buffer for fp32 models, fp32 master copies for
bf16/fp16 ones. The matching gradients are slices of the (all-reduced) gradient buffer.

On DP = 2 with one buffer of 10 elements, rank 0 steps elements ``[0, 5)`` and rank 1 ``[5, 10)``;
after :meth:`ParamShard.start_gather` and :meth:`ParamShard.finish_gather` both hold all 10.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vemesh.parallel.ddp.grad_buffer import GradBuffer, local_tensor
from vemesh.parallel.optim.shards import contiguous_runs, shard_pieces, shard_range, shard_size

__all__ = ["ParamShard", "param_gather_for_backend"]

ParamGather = Literal["all_gather", "broadcast"]


def param_gather_for_backend(backend: str) -> ParamGather:
    """How every rank's updated slice of the parameter buffer reaches the others.

    gloo's all-gather is slow on this project's CPU machine: for 32 MiB of fp32 over 2 ranks,
    ``all_gather`` took 67-106 ms while one async ``broadcast`` per DP rank of its own slice
    took 17-24 ms. So gloo broadcasts; every other backend all-gathers into the buffer.

    Args:
        backend: the process group backend name.

    Returns:
        ``"broadcast"`` or ``"all_gather"``.
    """
    return "broadcast" if backend == "gloo" else "all_gather"


class ParamShard:
    """This DP rank's slice of one gradient buffer's parameters, and how to sync them.

    Args:
        grad_buffer: the model's gradient buffer (its layout fixes every parameter's offset).
        group_of: ``id(parameter) -> param group index``; parameters missing from it (or
            mapped to None) are not stepped.
    """

    def __init__(self, grad_buffer: GradBuffer, group_of: dict[int, int]) -> None:
        self.grad_buffer = grad_buffer
        self.params: list[nn.Parameter] = grad_buffer.params
        self.group = grad_buffer.group
        self.dp_size = dist.get_world_size(self.group)
        self.dp_rank = dist.get_rank(self.group)
        layout = grad_buffer.layout
        locals_ = [local_tensor(p) for p in self.params]
        device = locals_[0].device
        self.shard_size = shard_size(layout.numel, self.dp_size)
        #: Every parameter's values, flat, padded to ``dp_size * shard_size``.
        self.param_data = torch.zeros(self.shard_size * self.dp_size, dtype=locals_[0].dtype, device=device)
        # DTensor parameters keep their own storage: a DTensor whose local tensor starts at a
        # non-zero storage offset cannot be deep-copied (torch 2.13), which would break
        # copy.deepcopy(model.state_dict()). Their values are copied out after each gather.
        self._copied: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for p, t, (start, end) in zip(self.params, locals_, layout.param_ranges):
                view = self.param_data[start:end].view(t.shape)
                view.copy_(t)
                if isinstance(p, DTensor):
                    self._copied.append((t, view))
                else:
                    t.data = view
        lo, hi = shard_range(layout.numel, self.dp_rank, self.dp_size)
        pieces = shard_pieces(layout.param_ranges, lo, hi)
        #: ``(param group, start, end)``: this rank's contiguous runs, in buffer coordinates.
        self.runs = contiguous_runs(pieces, [group_of.get(id(self.params[pc.param])) for pc in pieces])
        self.copy_params = self.param_data.dtype != torch.float32  # keep fp32 masters
        self.copy_grads = grad_buffer.data.dtype != torch.float32
        total = sum(end - start for _, start, end in self.runs)
        master = torch.empty(total, dtype=torch.float32, device=device) if self.copy_params else None
        grad_copy = torch.empty(total, dtype=torch.float32, device=device) if self.copy_grads else None
        self.main: list[torch.Tensor] = []  # what the optimizer steps, one per run
        self.grads: list[torch.Tensor] = []  # their fp32 gradients
        self._model_views: list[torch.Tensor] = []  # param_data slices, one per run
        self._grad_views: list[torch.Tensor] = []  # gradient buffer slices, one per run
        offset = 0
        for _, start, end in self.runs:
            n = end - start
            self._model_views.append(self.param_data[start:end])
            self._grad_views.append(grad_buffer.data[start:end])
            self.main.append(master[offset : offset + n] if master is not None else self.param_data[start:end])
            self.grads.append(grad_copy[offset : offset + n] if grad_copy is not None else grad_buffer.data[start:end])
            offset += n
        # Parameters whose values the optimizer keeps a copy of (so an outside write would go stale).
        # An in-place write to a DTensor bumps the version of the DTensor, not of its local tensor.
        self._watched = [p for p in self.params if isinstance(p, DTensor)] if not self.copy_params else list(self.params)
        self._versions: list[int] = []
        self.reload()

    @torch.no_grad()
    def reload(self) -> None:
        """Re-read the model's parameters into the parameter buffer and the fp32 masters."""
        if self._copied:
            torch._foreach_copy_([v for _, v in self._copied], [t for t, _ in self._copied])
        if self.copy_params and self.main:
            torch._foreach_copy_(self.main, self._model_views)
        self._record_versions()

    def _record_versions(self) -> None:
        self._versions = [t._version for t in self._watched]

    def params_changed(self) -> bool:
        """Whether a parameter was written outside the optimizer (``load_state_dict``, manual init ...)."""
        return any(t._version != v for t, v in zip(self._watched, self._versions))

    @torch.no_grad()
    def grads_to_main(self) -> None:
        """Copy this rank's gradient slices into the fp32 gradients (only when the buffer is not fp32)."""
        if self.copy_grads and self.grads:
            torch._foreach_copy_(self.grads, self._grad_views)

    @torch.no_grad()
    def start_gather(self) -> list[dist.Work]:
        """Write the stepped main params into the parameter buffer and start gathering every rank's slice.

        Returns:
            The async work handles (empty when DP size is 1); :meth:`finish_gather` after waiting.
        """
        if self.copy_params and self.main:
            torch._foreach_copy_(self._model_views, self.main)
        if self.dp_size == 1:
            return []
        works: list[dist.Work | None] = []
        size = self.shard_size
        if param_gather_for_backend(dist.get_backend(self.group)) == "broadcast":
            for r in range(self.dp_size):
                chunk = self.param_data[r * size : (r + 1) * size]
                works.append(dist.broadcast(chunk, group=self.group, group_src=r, async_op=True))
        else:
            own = self.param_data[self.dp_rank * size : (self.dp_rank + 1) * size]
            works.append(dist.all_gather_single(self.param_data, own, group=self.group, async_op=True))
        return [w for w in works if w is not None]

    @torch.no_grad()
    def finish_gather(self) -> None:
        """After the gather's works completed: copy into DTensor parameters and note their versions."""
        if self._copied:
            torch._foreach_copy_([t for t, _ in self._copied], [v for _, v in self._copied])
        self._record_versions()
