"""Gradient norms and clipping over TP-sharded, DP-sharded and pipeline-split models, on torch's code.

torch's ``clip_grad_norm_`` handles DTensor gradients (a TP shard counts once, a ``Replicate``
bias once), but raises on a model that mixes DTensor and plain parameters, and knows nothing
of pipeline stages. :func:`total_norm` runs torch's ``get_total_norm`` on each group of
gradients that torch can take together (plain tensors; DTensors of one mesh), combines the
parts, and optionally sums over extra process groups, e.g. the pipeline group, whose ranks hold
different layers. :func:`clip_grad_norm_` then scales with torch's ``clip_grads_with_norm_``.

On a ``(PP, TP) = (2, 2)`` mesh, rank 0 (stage 0, TP rank 0) computes the norm of stage 0's
gradients over both TP shards, and the sum over ``groups=[pp_group]`` adds stage 1's: every
rank returns the norm of the whole model, equal to ``clip_grad_norm_`` on one process.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
from vemesh.mesh.views import check_view
from vemesh.parallel.ddp.groups import ranks_along

__all__ = ["total_norm", "clip_grad_norm_"]


def pipeline_groups(groups: Sequence[dist.ProcessGroup] | None, argument: str = "groups") -> list[dist.ProcessGroup]:
    """``groups`` as a list (one group or 1-D mesh alone is a list of it); None is ``[]``, but raises ``ValueError``
    on a live mesh with PP > 1.

    A pipeline stage holds part of the model: clipping it by its own norm clips every stage by a different,
    wrong norm, silently. ``groups=[VESCALE_DEVICE_MESH.get_group("PP")]`` sums the stages' parts.
    """
    if isinstance(groups, dist.ProcessGroup) or hasattr(groups, "get_group"):  # one group, not in a list
        groups = [groups]  # type: ignore[list-item]
    if groups is not None:
        out = []
        for g in groups:
            if hasattr(g, "get_group"):  # a 1-D DeviceMesh given for its group
                check_view(g, argument)
                g = g.get_group()
            if not isinstance(g, dist.ProcessGroup):
                raise TypeError(f"{argument} must hold process groups (or 1-D DeviceMeshes); got {type(g).__name__}")
            out.append(g)
        return out

    if mesh.is_initialized():
        pp = mesh.layout.standard_name("PP")
        if mesh.get_strategy_size(pp) > 1:
            raise ValueError(
                f"{argument} was not given, and VESCALE_DEVICE_MESH has {pp}={mesh.get_strategy_size(pp)}: each pipeline "
                f"stage would clip by the norm of its own part. Pass {argument}=[VESCALE_DEVICE_MESH.get_group({pp!r})] "
                f"to take the whole model's norm, or {argument}=[] if these parameters are the whole model"
            )
    return []


def _check_groups(grads: list[torch.Tensor], groups: Sequence[dist.ProcessGroup], argument: str) -> None:
    """A group to sum over must not hold two ranks of one DTensor's mesh: torch's norm already covers those."""

    if not groups:
        return
    ranks = [set(dist.get_process_group_ranks(g)) for g in groups]
    seen = set()
    for g in grads:
        if not isinstance(g, DTensor) or id(g.device_mesh) in seen:
            continue
        seen.add(id(g.device_mesh))
        mesh = g.device_mesh
        for i in range(mesh.ndim):
            along = set(ranks_along(mesh, i))
            for k, members in enumerate(ranks):
                if len(members & along) > 1:
                    name = mesh.mesh_dim_names[i] if mesh.mesh_dim_names else f"dim {i}"
                    raise ValueError(
                        f"{argument}[{k}] (ranks {sorted(members)}) holds ranks {sorted(members & along)} of a gradient's "
                        f"DTensor mesh dim {name!r} ({sorted(along)}); torch's norm of a DTensor already covers its "
                        f"mesh, so that part would count {len(members & along)} times. Pass only groups whose ranks hold "
                        "different parameters (the pipeline stages: VESCALE_DEVICE_MESH.get_group('PP'))"
                    )


def _by_mesh(tensors: Iterable[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Group tensors that torch can reduce together: plain ones, and DTensors per mesh."""
    groups: dict[object, list[torch.Tensor]] = {}
    for t in tensors:
        key = id(t.device_mesh) if isinstance(t, DTensor) else None
        groups.setdefault(key, []).append(t)
    return list(groups.values())


def _power(grads: Iterable[torch.Tensor], norm_type: float, foreach: bool | None) -> torch.Tensor:
    """The norm before its root: the sum of ``|g| ** norm_type`` (the max for ``inf``), fp32, 0 for no grads."""
    parts = []
    device = None
    for same in _by_mesh(grads):
        part = torch.nn.utils.get_total_norm(same, norm_type, error_if_nonfinite=False, foreach=foreach)
        if isinstance(part, DTensor):
            part = part.full_tensor()
        parts.append(part.float())
        device = part.device
    if not parts:
        return torch.zeros((), dtype=torch.float32, device=device)
    if math.isinf(norm_type):
        return torch.stack(parts).max()
    return torch.stack(parts).pow(norm_type).sum()


def _reduce(value: torch.Tensor, groups: Sequence[dist.ProcessGroup], norm_type: float) -> torch.Tensor:
    for group in groups:
        if dist.get_world_size(group) > 1:
            dist.all_reduce(value, op=dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM, group=group)
    return value


