"""Global gradient norm over DP shards and TP shards, each element counted once.

The distributed optimizer holds, on each rank, only its DP shard of the *local* (TP-sharded)
gradients. The norm of the full, unsharded gradient is the square root of

    sum over DP ranks of [ plain pieces  +  sum over TP ranks of (DTensor pieces) ]

where a DTensor piece counts on a rank only if that rank has coordinate 0 on every mesh dim
the parameter is *replicated* over (a ``Replicate()`` bias is the same on all TP ranks, so only
TP rank 0 adds it), and the sum over TP ranks runs over the DTensor's mesh. Plain parameters
are whole on every TP rank, so they are added once, outside the TP sum.

On a ``(DP, TP) = (2, 2)`` mesh, rank 0 adds its DP-half of its TP-shard of ``fc1.weight``
(``Shard(0)``) and of the ``Replicate()`` bias of a row-parallel layer; rank 1 (TP rank 1) adds
only the ``fc1.weight`` piece. The result is the same on every rank.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

__all__ = ["NormTerm", "build_norm_terms", "global_grad_norm", "clip_grads_"]


@dataclass
class NormTerm:
    """Gradient pieces whose squares are summed over ``mesh`` (None: not summed beyond DP)."""

    mesh: DeviceMesh | None
    grads: list[torch.Tensor] = field(default_factory=list)


def _counts_here(param: DTensor) -> bool:
    """Whether this rank adds ``param``'s local gradient (coordinate 0 on every Replicate dim)."""
    mesh = param.device_mesh
    return all(mesh.get_local_rank(d) == 0 for d, pl in enumerate(param.placements) if pl.is_replicate())


def build_norm_terms(
    pieces: Sequence[tuple[torch.nn.Parameter, torch.Tensor]], all_params: Sequence[torch.nn.Parameter]
) -> list[NormTerm]:
    """Sort this rank's gradient pieces into norm terms.

    Args:
        pieces: ``(parameter, gradient view)`` for every piece this rank owns.
        all_params: every parameter of the models (not only the owned ones), so that every TP
            rank issues the same collectives even if its shard holds no piece of some mesh.

    Returns:
        One term for plain parameters, then one per distinct DTensor mesh in parameter order.
    """
    terms = [NormTerm(None)]
    by_mesh: dict[int, NormTerm] = {}
    for p in all_params:
        if isinstance(p, DTensor) and id(p.device_mesh) not in by_mesh:
            by_mesh[id(p.device_mesh)] = NormTerm(p.device_mesh)
            terms.append(by_mesh[id(p.device_mesh)])
    for p, grad in pieces:
        if not isinstance(p, DTensor):
            terms[0].grads.append(grad)
        elif _counts_here(p):
            by_mesh[id(p.device_mesh)].grads.append(grad)
    return terms


def _sum_of_squares(grads: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=device)
    norms = torch._foreach_norm(grads, 2.0)
    return torch.linalg.vector_norm(torch.stack(norms), 2.0).float().square()


def global_grad_norm(terms: Sequence[NormTerm], dp_group: dist.ProcessGroup, device: torch.device) -> torch.Tensor:
    """The 2-norm of the full gradient, identical on every rank.

    Args:
        terms: from :func:`build_norm_terms`.
        dp_group: the data-parallel group (each DP rank holds a distinct shard).
        device: where to compute (the buffers' device).

    Returns:
        A 0-dim fp32 tensor, as ``torch.nn.utils.clip_grad_norm_`` would return on the
        unsharded single-process model.
    """
    total = torch.zeros((), dtype=torch.float32, device=device)
    for term in terms:
        sq = _sum_of_squares(term.grads, device)
        if term.mesh is not None:
            for dim in range(term.mesh.ndim):
                if term.mesh.size(dim) > 1:
                    dist.all_reduce(sq, group=term.mesh.get_group(dim))
        total += sq
    if dist.get_world_size(dp_group) > 1:
        dist.all_reduce(total, group=dp_group)
    return total.sqrt()


def clip_grads_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> None:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``, as torch does."""
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if grads:
        torch._foreach_mul_(grads, coef)
