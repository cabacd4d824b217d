"""FSDP2 on the mesh, with the expert rule: torch's ``fully_shard``, over the dims the one rule gives it.

:func:`fully_shard` is torch's, called as torchtitan calls it, per block and then on the root: the module is
sharded over the mesh's FSDP dims (``fsdp`` of :func:`vemesh.layout.data_dims.data_dims`:
``dp_cp``, or ``(dp_replicate, dp_shard_cp)`` under HSDP), and every experts module inside it that
:class:`~vemesh.parallel.ExpertParallel` sharded is first sharded over EDP, with its gradients summed there
and divided by ``DP x CP``: each expert saw the tokens of all its EP peers, so this keeps the mean loss over
the global batch exact, as vemesh's DDP does for the same experts.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from vemesh.layout.data_dims import data_dims
from vemesh.mesh import VESCALE_DEVICE_MESH
from vemesh.parallel.experts.style import expert_modules

__all__ = ["fully_shard"]


def fully_shard(module: nn.Module, *, mesh: Any = None, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard(module, mesh=<the FSDP view>, **kwargs)``, experts first on EDP.

    Args:
        module: a block, or the root once its blocks are sharded.
        mesh: the mesh manager (default ``VESCALE_DEVICE_MESH``): one ``ParallelDims.build`` built, or one built
            by hand with the standard dim names (:mod:`vemesh.layout.data_dims`).
        kwargs: torch's (``mp_policy``, ``reshard_after_forward``, ...), for the experts too.

    On 4 ranks of ``ParallelDims(4, ep=2)``, rank 1's dense parameters shard over DP ``[0, 1, 2, 3]`` and its
    experts (EP rank 1's half) over EDP ``[1, 3]``.
    """
    mesh = VESCALE_DEVICE_MESH if mesh is None else mesh
    data = data_dims(mesh.layout)
    if not data.batch:
        raise ValueError(f"vemesh.parallel.fully_shard: the mesh {dict(zip(mesh.mesh_dim_names, mesh.shape))} has no "
                         "data-parallel ranks to shard over (DP x CP = 1); leave FSDP out at DP 1, or give the mesh a "
                         "DP or CP dim")
    for experts in expert_modules(module):
        if not isinstance(experts, FSDPModule):
            torch_fully_shard(experts, mesh=mesh["EDP"], **kwargs)
            experts.set_gradient_divide_factor(float(data.batch_size))
            if mesh.size("EDP") > 1:  # sum over EDP, then divide (gloo has no PREMUL_SUM; on one rank
                experts.set_force_sum_reduction_for_comms(True)  # torch 2.13 would divide twice)
    return torch_fully_shard(module, mesh=mesh[data.fsdp], **kwargs)
