"""veScale's ``VeDeviceMesh`` method names, each one line over vemesh's own queries.

:class:`~vemesh.VeDeviceMesh` inherits them, so a script migrating from
``vescale.devicemesh_api`` keeps its calls. Each docstring says what rank 5 of the
8-rank mesh ``(PP, DP, TP) = (2, 2, 2)`` gets, and where veScale answered wrongly.

The method names carry no spelling, so they find the strategy's dim whatever its case: on a
``("dp", "tp")`` mesh ``get_data_parallel_rank()`` is ``lookup_rank("dp")``
(:meth:`~vemesh.layout.MeshLayout.standard_name`). A mesh that spells DP only as parts
(``dp_replicate``, ``dp_shard``) raises ``KeyError`` here, as ``lookup_rank("DP")`` does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["VeScaleAliases"]


class VeScaleAliases:
    """The veScale names; every one is a query of :class:`~vemesh.VeDeviceMesh` by dim name."""

    def get_tensor_parallel_rank(self) -> int:
        """This rank's TP index (0 when the mesh has no TP): 1 on rank 5, 0 on rank 4."""
        return self.lookup_rank(self.layout.standard_name("TP"))

    def get_data_parallel_rank(self) -> int:
        """This rank's DP index (0 when the mesh has no DP): 1 on rank 6, 0 on rank 5.

        After ``split("DP", ...)`` it is still the DP index: ``DP`` answers as the flattened parts.
        """
        return self.lookup_rank(self.layout.standard_name("DP"))

    def get_pipeline_parallel_rank(self) -> int:
        """This rank's pipeline stage (0 when the mesh has no PP): 1 on rank 5, 0 on rank 2."""
        return self.lookup_rank(self.layout.standard_name("PP"))

    def get_tensor_parallel_mesh(self) -> DeviceMesh:
        """``mesh["TP"]``: ``[4, 5]`` on rank 5 (veScale returned the wrong dim here)."""
        return self[self.layout.standard_name("TP")]

    def get_data_parallel_mesh(self) -> DeviceMesh:
        """``mesh["DP"]``: ``[5, 7]`` on rank 5."""
        return self[self.layout.standard_name("DP")]

    def get_pipeline_parallel_mesh(self) -> DeviceMesh:
        """``mesh["PP"]``: ``[1, 5]`` on rank 5 (veScale returned the TP submesh here)."""
        return self[self.layout.standard_name("PP")]

    def get_tensor_parallel_dim_groups(self) -> dist.ProcessGroup:
        """The group along TP: ranks ``[4, 5]`` on rank 5 (veScale returned the outermost group)."""
        return self.get_group(self.layout.standard_name("TP"))

    def get_data_parallel_dim_groups(self) -> dist.ProcessGroup:
        """The group along DP: ranks ``[5, 7]`` on rank 5."""
        return self.get_group(self.layout.standard_name("DP"))

    def get_global_tensor_parallel_meshes(self) -> list[DeviceMesh]:
        """Every TP submesh: ``[[0, 1], [2, 3], [4, 5], [6, 7]]`` on every rank."""
        return self.get_submeshes(self.layout.standard_name("TP"))

    def get_global_pipeline_parallel_meshes(self) -> list[DeviceMesh]:
        """One submesh of the non-PP mesh dims per pipeline stage, in stage order.

        On every rank: ``[DeviceMesh([[0, 1], [2, 3]]), DeviceMesh([[4, 5], [6, 7]])]``
        with dims ``("DP", "TP")``. Without a PP dim the whole mesh is the one stage.
        """
        names, pp = self.mesh_dim_names, self.layout.standard_name("PP")
        if pp not in names:
            self.layout.resolve(pp, absent_ok=True)  # KeyError where the mesh spells PP another way
            return [self.mesh]
        others = tuple(n for n in names if n != pp)
        if not others:
            raise ValueError("the mesh has only the PP dim, so each stage is one rank; use get_submeshes('PP')")
        return self.get_submeshes(others)

    def is_first_stage(self) -> bool:
        """True on pipeline stage 0 (ranks 0..3), and on every rank without PP."""
        return self.get_pipeline_parallel_rank() == 0

    def is_last_stage(self) -> bool:
        """True on the last pipeline stage (ranks 4..7), and on every rank without PP."""
        return self.get_pipeline_parallel_rank() == self.get_strategy_size(self.layout.standard_name("PP")) - 1
