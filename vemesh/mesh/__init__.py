"""The live mesh: :class:`VeDeviceMesh` over torch's ``DeviceMesh``, and the process-wide ``VESCALE_DEVICE_MESH``.

* :mod:`~vemesh.mesh.manager`: the mesh: its layout, this rank's place, start-up, flatten and split, views;
* :mod:`~vemesh.mesh.queries`: the rank arithmetic, for this rank and any other, over the layout;
* :mod:`~vemesh.mesh.debug`: the display and the hang watch's hooks;
* :mod:`~vemesh.mesh.views`: torch's meshes of one epoch: views, process groups and submeshes of any names;
* :mod:`~vemesh.mesh.startup`: the default process group, cross-rank agreement, torch's mesh.
"""

from vemesh.mesh.manager import VESCALE_DEVICE_MESH, VeDeviceMesh

__all__ = ["VESCALE_DEVICE_MESH", "VeDeviceMesh"]
