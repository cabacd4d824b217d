"""``ExpertParallel``: a torch ``ParallelStyle`` that spreads a grouped-experts module over the EP group.

The experts module follows torchtitan's contract: its parameters are stacked over the ``E`` experts on dim 0
(``w1 [E, H, D]``, ``w2 [E, D, H]``, ``w3 [E, H, D]``, biases ``[E, ...]`` too), and
``forward(x, num_tokens_per_expert)`` takes ``x [T, D]`` grouped by expert, in expert order, with the count per
expert ``[E]``, and returns ``[T, D]`` in the same order.

``parallelize_module(moe.experts, VESCALE_DEVICE_MESH["EP"], ExpertParallel())``:

* every parameter becomes a DTensor ``Shard(0)`` on the EP mesh: EP rank ``r`` keeps experts ``r * E/EP`` to
  ``(r + 1) * E/EP - 1`` (so checkpoints and ``clip_grad_norm_`` see the whole expert tensors);
* ``forward`` is wrapped with the token exchange (:mod:`~vemesh.parallel.experts.exchange`): the module's own
  forward runs on this rank's experts, with their local weights, on the tokens all EP ranks routed to them.

What the MoE block around it must do (as ``test/models/llama.py``'s ``MoE`` does): route each token to its top-k
experts, sort the (token, choice) slots by expert (a stable sort keeps tokens in order), count them per expert,
call the experts on the sorted slots, unsort, and combine the k outputs of each token with the router's weights.
Every EP rank must build the same full experts (same seed) before sharding, as for TP.

Gradients: the experts of one EP rank differ from its EP peers', so they are averaged over EDP (the data ranks
holding the same experts), and scaled by the data-parallel size: each expert saw the tokens of all its EP
peers, so this is the gradient of the mean loss over the global batch. vemesh's DDP (and ZeRO-1) finds these
parameters and the mesh's ``EDP`` by itself; :func:`vemesh.parallel.fully_shard` does the same for FSDP2.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from vemesh.mesh.views import check_view
from vemesh.parallel.experts.exchange import combine, dispatch

__all__ = ["EXPERT", "ExpertParallel", "is_expert", "expert_modules"]

#: The attribute ExpertParallel sets on each parameter it shards, and on the module it wraps.
EXPERT = "_vemesh_expert_parallel"


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is a parameter :class:`ExpertParallel` sharded over EP."""
    return bool(getattr(p, EXPERT, False))


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that :class:`ExpertParallel` wraps."""
    return [m for m in model.modules() if getattr(m, EXPERT, False)]


@contextlib.contextmanager
def _local_weights(module: nn.Module) -> Iterator[None]:
    """The module's DTensor parameters as their local shards for one forward (differentiable: ``to_local``)."""
    held = dict(module._parameters)
    try:
        for name, p in held.items():
            if isinstance(p, DTensor):
                module._parameters[name] = p.to_local()  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(held)


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module's experts over the 1-D EP mesh and exchange tokens with the EP peers."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise ValueError(f"ExpertParallel needs the 1-D EP mesh, VESCALE_DEVICE_MESH['EP']; got {device_mesh!r:.100}")
        check_view(device_mesh, "the EP mesh")
        if getattr(module, EXPERT, False):
            raise ValueError(f"{type(module).__name__} is already expert-parallel; apply ExpertParallel once")
        params = list(module.named_parameters(recurse=False))
        if not params or list(module.children()):
            raise ValueError(
                f"ExpertParallel takes a grouped-experts module: parameters stacked over experts on dim 0 and no "
                f"submodules; {type(module).__name__} has {len(params)} parameters and "
                f"{len(list(module.children()))} submodules"
            )
        experts = {p.size(0) for _, p in params}
        ep = device_mesh.size()
        if len(experts) != 1 or next(iter(experts)) % ep:
            shapes = {n: tuple(p.shape) for n, p in params}
            raise ValueError(f"ExpertParallel needs every parameter's dim 0 to be the expert count, divisible by EP {ep}; "
                             f"got {shapes}")
        for name, p in params:
            shard = nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Shard(0)]), requires_grad=p.requires_grad)
            setattr(shard, EXPERT, True)
            module.register_parameter(name, shard)
        setattr(module, EXPERT, True)
        module.forward = functools.partial(_forward, module, module.forward, device_mesh.get_group())  # type: ignore[method-assign]
        return module


def _forward(module: nn.Module, inner: Any, group: Any, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Tokens to their experts' ranks, this rank's experts on their local weights, the results back."""
    tokens, counts, plan = dispatch(x, num_tokens_per_expert, group)
    with _local_weights(module):
        out = inner(tokens, counts)
    return combine(out, plan, group)
