"""FSDP2 on the mesh, with the expert rule: torch's ``fully_shard``, over the dims the one rule gives it.

:func:`fully_shard` is torch's, called as torchtitan calls it, per block and then on the root: the module is
sharded over the mesh's FSDP dims (``fsdp`` of :func:`vemesh.layout.data_dims.data_dims`:
``dp_cp``, or ``(dp_replicate, dp_shard_cp)`` under HSDP), and every experts module inside it that
:class:`~vemesh.parallel.ExpertParallel` sharded is first sharded over EDP, with its gradients summed there
and divided by ``DP x CP``: each expert saw the tokens of all its EP peers, so this keeps the mean loss over
the global batch exact, as vemesh's DDP does for the same experts.

On a mesh with TP, the first ``optimizer.step()`` over a sharded root's parameters first checks its replicas over TP
(the parameters sharded over the data dims only): the same values on every TP rank but not the same gradient raises
(:mod:`vemesh.parallel.tp_replicas`), as vemesh's DDP does after its first backward. A step on gradients that a
zero-bubble pipeline schedule added by hand, which FSDP2 never reduces, raises (:mod:`vemesh.parallel.weight_pass`).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from vemesh.layout.data_dims import data_dims
from vemesh.mesh import VESCALE_DEVICE_MESH
from vemesh.mesh.views import check_view
from vemesh.parallel.ddp.groups import data_ranks
from vemesh.parallel.experts.style import expert_modules
from vemesh.parallel.fused import fsdp_placement
from vemesh.parallel.ties import check_ties
from vemesh.parallel.tp_replicas import check_tp_gradients, inputs_fingerprint, tp_group_beside
from vemesh.parallel.weight_pass import watch_weight_passes

__all__ = ["fully_shard"]


def fully_shard(module: nn.Module, *, mesh: Any = None, check_tp_gradients: bool = True, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard(module, mesh=<the FSDP view>, **kwargs)``, experts first on EDP.

    Args:
        module: a block, or the root once its blocks are sharded.
        mesh: the mesh manager (default ``VESCALE_DEVICE_MESH``): one ``ParallelDims.build`` built, or one built
            by hand with the standard dim names (:mod:`vemesh.layout.data_dims`). A torch ``DeviceMesh``, as torch's
            ``fully_shard`` takes it, is sharded over as given, once checked to hold exactly this rank's data dims.
        check_tp_gradients: on a mesh with TP, check the replicas over TP at the first optimizer step (see the
            module docstring); ``False`` for parameters meant to differ by TP rank.
        kwargs: torch's (``mp_policy``, ``reshard_after_forward``, ...), for the experts too.

    On 4 ranks of ``ParallelDims(4, ep=2)``, rank 1's dense parameters shard over DP ``[0, 1, 2, 3]`` and its
    experts (EP rank 1's half) over EDP ``[1, 3]``.
    """
    mesh = VESCALE_DEVICE_MESH if mesh is None else mesh
    check_ties(module, "vemesh.parallel.fully_shard")
    if isinstance(mesh, DeviceMesh):  # torch's habit, fully_shard(module, mesh=dp_mesh): over that mesh, as torch's
        _check_data_view(mesh, module)
        fsdp_mesh = mesh
    else:
        data = data_dims(mesh.layout)
        if not data.batch:
            raise ValueError(f"vemesh.parallel.fully_shard: the mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} has "
                             "no data-parallel ranks to shard over (DP x CP = 1); leave FSDP out at DP 1, or give the "
                             "mesh a DP or CP dim")
        for experts in expert_modules(module):
            if not isinstance(experts, FSDPModule):
                torch_fully_shard(experts, mesh=mesh["EDP"], **kwargs)
                experts.set_gradient_divide_factor(float(data.batch_size))
                if mesh.size("EDP") > 1:  # sum over EDP, then divide (gloo has no PREMUL_SUM; on one rank
                    experts.set_force_sum_reduction_for_comms(True)  # torch 2.13 would divide twice)
        fsdp_mesh = mesh[data.fsdp]
    if any(fsdp_placement(p) is not None for p in module.parameters()):
        kwargs["shard_placement_fn"] = _with_fused(kwargs.get("shard_placement_fn"))
    sharded = torch_fully_shard(module, mesh=fsdp_mesh, **kwargs)
    if fsdp_mesh.size() > 1:  # a zero-bubble schedule's hand-added gradients, which FSDP2 misses, are refused
        watch_weight_passes(sharded)
    tp = tp_group_beside(set(_ranks(fsdp_mesh))) if check_tp_gradients else None
    if tp is not None:
        _check_at_first_step(sharded, tp, fsdp_mesh.get_all_groups())
    return sharded