def total_norm(
    grads: Iterable[torch.Tensor],
    norm_type: float = 2.0,
    *,
    groups: Sequence[dist.ProcessGroup] | None = None,
    expert_grads: Iterable[torch.Tensor] = (),
    expert_groups: Sequence[dist.ProcessGroup] = (),
    expert_copies: int = 1,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """The norm of all ``grads`` (and ``expert_grads``) taken together, the same on every rank.

    Args:
        grads: gradient tensors; plain tensors and DTensors (on any meshes) may be mixed.
        norm_type: as in ``torch.nn.utils.get_total_norm`` (``inf`` for the max norm).
        groups: process groups whose ranks hold *different* gradients to add in (e.g. the
            pipeline group). Not the DP group: DP ranks hold the same averaged gradients; not a
            DTensor's TP group: torch's norm covers it (both raise ``ValueError``). None (the default)
            is none, but raises on a live mesh with PP > 1: pass the PP group, or ``[]``.
        expert_grads: gradients of mixture-of-experts experts, which differ across ``expert_groups``
            (each EP rank holds other experts); their part is summed over ``expert_groups`` (e.g.
            ``[mesh["EP"].get_group()]``) and then over ``groups``. Every rank of ``expert_groups``
            must call this, with or without expert gradients of its own.
        expert_copies: how many ranks of ``expert_groups`` hold each expert's gradient (all equal):
            their sum is divided by it. 1 for the EP group; the EDP size when ``expert_groups`` is
            the whole DP group.
        error_if_nonfinite: raise if the norm is nan or inf, as torch does.
        foreach: passed to torch.

    Returns:
        A 0-dim fp32 tensor.
    """
    norm_type = float(norm_type)
    grads = list(grads)
    experts = list(expert_grads)
    groups = pipeline_groups(groups)
    _check_groups(grads, groups, "groups")
    _check_groups(experts, pipeline_groups(expert_groups, "expert_groups"), "expert_groups")
    total = _power(grads, norm_type, foreach)
    if experts or expert_groups:
        part = _reduce(_power(experts, norm_type, foreach).to(total.device), expert_groups, norm_type)
        if not math.isinf(norm_type):
            part = part / expert_copies
        total = torch.maximum(total, part) if math.isinf(norm_type) else total + part
    total = _reduce(total, groups, norm_type)
    if not math.isinf(norm_type):
        total = total.pow(1.0 / norm_type)
    if error_if_nonfinite and not torch.isfinite(total):
        raise RuntimeError(
            f"the total norm of order {norm_type} of the gradients is non-finite ({total.item()}), so it cannot be "
            "clipped; pass error_if_nonfinite=False to skip this check"
        )
    return total


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor,
    max_norm: float,
    norm_type: float = 2.0,
    *,
    groups: Sequence[dist.ProcessGroup] | None = None,
    expert_parameters: Iterable[torch.Tensor] = (),
    expert_groups: Sequence[dist.ProcessGroup] = (),
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for models that mix DTensor and plain parameters, span pipeline
    stages, or hold different experts on different ranks.

    Args:
        parameters: the parameters whose ``.grad`` is clipped in place (those without one are skipped).
        max_norm: the largest total norm allowed.
        norm_type, error_if_nonfinite, foreach: as in torch.
        groups: see :func:`total_norm` (e.g. ``[VESCALE_DEVICE_MESH["PP"].get_group()]``).
        expert_parameters: those of ``parameters`` that are experts held by this EP rank only; their
            part of the norm is summed over ``expert_groups`` (e.g. ``[VESCALE_DEVICE_MESH["EP"].get_group()]``).
            torch's own ``clip_grad_norm_`` would take each rank's experts for all of them, and every
            rank would clip by a different, wrong norm.

    Returns:
        The total norm before clipping, a 0-dim tensor, the same on every rank.
    """
    params = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
    with_grad = [p for p in params if p.grad is not None]
    experts = {id(p) for p in expert_parameters}
    groups = pipeline_groups(groups)
    check_sum_groups(params, experts, groups)
    norm = total_norm([p.grad for p in with_grad if id(p) not in experts], norm_type, groups=groups,  # type: ignore[misc]
                      expert_grads=[p.grad for p in with_grad if id(p) in experts], expert_groups=expert_groups,  # type: ignore[misc]
                      error_if_nonfinite=error_if_nonfinite, foreach=foreach)
    for same in _by_mesh(with_grad):
        torch.nn.utils.clip_grads_with_norm_(same, max_norm, norm, foreach=foreach)
    return norm


def check_sum_groups(params: list[torch.Tensor], experts: set[int], groups: Sequence[dist.ProcessGroup]) -> None:
    """The parameters of a vemesh DDP: no group to sum over may hold two of its DP ranks (they hold the same
    averaged gradient), and every expert it averages apart must be given as one (each rank holds other experts)."""
    wrappers = {}
    for p in params:
        owner = getattr(p, "_vemesh_ddp", lambda: None)()
        if owner is not None:
            wrappers[id(owner)] = owner
            if id(p) in owner.expert_parameter_ids and id(p) not in experts and not isinstance(p, DTensor):
                raise ValueError(
                    f"parameter {owner.parameter_names[id(p)]!r} is an expert of this EP rank only (its DDP averages it over "
                    "expert_data_parallel), but is not in expert_parameters: every rank would clip by a different norm. "
                    "Pass expert_parameters=[...its experts...] and expert_groups=[VESCALE_DEVICE_MESH.get_group('EP')]"
                )
    for ddp in wrappers.values():
        dp = set(dist.get_process_group_ranks(ddp.data_parallel_group))
        for k, g in enumerate(groups):
            both = dp & set(dist.get_process_group_ranks(g))
            if len(both) > 1:
                raise ValueError(
                    f"groups[{k}] holds ranks {sorted(both)} of the data-parallel group {sorted(dp)}, which hold the same "
                    f"averaged gradients: the norm would count them {len(both)} times. Pass only groups whose ranks hold "
                    "different parameters (the pipeline stages: VESCALE_DEVICE_MESH.get_group('PP'))"
                )
