"""veScale's import path, for scripts migrating from ``vescale.devicemesh_api``."""

from ..mesh import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh"]