def _ranks(mesh: DeviceMesh) -> list[int]:
    """The global ranks of ``mesh``, read into Python before they are flattened: under a plan's fake tensors,
    reshaping the rank tensor of an HSDP mesh (2-D) made a fake tensor, whose ``tolist`` has no values to give (the
    Llama 3 preset with ``--dp-replicate`` was refused so)."""
    ranks = mesh.mesh.tolist()
    while ranks and isinstance(ranks[0], list):
        ranks = [r for row in ranks for r in row]
    return ranks


def _check_data_view(view: DeviceMesh, module: nn.Module) -> None:
    """A torch ``DeviceMesh`` given: a view of the live mesh's before its last ``reset`` or ``init_device_mesh`` is
    refused, and, on a live mesh, one whose ranks are not exactly this rank's data dims (DP and CP): leaving some out,
    their replicas would drift apart; holding a TP peer, FSDP2 would shard and average over ranks that hold other
    shards. Experts need the mesh manager, which knows EDP."""
    check_view(view, "mesh")
    if any(not isinstance(m, FSDPModule) for m in expert_modules(module)):
        raise ValueError("vemesh.parallel.fully_shard: the module holds experts (ExpertParallel), which shard over EDP: "
                         "pass mesh=VESCALE_DEVICE_MESH (the default), not a view")
    needed, given = data_ranks(), sorted(_ranks(view))
    if needed is not None and sorted(needed) != given:
        names, fsdp = view.mesh_dim_names or (), data_dims(VESCALE_DEVICE_MESH.layout).fsdp
        raise ValueError(f"vemesh.parallel.fully_shard: mesh {dict(zip(names, view.shape))} holds ranks {given}, but "
                         f"this rank's data dims hold {sorted(needed)}: FSDP2 must shard over exactly those. Pass "
                         f"VESCALE_DEVICE_MESH[{fsdp[0] if len(fsdp) == 1 else fsdp!r}], or leave mesh out")


def _with_fused(user: Any) -> Any:
    """The user's ``shard_placement_fn``, and where it says nothing, a fused weight's input dim (Shard(1)): FSDP2's
    rows would mislabel its strided TP shard (:mod:`vemesh.parallel.fused`)."""
    def placement(param: nn.Parameter) -> Any:
        chosen = user(param) if user is not None else None
        return chosen if chosen is not None else fsdp_placement(param)

    return placement


#: the sharded roots whose replicas over TP the first optimizer step checks: (module, TP group, data groups, the
#: forward hook that sums its inputs until then)
_PENDING: list[tuple[weakref.ref, dist.ProcessGroup, list[dist.ProcessGroup], Any]] = []
_HOOK: list[Any] = []
_INPUTS: dict[int, torch.Tensor] = {}  #: id of a queued module -> its forwards' inputs (inputs_fingerprint)


def _check_at_first_step(module: nn.Module, tp: dist.ProcessGroup, data: list[dist.ProcessGroup]) -> None:
    """Queue ``module`` for the check; the modules it holds (its blocks, sharded first) go with it."""
    inside = {id(m) for m in module.modules()}
    for entry in [e for e in _PENDING if e[0]() is None or id(e[0]()) in inside]:
        _PENDING.remove(entry), entry[3].remove()
        _INPUTS.pop(id(entry[0]()), None)

    def seen(m: nn.Module, args: Any, kwargs: Any) -> None:  # which says whether the TP ranks got the same batch
        if torch.is_grad_enabled():
            _INPUTS[id(m)] = inputs_fingerprint((args, kwargs), _INPUTS.get(id(m)))

    _PENDING.append((weakref.ref(module), tp, data, module.register_forward_pre_hook(seen, with_kwargs=True)))
    if not _HOOK:
        _HOOK.append(register_optimizer_step_pre_hook(_first_step))


def _first_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
    for entry in list(_PENDING):
        module, tp, data = entry[0](), entry[1], entry[2]
        if module is None or not any(id(p) in stepped for p in module.parameters()):
            continue
        _PENDING.remove(entry), entry[3].remove()
        check_tp_gradients([(n, p.to_local(), None if p.grad is None else p.grad.to_local())
                            for n, p in module.named_parameters() if isinstance(p, DTensor)
                            and "TP" not in (p.device_mesh.mesh_dim_names or ())], tp, data,
                           "shard with vemesh.parallel.fully_shard(..., check_tp_gradients=False)",
                           inputs=_INPUTS.pop(id(module), None))
    if not _PENDING and _HOOK:
        _HOOK.pop().remove()
