"""veScale's import path, for scripts migrating from ``vescale.devicemesh_api``.

``from vemesh.devicemesh_api import VESCALE_DEVICE_MESH`` gives the same object as
``from vemesh import VESCALE_DEVICE_MESH``; veScale's method names live in
:mod:`vemesh.devicemesh_api.aliases`.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..mesh import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh"]


def __getattr__(name: str) -> Any:
    # resolved on first use: vemesh.mesh imports this package's aliases, so it cannot be imported here first
    if name in __all__:
        from .. import mesh

        return getattr(mesh, name)
    raise AttributeError(f"module 'vemesh.devicemesh_api' has no attribute {name!r}")
