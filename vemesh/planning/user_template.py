"""The factory's model, built once on the meta device: its identical blocks found, and a copy for each trace.

A plan of the user's functions (:mod:`vemesh.planning.user_model`) calls the factory once per plan, on meta (as
torchtitan builds models), and each trace deep-copies that model with only the blocks it keeps: an 80-layer model
traced with 4 of them copies 4.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable

import torch
from torch import nn

from vemesh.planning.user_code import OnThisCPU, UserFunctions, call

__all__ = ["blocks_of", "copy_of_template", "forget_models", "keep_blocks", "repeated_blocks", "template_of"]


def _signature(module: nn.Module) -> tuple:
    return (tuple((n, type(m).__name__) for n, m in module.named_modules()),
            tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape)) for n, b in module.named_buffers()))


def repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """``(path, count)`` of the largest ``ModuleList``/``ModuleDict`` of more than 3 identical children, or None."""
    best: tuple[int, str, int] | None = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or len(container) <= 3:
            continue
        children = list(container.children())
        if len(children) != len(container) or len({_signature(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in container.parameters())
        if best is None or size > best[0]:
            best = (size, path, len(children))
    return (best[1], best[2]) if best else None


def keep_blocks(model: nn.Module, path: str, k: int) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    container = getattr(parent, attr)
    if isinstance(container, nn.ModuleDict):
        setattr(parent, attr, nn.ModuleDict(dict(list(container.items())[:k])))
    else:
        setattr(parent, attr, nn.ModuleList(list(container)[:k]))


@functools.lru_cache(maxsize=16)
def _template(factory: Callable[[], nn.Module], name: str) -> nn.Module:
    """The factory's model built once on the meta device: its blocks are found in it, and each trace copies it. A
    factory written for an accelerator (``Model().cuda()``) builds it there too (:class:`OnThisCPU`)."""
    with torch.device("meta"), OnThisCPU("meta"):
        model = call("--model", name, factory)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name} returned a {type(model).__name__}, not an nn.Module")
    return model


def template_of(fns: UserFunctions) -> nn.Module:
    """The factory's model built once on the meta device (a plan's Float8 share of the parameters reads it)."""
    return _template(fns.factory, fns.names[0])


def forget_models() -> None:
    """Drop the factories' meta models: each plan builds its own, since a factory may read what has changed since
    the last plan (a config file, a global); within one plan, every mesh and trace copies one."""
    _template.cache_clear()


def blocks_of(factory: Callable[[], nn.Module], name: str) -> tuple[str, int] | None:
    """``(path, count)`` of the factory's model's identical blocks (:func:`repeated_blocks`), or None."""
    return repeated_blocks(_template(factory, name))


def copy_of_template(fns: UserFunctions, blocks: tuple[str, int] | None) -> nn.Module | None:
    """A deep copy of the factory's meta model with the first ``k`` of its blocks (``blocks=(path, k)``): the same
    module a call of the factory would give, for the cost of the blocks kept, not of all of them. None (call the
    factory) when the model holds a tensor that is not on meta or does not copy."""
    try:
        template = _template(fns.factory, fns.names[0])
    except ValueError:  # the factory needs the fake world (it reads the mesh, say): it is called there, as before
        return None
    if not all(t.is_meta for t in (*template.parameters(), *template.buffers())):
        return None  # a tensor the factory placed itself: the factory's own call gives it in the fake mode
    parent, attr, whole = None, "", None
    if blocks is not None:  # the first k blocks in the template while it is copied, then all of them again
        parent_path, _, attr = blocks[0].rpartition(".")
        parent = template.get_submodule(parent_path)
        whole = getattr(parent, attr)
        keep_blocks(template, *blocks)
    try:
        return copy.deepcopy(template)
    except Exception:  # something in the model that does not copy (a lock, a generator): the factory builds it
        return None
    finally:
        if parent is not None:
            setattr(parent, attr, whole)
