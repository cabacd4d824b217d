"""Which parameter replaced which: torch's global parameter-registration hook, registered when the mesh is imported
(before any ``parallelize_module``, which needs the mesh), read by :mod:`vemesh.parallel.ties`.

When a module's parameter is replaced by another (as ``parallelize_module`` does), the new one inherits the old
one's lineage token; two different parameter objects in one model with the same token are the ends of a broken tie.
"""

from __future__ import annotations

from typing import Any

from torch import nn

__all__ = ["LINEAGE", "track"]

#: the attribute a parameter's lineage token is kept in
LINEAGE = "_vemesh_lineage"
_HANDLE: list[Any] = []


class _Lineage:
    """One token per parameter that was ever replaced; shared by everything that replaced it."""

    __slots__ = ("__weakref__",)


def _on_register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
    old = module._parameters.get(name)
    if old is None or param is None or old is param:
        return
    token = old.__dict__.get(LINEAGE)
    if token is None:
        token = _Lineage()
        old.__dict__[LINEAGE] = token
    if param.__dict__.get(LINEAGE) is None:
        param.__dict__[LINEAGE] = token


def track() -> None:
    """Register the hook once."""
    if not _HANDLE:
        _HANDLE.append(nn.modules.module.register_module_parameter_registration_hook(_on_register))
