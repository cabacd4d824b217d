"""The live mesh: :class:`VeDeviceMesh` over torch's ``DeviceMesh``, and the process-wide ``VESCALE_DEVICE_MESH``.

* :mod:`~vemesh.mesh.manager`: the queries, for this rank and any other;
* :mod:`~vemesh.mesh.views`: torch views, process groups and submeshes of any names;
* :mod:`~vemesh.mesh.startup`: the default process group, cross-rank agreement, torch's mesh.
"""

from vemesh.mesh.manager import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh"]
