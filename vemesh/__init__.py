"""vemesh: one global DeviceMesh for composing DP, TP, PP and CP/EP in PyTorch.

>>> from vemesh import VESCALE_DEVICE_MESH
>>> VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))  # doctest: +SKIP
>>> tp_mesh = VESCALE_DEVICE_MESH["TP"]                                                # doctest: +SKIP
"""

import os
from typing import TYPE_CHECKING, Any

from vemesh.layout.mesh_layout import MeshLayout

if TYPE_CHECKING:
    from vemesh.mesh.manager import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh", "MeshLayout"]
__version__ = "0.1.0"

if os.environ.get("VEMESH_HANG_DIR"):  # torch's Flight Recorder must be on before the first collective
    from vemesh.hangs.record import prepare

    prepare()


def __getattr__(name: str) -> Any:
    # torch is imported on first use of the mesh, so `vemesh show` / `vemesh plan` start fast
    if name in ("VESCALE_DEVICE_MESH", "VeDeviceMesh"):
        from vemesh.mesh import manager as mesh  # torch on first use of the mesh: `vemesh show` and `vemesh plan` start fast

        return getattr(mesh, name)
    raise AttributeError(f"module 'vemesh' has no attribute {name!r}")
