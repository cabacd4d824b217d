"""The one rule for a mesh's data dims: which dims hold different parts of the batch, and over which
dims gradients (dense and expert), the loss and FSDP2 go.

Pure, like :mod:`vemesh.layout`: no process group. Every consumer asks :func:`data_dims`: vemesh DDP's
default group, the ZeRO-1 optimizer (through DDP), :func:`vemesh.parallel.fully_shard`, the loss average of
the example and of the models in :mod:`vemesh.models`, ``vemesh plan`` and ``vemesh show --derived``.
:class:`~vemesh.layout.parallel_dims.ParallelDims` asks it too, for the mesh it builds.

**Names are the evidence, and only whole names count.** Each mesh dim of size > 1 has a role by its name,
compared without case:

========================================  =====================================================
``DP``, ``dp_replicate``, ``dp_shard``     data: each rank holds other sequences of the batch
``CP``                                     data too: each rank holds other tokens of the same sequences
``PP``, ``TP``                             model: peers hold the same data and other parts of the model
========================================  =====================================================

A mesh dim of size > 1 with any other name (``EP`` as a mesh dim, ``fsdp``, ``replica``, ``data``) has no
known role: vemesh cannot tell whether averaging over it is right, so :func:`data_dims` raises
``ValueError`` naming it, and the fix is to pass the group explicitly (or to name the dim by the table).
Name fragments never count: ``my_dp`` is not DP. Dims of size 1 hold nothing and are ignored.

From the data atoms (the data dims of size > 1, in mesh order):

* **grad**: the name whose group is exactly the data atoms (dense gradients and the loss average over it):
  ``DP`` when its group is that (also under HSDP, where ``DP`` spans both parts), else the atom itself when there
  is one (``CP`` on ``(CP, TP)``), else a flattened name over exactly them (``dp_cp``); none such raises, saying
  what to flatten. None when the mesh has no data dim.
* **fsdp**: under HSDP (a ``dp_replicate`` of size > 1), ``(dp_replicate, <the name over the other data
  atoms>)``, i.e. ``dp_shard`` or ``dp_shard_cp``; else ``(grad,)``; ``()`` without data dims.
* **expert**: ``("EDP", "EP")`` when the layout has both names (the second factorization of the data ranks
  that :class:`~vemesh.layout.parallel_dims.ParallelDims` makes); expert gradients average over EDP.

On ``(PP, DP, CP, TP) = (2, 2, 2, 2)`` with ``dp_cp`` flattened, rank 5 (``PP=0, DP=1, CP=0, TP=1``)
averages over ``dp_cp`` = ``[1, 3, 5, 7]``; rank 10 over ``[8, 10, 12, 14]``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from vemesh.layout.mesh_layout import MeshLayout

__all__ = ["DATA_NAMES", "MODEL_NAMES", "DataDims", "batch_dims", "data_dims"]

#: Mesh-dim names (compared without case) whose ranks hold different parts of the batch.
DATA_NAMES: tuple[str, ...] = ("DP", "dp_replicate", "dp_shard", "CP")
#: Mesh-dim names (compared without case) whose ranks hold the same data and other parts of the model.
MODEL_NAMES: tuple[str, ...] = ("PP", "TP")

_DATA = {n.lower() for n in DATA_NAMES}
_MODEL = {n.lower() for n in MODEL_NAMES}


@dataclass(frozen=True)
class DataDims:
    """What :func:`data_dims` answers for one layout (see the module docstring for the rule).

    Attributes:
        batch: the mesh dims of size > 1 that hold different parts of the batch, in mesh order.
        grad: the name dense gradients and the loss average over (its group is exactly ``batch``), or None.
        fsdp: the names FSDP2 shards over: ``(dp_replicate, dp_shard[_cp])`` under HSDP, else ``(grad,)``.
        expert: ``("EDP", "EP")`` when the layout has an expert factorization, else ``()``.
        batch_size: the number of ranks in ``batch`` (``DP x CP``): expert gradients are divided by it.
    """

    batch: tuple[str, ...]
    grad: str | None
    fsdp: tuple[str, ...]
    expert: tuple[str, ...]
    batch_size: int


def batch_dims(layout: MeshLayout) -> tuple[str, ...]:
    """The data atoms of ``layout`` (``DataDims.batch``, without looking for a name over them); ``ValueError`` for
    a mesh dim of size > 1 whose name has no known role."""
    unknown = [f"{n!r} (size {s})" for n, s in zip(layout.dim_names, layout.shape)
               if s > 1 and n.lower() not in _DATA | _MODEL]
    if unknown:
        raise ValueError(
            f"the mesh {dict(zip(layout.dim_names, layout.shape))} has dim(s) {', '.join(unknown)} whose role vemesh "
            f"cannot tell from the name: data dims are named {list(DATA_NAMES)} and model dims {list(MODEL_NAMES)} "
            "(any case). Pass the data-parallel group explicitly (e.g. DistributedDataParallel(model, mesh['...'])), "
            "or name the dims by that table"
        )
    return tuple(n for n, s in zip(layout.dim_names, layout.shape) if s > 1 and n.lower() in _DATA)


def _covering(layout: MeshLayout, atoms: tuple[str, ...], what: str) -> str:
    """The name of ``layout`` whose group is exactly ``atoms`` (give or take dims of size 1): ``DP`` if it is one,
    else the atom itself when there is one, else the first flattened name over exactly them."""
    found = [*atoms[:len(atoms) == 1]]
    for name in layout.names:
        parts = layout.named(name).parts
        if set(parts) <= set(layout.dim_names) and {a for a in parts if layout.group_size(a) > 1} == set(atoms):
            found.append(name)
    if found:
        return "DP" if "DP" in found else found[0]
    flat = "dp_shard_cp" if what == "FSDP" else "dp_cp"
    raise ValueError(
        f"the mesh's {what} dims are {', '.join(atoms)} (each holds a different part of the batch), and no name of the "
        f"mesh covers exactly them: flatten them first, VESCALE_DEVICE_MESH.flatten({atoms!r}, {flat!r}) (ParallelDims"
        f"(...).build() does), or pass the data-parallel group you mean"
    )


def data_dims(layout: MeshLayout) -> DataDims:
    """The data dims of ``layout`` and the names gradients, the loss and FSDP2 use (the module's rule).

    ``(DP, TP)`` gives grad ``"DP"``; ``(DP, CP, TP)`` after ``flatten(("DP", "CP"), "dp_cp")`` gives
    ``"dp_cp"``; ``(PP, TP)`` gives None; ``(data, TP)`` raises ``ValueError`` (``data`` has no known role).

    Raises:
        ValueError: a mesh dim of size > 1 with no known role, or several data dims with no name over exactly them.
    """
    batch = batch_dims(layout)
    firsts = [n for n in layout.dim_names if n.lower() in _DATA]
    if not batch:
        grad = firsts[0] if firsts else None  # a data dim of size 1 (a world of one): a group of one
        return DataDims((), grad, (grad,) if grad else (), _experts(layout), 1)
    grad = _covering(layout, batch, "data")
    fsdp: tuple[str, ...] = (grad,)
    replicate = [a for a in batch if a.lower() == "dp_replicate"]
    if replicate:  # HSDP: replicas of size > 1, each sharded over the rest of the data dims (or a dp_shard of 1)
        rest = tuple(a for a in batch if a not in replicate)
        shard = [n for n in layout.dim_names if n.lower() == "dp_shard"]
        if rest:
            fsdp = (replicate[0], _covering(layout, rest, "FSDP"))
        elif shard:
            fsdp = (replicate[0], shard[0])
    return DataDims(batch, grad, fsdp, _experts(layout), math.prod(layout.group_size(a) for a in batch))


def _experts(layout: MeshLayout) -> tuple[str, ...]:
    return ("EDP", "EP") if layout.has("EDP") and layout.has("EP") else ()
