"""The pure layout: rank arithmetic for any mesh and every name it has, importable without torch.distributed.

* :mod:`~vemesh.layout.mesh_layout`: :class:`MeshLayout`, every name (mesh dims, flattened, split) and its
  groups, coordinates and neighbours for any global rank;
* :mod:`~vemesh.layout.algebra`: ``flatten`` and ``split`` of a layout; :mod:`~vemesh.layout.axes`: the
  (size, stride) arithmetic under it;
* :mod:`~vemesh.layout.names`: dim names, and which names spell a standard strategy;
* :mod:`~vemesh.layout.spec`: ``init_device_mesh``'s arguments, validated;
* :mod:`~vemesh.layout.data_dims`: which dims hold different data;
* :mod:`~vemesh.layout.describe`: a layout as text, and its warnings.
"""

from vemesh.layout.mesh_layout import Dims, MeshLayout, NamedDim, as_index, check_dim_names, unknown_name_error
from vemesh.layout.names import fill_sizes

__all__ = ["Dims", "MeshLayout", "NamedDim", "as_index", "check_dim_names", "fill_sizes", "unknown_name_error"]
