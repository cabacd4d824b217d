"""Tied parameters under TP: parallelizing never unties silently.

A tied embedding (nanoGPT's and GPT-2's ``wte.weight is lm_head.weight``, HF's ``tie_word_embeddings``) is one
``nn.Parameter`` held by two modules. torch's ``parallelize_module`` replaces a module's parameter with a new
DTensor parameter, module by module: after it, the two ends are two parameters (one sharded, the other the old
plain tensor, or two DTensors), each gets half the gradient, the optimizer steps them apart, and the model trains
as another model without a word.

Two things keep that from happening:

* Lineage. On import, the mesh (:mod:`vemesh.mesh.lineage`) registers torch's global parameter-registration hook: when a module's
  parameter is replaced by another (as ``parallelize_module`` does), the new one inherits the old one's lineage
  token. Two different parameter objects in one model with the same lineage are the ends of a tie that was broken.
  :func:`check_ties` raises then, naming the pair; vemesh's DDP, ZeRO-1 (through DDP) and ``fully_shard`` call it.
* :func:`parallelize_module`, torch's with the same arguments, re-ties after it: when every end of a tie was
  sharded the same way (an embedding ``RowwiseParallel`` and its head ``ColwiseParallel``: both ``Shard(0)`` of the
  ``[vocab, dim]`` weight), the ends become one DTensor parameter again, sharded once, whose gradient sums both
  uses as in one process (and so does the same parameter held again by a module above a sharded end: BERT's
  ``cls.predictions.bias``, the head's Linear's bias). Ends sharded differently, or one end left whole, raise with
  the recipe.
"""

from __future__ import annotations

from collections.abc import Iterable
from fnmatch import fnmatch
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module as torch_parallelize_module

from vemesh.mesh.lineage import LINEAGE, track

__all__ = ["BrokenTieError", "check_ties", "parallelize_module", "tie_groups", "track_ties"]


class BrokenTieError(ValueError):
    """A tied parameter is several parameters after parallelizing."""


def track_ties() -> None:
    """Register the lineage hook once (the mesh does on import; ``vemesh.parallel`` too)."""
    track()


def tie_groups(module: nn.Module) -> list[list[str]]:
    """The names of each parameter held under more than one name (a tie), in ``named_parameters`` order."""
    names: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(n)
    return [ns for ns in names.values() if len(ns) > 1]


