"""Where a TP plan split a user's model: the Linears torch's ``ColwiseParallel`` split by rows, the heads their
modules view them by, and a TP degree that splits a projection's heads unevenly.

Shared by ``vemesh check`` (its ranks record them, for its hints: :mod:`vemesh.check.heads`) and by the planner (a
step that raises on such a split says why: :mod:`vemesh.planning.user_model`). A model's modules are named as in the
model as built (:func:`plain_name`), over each part a run steps (:func:`parts`: the model, or under PP its stages).
"""

from __future__ import annotations

import math
from typing import Any

from torch import nn
from torch.distributed.tensor import DTensor, Shard

from vemesh.layout.names import divisors, listed

__all__ = ["column_split_linears", "head_dims", "one_tp_dim", "parts", "plain_name", "uneven_hint", "unwrap"]

_WRAPPER_PARTS = {"_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"}


def parts(model: nn.Module | list[nn.Module]) -> list[tuple[nn.Module, bool]]:
    """``(module, is a stage)`` for each part a run steps: the model (unwrapped), or under PP each stage's module
    (a list of them: a ``PipelineStage``'s ``submod``), whose own root is not a module of the model as built."""
    if isinstance(model, nn.Module):
        return [(unwrap(model), False)]
    return [(unwrap(m), True) for m in model]


def unwrap(model: nn.Module) -> nn.Module:
    """The module under torch's or vemesh's DDP (``.module``) and ``torch.compile`` (``._orig_mod``)."""
    while True:
        if isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        elif hasattr(model, "_orig_mod") and isinstance(model._orig_mod, nn.Module):
            model = model._orig_mod
        else:
            return model


def plain_name(name: str) -> str:
    """A module's name in the model as built: the parts that wrappers add (compile's ``_orig_mod``, activation
    checkpointing's and FSDP1's wrapped module) left out."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS)


def column_split_linears(model: nn.Module) -> list[tuple[str, int, int, int]]:
    """``(name, out_features, in_features, TP degree)`` of each Linear whose weight's rows are split over its mesh's
    ``TP`` dim (or the one dim of a mesh without names) in plain blocks, as torch's ``ColwiseParallel`` splits them:
    TP rank ``r`` holds the ``r``-th block of all the rows. A fused ``[q|k|v]`` split so gives TP rank 0 all of q and
    part of k (:func:`vemesh.check.recipes.candidates`)."""
    found = []
    for name, m in (nm for part, _ in parts(model) for nm in part.named_modules()):
        w = getattr(m, "weight", None)
        if not isinstance(m, nn.Linear) or not isinstance(w, DTensor):
            continue
        mesh = w.device_mesh
        names = mesh.mesh_dim_names or ()
        # a one-dim mesh of another name is a data-parallel wrapper's (FSDP2's rows over DP), not TP's
        at = names.index("TP") if "TP" in names else 0 if mesh.ndim == 1 and not any(names) else None
        p = w.placements[at] if at is not None else None
        if isinstance(p, Shard) and p.dim == 0 and mesh.size(at) > 1:
            found.append((plain_name(name), m.out_features, m.in_features, mesh.size(at)))
    return found


def head_dims(model: nn.Module, split: list[tuple[str, int, int, int]]) -> dict[str, int]:
    """The ``head_dim`` (an integer attribute) of the module holding each Linear of ``split``, by the module's name."""
    scopes = {n.rpartition(".")[0] for n, *_ in split}
    found = {}
    for name, module in (nm for part, _ in parts(model) for nm in part.named_modules()):
        dim = vars(module).get("head_dim")
        if plain_name(name) in scopes and type(dim) is int and dim > 0:
            found[plain_name(name)] = dim
    return found


def uneven_hint(first: str | None, split: list[tuple[str, int, int, int]], dims: dict[str, int]) -> str | None:
    """Where the forward of ``first`` raised (None: somewhere in the step, as a plan knows it): the hint for a
    projection in its scope whose heads (``out_features / head_dim``, ``dims``: :func:`head_dims`) its TP degree does
    not divide; None where there is none."""
    heads = {n: (out // dims[n.rpartition(".")[0]], out, tp) for n, out, _, tp in split
             if n.rpartition(".")[0] in dims and out % dims[n.rpartition(".")[0]] == 0}
    for name, (count, out, tp) in heads.items():
        scope = name.rpartition(".")[0]
        if count % tp == 0 or first is not None and not (first == scope or first.startswith(scope + ".")
                                                         or scope.startswith(first + ".")):
            continue
        fewest = math.gcd(*(c for c, _, _ in heads.values()))
        return (f"TP {tp} does not divide {name}'s {count} heads (head_dim {dims[scope]}): each rank would hold "
                f"{out // tp} of its {out} features, part of a head. Choose TP from {listed(divisors(fewest))}, which "
                "divide the heads of every projection TP splits")
    return None


def one_tp_dim(style: str, mesh: Any) -> None:
    """Raise, naming ``style`` (a TP style's repr), unless ``mesh`` has one dim: the TP mesh a style works over."""
    if mesh.ndim != 1:
        raise ValueError(f"{style} works over one mesh dim (TP); got a {mesh.ndim}-D mesh {mesh.mesh_dim_names}: give "
                         "parallelize_module mesh['TP']")
