"""Which dims of a mesh hold different data: the rule the data-parallel wrappers default to.

Pure, like :mod:`vemesh.layout`: no process group.

Gradients must be averaged over every rank that holds a different part of the batch: the
data-parallel ranks, and the context-parallel ranks too (each holds other tokens of the same
sequences). Tensor- and pipeline-parallel peers hold the same data and other parts of the model;
averaging over them would mix different shards. :func:`data_dim` names the one dim of a layout
that covers exactly the data dims, so ``DistributedDataParallel(model)`` on a live mesh never
averages over the whole world when the world holds TP, PP or CP peers.
"""

from __future__ import annotations

from vemesh.layout.mesh_layout import MeshLayout

__all__ = ["data_atoms", "data_dim"]

_DATA_WORDS = frozenset({"dp", "cp", "fsdp", "hsdp", "ddp"})


def data_atoms(layout: MeshLayout) -> tuple[str, ...]:
    """The mesh dims (in mesh order) that hold different data: those whose name, split at ``_`` and
    compared without case, has the word ``dp``, ``cp``, ``fsdp``, ``hsdp`` or ``ddp``.

    ``(PP, DP, CP, TP)`` gives ``("DP", "CP")``; torchtitan's ``(dp_replicate, dp_shard, cp, tp)`` gives
    the first three; ``(PP, TP)`` gives ``()``. Dims of size 1 are left out (``(DP=2, CP=1)`` gives ``("DP",)``),
    unless all are (then the first).
    """
    atoms = tuple(n for n in layout.dim_names if any(w in _DATA_WORDS for w in n.lower().split("_")))
    wide = tuple(n for n in atoms if layout.group_size(n) > 1)  # a dim of size 1 adds no rank to the group
    return wide or atoms[:1]


def data_dim(layout: MeshLayout) -> str | None:
    """The one name of ``layout`` whose group is exactly the data dims (:func:`data_atoms`), or None without any.

    ``(DP, TP)`` gives ``"DP"``; ``(DP, CP, TP)`` after ``flatten(("DP", "CP"), "dp_cp")`` gives ``"dp_cp"``;
    after ``split("DP", ("dp_replicate", "dp_shard"), ...)`` it is still ``"DP"``.

    Raises:
        ValueError: several data dims and no name over exactly them; the message says what to flatten.
    """
    atoms = data_atoms(layout)
    if not atoms:
        return None
    if len(atoms) == 1:
        return atoms[0]
    for name in layout.names:  # a name over exactly these dims, give or take dims of size 1
        parts = layout.named(name).parts
        if {a for a in parts if layout.group_size(a) > 1} == set(atoms) and set(parts) <= set(layout.dim_names):
            return name
    raise ValueError(
        f"the mesh's data dims are {', '.join(atoms)} (each holds a different part of the batch), and no dim of "
        f"the mesh covers exactly them: flatten them first, VESCALE_DEVICE_MESH.flatten({atoms!r}, 'dp_cp'), and "
        "pass VESCALE_DEVICE_MESH['dp_cp'], or pass the data-parallel group you mean"
    )