def _named(module: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    if isinstance(module, nn.Module):
        return list(module.named_parameters(remove_duplicate=False))
    return list(module)


def broken_ties(module: nn.Module | Iterable[tuple[str, torch.Tensor]]) -> list[list[list[str]]]:
    """Each broken tie: the names of each of its now-separate parameters (one list per parameter object)."""
    by_token: dict[int, dict[int, list[str]]] = {}
    for n, p in _named(module):
        token = p.__dict__.get(LINEAGE)
        if token is not None:
            by_token.setdefault(id(token), {}).setdefault(id(p), []).append(n)
    return [list(objs.values()) for objs in by_token.values() if len(objs) > 1]


def _describe(p: torch.Tensor) -> str:
    if isinstance(p, DTensor):
        return f"a DTensor {tuple(p.placements)} on {p.device_mesh.mesh_dim_names or 'a mesh'}"
    return "a plain tensor"


def check_ties(module: nn.Module | Iterable[tuple[str, torch.Tensor]], who: str) -> None:
    """Raise when a parameter tied in the model as built (one object) is now several after parallelizing.

    ``module``: the model, or its ``(name, parameter)`` pairs (``named_parameters()``)."""
    named = _named(module)
    broken = broken_ties(named)
    if not broken:
        return
    params = dict(named)
    ends = broken[0]
    listed = "; ".join(f"{' = '.join(names)} is {_describe(params[names[0]])}" for names in ends)
    raise BrokenTieError(
        f"{who}: the tied parameter {' and '.join(names[0] for names in ends)} was one parameter and is now "
        f"{len(ends)} ({listed}): parallelizing untied it, so each end would get part of the gradient and the "
        "optimizer would step them apart. Parallelize with vemesh.parallel.parallelize_module (torch's, which "
        "re-ties ends sharded the same way: an embedding RowwiseParallel(input_layouts=Replicate()) and its head "
        "ColwiseParallel, both Shard(0)), or re-tie by hand after parallelizing (lm_head.weight = wte.weight)"
        + (f"; {len(broken) - 1} more broken tie(s)" if len(broken) > 1 else ""))


def _owner(root: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (root.get_submodule(path) if path else root), leaf


def parallelize_module(module: nn.Module, device_mesh: Any = None, parallelize_plan: Any = None,
                       **kwargs: Any) -> nn.Module:
    """torch's ``parallelize_module(module, device_mesh, parallelize_plan)``, keeping the module's ties.

    Each tie of ``module`` whose ends the plan sharded the same way (the same mesh, placements and shape) is one
    DTensor parameter again afterwards; so is an end left whole that a module above a sharded end holds again
    (:func:`_alias`: BERT's ``cls.predictions.bias``). A tie whose ends were sharded differently, or with an end of
    its own use left whole (an embedding beside its sharded head), raises with the ends' placements: shard every end
    the same way, or none.
    """
    before = tie_groups(module)
    out = torch_parallelize_module(module, device_mesh, parallelize_plan, **kwargs)
    params = dict(module.named_parameters(remove_duplicate=False))
    for names in before:
        ends = [params[n] for n in names]
        if all(p is ends[0] for p in ends):
            continue
        sharded = [(n, p) for n, p in zip(names, ends) if isinstance(p, DTensor)]
        first = sharded[0][1] if sharded else ends[0]
        same = all(p.device_mesh == first.device_mesh and p.placements == first.placements and p.shape == first.shape
                   for _, p in sharded)
        aliases = [n for n, p in zip(names, ends) if not isinstance(p, DTensor)]
        if not (sharded and same and all(_alias(n, [s for s, _ in sharded]) for n in aliases)):
            listed = "; ".join(f"{n} is {_describe(p)}" for n, p in zip(names, ends))
            raise BrokenTieError(
                f"vemesh.parallel.parallelize_module: {' and '.join(names)} are one tied parameter, and the plan "
                f"sharded its ends differently ({listed}). "
                + (_same_kind(module, parallelize_plan, aliases, [s for s, _ in sharded]) or
                   "Shard every end the same way (an embedding RowwiseParallel(input_layouts=Replicate()) and its "
                   "head ColwiseParallel: both Shard(0) of [vocab, dim]), or leave every end whole"))
        for n in names:
            owner, leaf = _owner(module, n)
            if getattr(owner, leaf) is not first:
                setattr(owner, leaf, first)
    return out


def _alias(name: str, sharded: list[str]) -> bool:
    """Whether the end ``name``, left whole, is the tied parameter held again by a module above a sharded end's:
    BERT's ``cls.predictions.bias``, which HF ties to ``cls.predictions.decoder.bias``, the bias the head's Linear
    adds. It is not a use of its own the plan left whole, but the same parameter registered twice: it becomes the
    sharded parameter too (a forward that read it with plain tensors would raise, as DTensor does on mixed inputs)."""
    owner = name.rpartition(".")[0]
    return any(s.rpartition(".")[0].startswith(owner + ".") or (not owner and "." in s) for s in sharded)


def _style(plan: Any, path: str) -> Any:
    """The style ``plan`` gives the module at ``path`` (torch's matching: each name's atoms by ``fnmatch``), or None."""
    if not isinstance(plan, dict):
        return plan if not path else None
    atoms = path.split(".") if path else []
    for key, style in plan.items():
        parts = key.split(".") if key else []
        if len(parts) == len(atoms) and all(fnmatch(a, k) for a, k in zip(atoms, parts)):
            return style
    return None


def _same_kind(root: nn.Module, plan: Any, whole: list[str], sharded: list[str]) -> str:
    """The recipe where the ends left whole are held by modules of the kind a sharded end's is (HF T5's
    ``encoder.embed_tokens`` and ``decoder.embed_tokens``, Embeddings sharing ``shared``'s weight): give them the
    style the plan gave it, by name. Empty when no end left whole is of such a module, or the style is not found."""
    kinds = {}
    for name in sharded:
        path = name.rpartition(".")[0]
        style = _style(plan, path)
        if style is not None:
            kinds.setdefault(type(_owner(root, name)[0]), (path, style))
    found = [(n.rpartition(".")[0], kinds[type(_owner(root, n)[0])]) for n in whole
             if type(_owner(root, n)[0]) in kinds]
    if not found or len(found) < len(whole):
        return ""
    paths = " and ".join(p for p, _ in found)
    path, style = found[0][1]
    entries = ", ".join(f"{p!r}: {style!r}" for p, _ in found)
    kind = type(_owner(root, whole[0])[0]).__name__
    return (f"{paths} {'is' if len(found) == 1 else 'are'} {kind} like {path or 'the root'}, which the plan styled: "
            f"add {'it' if len(found) == 1 else 'them'} to the plan with its style ({entries}), so that every end "
            "is sharded the same way and re-tied")