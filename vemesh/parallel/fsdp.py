"""FSDP2 on the mesh, with the expert rule: torch's ``fully_shard``, over the dims the one rule gives it.

:func:`fully_shard` is torch's, called as torchtitan calls it, per block and then on the root: the module is
sharded over the mesh's FSDP dims (:attr:`ParallelDims.fsdp_dims <vemesh.layout.parallel_dims.ParallelDims.fsdp_dims>`:
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

from vemesh.parallel.experts.style import expert_modules

__all__ = ["fully_shard"]


def fully_shard(module: nn.Module, *, mesh: Any = None, **kwargs: Any) -> nn.Module:
    """``torch.distributed.fsdp.fully_shard(module, mesh=<the FSDP view>, **kwargs)``, experts first on EDP.

    Args:
        module: a block, or the root once its blocks are sharded.
        mesh: the mesh manager that ``ParallelDims.build`` built (default ``VESCALE_DEVICE_MESH``).
        kwargs: torch's (``mp_policy``, ``reshard_after_forward``, ...), for the experts too.

    On 4 ranks of ``ParallelDims(4, ep=2)``, rank 1's dense parameters shard over DP ``[0, 1, 2, 3]`` and its
    experts (EP rank 1's half) over EDP ``[1, 3]``.
    """
    if mesh is None:
        from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
    dims = mesh.parallel_dims
    if dims is not None and not dims.fsdp_dims:
        raise ValueError(f"vemesh.parallel.fully_shard: the mesh has no data-parallel ranks to shard over (DP x CP = 1 "
                         f"in {dims}); leave FSDP out at DP 1, or give the mesh a DP or CP dim")
    if dims is None:
        raise ValueError("vemesh.parallel.fully_shard shards over the dims a ParallelDims built on the mesh "
                         "(ParallelDims(...).build()); for a mesh built by hand, call torch's fully_shard with a view")
    for experts in expert_modules(module):
        if not isinstance(experts, FSDPModule):
            torch_fully_shard(experts, mesh=mesh["EDP"], **kwargs)
            experts.set_gradient_divide_factor(float(dims.dp * dims.cp))
            if dims.dp * dims.cp > dims.ep:  # EDP > 1: sum over it, then divide (gloo has no PREMUL_SUM; on one
                experts.set_force_sum_reduction_for_comms(True)  # rank torch 2.13 would divide twice)
    return torch_fully_shard(module, mesh=mesh[dims.fsdp_dims], **kwargs)
