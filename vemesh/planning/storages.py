"""Tables keyed by a tensor's storage, whose entries go when the storage dies.

A trace keys what it knows of a tensor (who wrote it, what it was gathered for) by its storage's address, and the
allocator gives that address to the next storage once the first is freed: the new storage must not inherit the old
one's entries. :class:`StorageTables` drops a storage's entries from every table it serves when the storage dies,
whatever allocated the next one (an op dispatched where the trace sees it, or a collective's buffer it does not).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

__all__ = ["StorageTables", "storage_key"]


def storage_key(t: torch.Tensor) -> int:
    """The key of ``t``'s storage (its address, shared by every view of it)."""
    return t.untyped_storage()._cdata


class StorageTables:
    """Keys for the dicts ``tables``: :meth:`watch` gives a tensor's storage key, and that key is removed from every
    table when the storage dies."""

    def __init__(self, *tables: dict[int, Any]) -> None:
        self.tables = tables
        self._watched: set[int] = set()

    def watch(self, t: torch.Tensor) -> int:
        """``t``'s storage key, forgotten from every table when the storage dies."""
        storage = t.untyped_storage()
        key = storage._cdata
        if key not in self._watched:
            self._watched.add(key)
            weakref.finalize(storage, self._forget, key)
        return key

    def _forget(self, key: int) -> None:
        self._watched.discard(key)
        for table in self.tables:
            table.pop(key, None)
