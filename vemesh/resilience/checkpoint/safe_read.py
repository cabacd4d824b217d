"""Reading a DCP checkpoint without running code from it.

DCP's own ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``,
and its ``DefaultLoadPlanner.load_bytes`` calls ``torch.load(..., weights_only=False)`` on any
non-tensor entry: a crafted checkpoint could run arbitrary code through either. Here
``.metadata`` goes through an unpickler that resolves only the classes DCP metadata needs, and
non-tensor entries are refused (vemesh stores its own values as JSON in ``vemesh.json``). Tensor
payloads are read by DCP with ``torch.load(..., weights_only=True)`` (torch 2.13 ``filesystem.py``).
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata

from vemesh.resilience.checkpoint.errors import DamagedCheckpointError

__all__ = ["read_metadata", "is_plain_name", "SafeFileSystemReader", "SafeLoadPlanner"]

# Everything a torch.distributed.checkpoint ``.metadata`` pickle refers to (checked with torch 2.13).
_ALLOWED_GLOBALS = {
    *{
        ("torch.distributed.checkpoint.metadata", name)
        for name in (
            "Metadata",
            "TensorStorageMetadata",
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "TensorProperties",
            "MetadataIndex",
            "StorageMeta",
            "_MEM_FORMAT_ENCODING",
        )
    },
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("collections", "OrderedDict"),
    ("builtins", "set"),
    ("builtins", "frozenset"),
    *{(module, cls) for module in ("pathlib", "pathlib._local") for cls in ("Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")},
}


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` that resolves only the classes DCP metadata needs (and torch dtypes)."""

    def __init__(self, file: Any, source: Path) -> None:
        super().__init__(file)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            return super().find_class(module, name)
        raise DamagedCheckpointError(
            f"checkpoint '{self.source.parent}': refusing to unpickle '{module}.{name}' from .metadata, which may "
            "only refer to torch.distributed.checkpoint metadata classes, torch.Size, torch dtypes and plain "
            "containers (the file is corrupt or malicious)"
        )


def is_plain_name(name: Any) -> bool:
    """A file name inside one directory: no separator, not empty, not ``.`` or ``..``."""
    return isinstance(name, str) and name not in ("", ".", "..") and "/" not in name and os.sep not in name


def read_metadata(path: str | os.PathLike) -> Metadata:
    """DCP's ``.metadata`` of a checkpoint, unpickled safely and checked for shape.

    Raises:
        DamagedCheckpointError: missing or unreadable metadata, a class outside the allowed set, a pickled
            (non-tensor) entry, or a data file named outside the checkpoint directory.
    """
    file = Path(path) / ".metadata"
    try:
        data = file.read_bytes()
    except OSError as e:
        raise DamagedCheckpointError(f"checkpoint '{path}': cannot read .metadata ({e.strerror or e})") from None
    try:
        metadata = _MetadataUnpickler(io.BytesIO(data), file).load()
    except DamagedCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise DamagedCheckpointError(f"checkpoint '{path}': .metadata is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise DamagedCheckpointError(f"checkpoint '{path}': .metadata does not hold DCP Metadata")
    for key, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            raise DamagedCheckpointError(
                f"checkpoint '{path}': entry {key!r} is a pickled Python object, not a tensor; vemesh "
                "checkpoints hold only tensors (and JSON in vemesh.json) and refuse to unpickle it"
            )
    for index, info in metadata.storage_data.items():
        if not isinstance(info, _StorageInfo) or not is_plain_name(info.relative_path):
            raise DamagedCheckpointError(
                f"checkpoint '{path}': tensor '{getattr(index, 'fqn', index)}' points outside the checkpoint directory"
            )
    if getattr(metadata, "storage_meta", None) is None:
        metadata.storage_meta = StorageMeta()
    return metadata



class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` with the metadata read by :func:`read_metadata`.

    Tensor payloads are already read with ``torch.load(..., weights_only=True)`` by the parent
    (torch 2.13 ``filesystem.py``, ``FileSystemReader.read_data``). ``read_metadata`` takes no
    ``rank`` argument, so DCP never falls back to per-rank ``__N.metadata`` files.
    """

    _reading: str | None = None

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        metadata = read_metadata(self.path)
        metadata.storage_meta.load_id = self.load_id  # type: ignore[union-attr]
        return metadata

    def _slice_file(self, file: Any, sinfo: _StorageInfo) -> Any:
        self._reading = sinfo.relative_path  # to name the file if reading it fails
        return super()._slice_file(file, sinfo)

    def read_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().read_data(plan, planner)
        except DamagedCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - torch.load on corrupt bytes raises anything
            what = f"file '{self._reading}'" if self._reading else "a data file"
            raise DamagedCheckpointError(f"{what} is corrupt ({type(e).__name__}: {e})") from None


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, minus its one ``torch.load(weights_only=False)``: pickled entries are refused."""

    def __init__(self) -> None:
        super().__init__(allow_partial_load=False)

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        raise DamagedCheckpointError(
            f"checkpoint entry '{read_item.dest_index.fqn}' is a pickled Python object; vemesh refuses to unpickle it"
        )
