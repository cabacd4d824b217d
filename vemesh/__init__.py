"""vemesh: one global DeviceMesh for composing DP, TP, PP and CP/EP in PyTorch.

>>> from vemesh import VESCALE_DEVICE_MESH
>>> VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))  # doctest: +SKIP
>>> tp_mesh = VESCALE_DEVICE_MESH["TP"]                                                # doctest: +SKIP
"""

from .layout import MeshLayout
from .mesh import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh", "MeshLayout"]
__version__ = "0.1.0"
