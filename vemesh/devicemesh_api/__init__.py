"""veScale's import path, for scripts migrating from ``vescale.devicemesh_api``.

``from vemesh.devicemesh_api import VESCALE_DEVICE_MESH`` gives the same object as
``from vemesh import VESCALE_DEVICE_MESH``; veScale's method names are methods of it
(:mod:`vemesh.mesh.vescale_names`).
"""

from vemesh.mesh import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh"]
