"""A checkpoint directory on disk: naming, the manifest, atomic publishing, and safe reading.

One training run keeps its checkpoints under a root directory::

    ckpt/
      step_000020/          a published checkpoint: torch.distributed.checkpoint files
        .metadata             (DCP's index of every tensor chunk, a pickle)
        __0_0.distcp ...      (tensor data, one file per writing rank)
        vemesh.json           (the manifest: step, extra, optimizer hyperparameters, file sizes and
                               checksums, and a checksum of the manifest itself)
      step_000030/
      .step_000040.tmp/     a save in progress (or one that crashed): never read

A save writes everything into ``.step_N.tmp``, adds the manifest last, and only then renames
the directory to ``step_N`` (an atomic rename), so a crash at any point leaves the published
checkpoints untouched. A checkpoint is *good* when its manifest parses, matches its own checksum
and its directory's step, every file it lists has the recorded size (and, checked when it is
loaded, the recorded checksum), nothing in it is a symbolic link, and its metadata unpickles
under the restricted unpickler of :mod:`vemesh.resilience.checkpoint.safe_read`.

Nothing here touches ``torch.distributed``; :mod:`vemesh.resilience.checkpoint.api` decides on rank 0 and
broadcasts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vemesh.resilience.checkpoint.errors import CheckpointNotFoundError, DamagedCheckpointError
from vemesh.resilience.checkpoint.integrity import file_checksum, manifest_checksum
from vemesh.resilience.checkpoint.safe_read import is_plain_name, read_metadata

if TYPE_CHECKING:
    from torch.distributed.checkpoint.metadata import Metadata

__all__ = ["CheckpointInfo", "checkpoint_path", "list_checkpoints", "read_manifest"]

MANIFEST = "vemesh.json"
FORMAT = "vemesh-checkpoint"
FORMAT_VERSION = 2  # 2: file and manifest checksums
_STEP_DIR = re.compile(r"^step_(\d+)$")
_TMP_DIR = re.compile(r"^\.step_(\d+)\.(tmp|old)$")


def checkpoint_path(root: str | os.PathLike, step: int) -> Path:
    """Where step ``step`` is published under ``root``: ``checkpoint_path("ckpt", 30)`` is ``ckpt/step_000030``."""
    return Path(root) / f"step_{step:06d}"


def is_step_dir(path: Path) -> bool:
    """Whether ``path`` is named like a published checkpoint (``step_000030``)."""
    return _STEP_DIR.match(path.name) is not None


def tmp_path(root: str | os.PathLike, step: int) -> Path:
    """Where a save of step ``step`` is written before it is published."""
    return Path(root) / f".step_{step:06d}.tmp"


@dataclass(frozen=True)
class CheckpointInfo:
    """One published checkpoint directory: its step, path, and what is wrong with it (None: good).

    ``checked`` says what "good" was checked against: ``"checksums"`` (every byte of every file read and
    matched to the checksum recorded at save, as :func:`~vemesh.checkpoint.load` does) or ``"sizes"`` (the
    manifest, the file sizes and the metadata only: fast, but blind to a flipped bit).
    """

    step: int
    path: Path
    problem: str | None
    checked: str = "checksums"

    @property
    def ok(self) -> bool:
        return self.problem is None


#: What :func:`list_checkpoints` can verify, cheapest last.
VERIFY = ("checksums", "sizes")


def list_checkpoints(root: str | os.PathLike, *, verify: str = "checksums") -> list[CheckpointInfo]:
    """Every ``step_N`` directory under ``root``, newest first, each checked (see :func:`check`).

    Args:
        root: the directory of checkpoints. A missing ``root`` gives an empty list; in-progress
            ``.step_N.tmp`` directories are not listed.
        verify: ``"checksums"`` (the default) reads every file and compares it with the checksum recorded at
            save, so ``ok`` means what :func:`~vemesh.checkpoint.load` will find; ``"sizes"`` checks only the
            manifest, the file sizes and the metadata (fast for large checkpoints, blind to a flipped bit).
            :attr:`CheckpointInfo.checked` records which.
    """
    if verify not in VERIFY:
        raise ValueError(f"verify must be one of {list(VERIFY)}; got {verify!r}")
    return list(_iter_checkpoints(root, check_all=True, checksums=verify == "checksums"))


def _iter_checkpoints(root: str | os.PathLike, check_all: bool, checksums: bool = False) -> Iterator[CheckpointInfo]:
    root = Path(root)
    if not root.is_dir():
        return
    found = sorted(
        ((int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and p.is_dir()),
        reverse=True,
    )
    checked = "checksums" if checksums else "sizes"
    for step, path in found:
        if path.is_symlink():  # e.g. an older checkpoint linked in under a newer name
            yield CheckpointInfo(step, path, f"checkpoint '{path}' is a symbolic link to '{os.readlink(path)}'; refused",
                                 checked)
            continue
        yield CheckpointInfo(step, path, check(path, checksums=checksums) if check_all else None, checked)


def check(path: str | os.PathLike, *, checksums: bool = False) -> str | None:
    """What is wrong with the checkpoint at ``path``, or None if it is complete and readable (and, with
    ``checksums``, every file matches the checksum recorded at save)."""
    try:
        manifest = read_manifest(path)
        check_files(path, manifest, read_metadata(path))
        if checksums:
            for name, recorded in sorted((manifest.get("checksums") or {}).items()):
                if file_checksum(Path(path) / name) != recorded:
                    raise DamagedCheckpointError(
                        f"checkpoint '{path}': file '{name}' does not match its checksum (damaged, or replaced by "
                        "another file)"
                    )
    except DamagedCheckpointError as e:
        return str(e)
    return None


# ------------------------------------------------------------------------------ manifest
def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed ``vemesh.json`` of a checkpoint.

    Raises:
        CheckpointNotFoundError: ``path`` does not exist.
        DamagedCheckpointError: the manifest is missing (an unfinished save) or not a vemesh manifest.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at '{path}': no such directory")
    file = path / MANIFEST
    try:
        manifest = json.loads(file.read_text())
    except FileNotFoundError:
        raise DamagedCheckpointError(
            f"checkpoint '{path}' has no {MANIFEST}: its save did not finish, or it is not a vemesh checkpoint"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DamagedCheckpointError(f"checkpoint '{path}': {MANIFEST} is unreadable ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise DamagedCheckpointError(f"checkpoint '{path}': {MANIFEST} is not a {FORMAT} manifest")
    if not isinstance(manifest.get("version"), int) or manifest["version"] > FORMAT_VERSION:
        raise DamagedCheckpointError(
            f"checkpoint '{path}' has format version {manifest.get('version')!r}; this vemesh reads up to "
            f"{FORMAT_VERSION} (upgrade vemesh)"
        )
    if not isinstance(manifest.get("step"), int) or not isinstance(manifest.get("files"), dict):
        raise DamagedCheckpointError(f"checkpoint '{path}': {MANIFEST} lacks 'step' or 'files'")
    if file.is_symlink():
        raise DamagedCheckpointError(f"checkpoint '{path}': {MANIFEST} is a symbolic link; refused")
    if manifest["version"] >= 2:
        if manifest.get("manifest_checksum") != manifest_checksum(manifest) or not isinstance(manifest.get("checksums"), dict):
            raise DamagedCheckpointError(
                f"checkpoint '{path}': {MANIFEST} does not match its checksum (edited or damaged); refused"
            )
    match = _STEP_DIR.match(path.name)
    if match and int(match.group(1)) != manifest["step"]:
        raise DamagedCheckpointError(
            f"checkpoint '{path}': its {MANIFEST} is for step {manifest['step']}, but the directory is step "
            f"{int(match.group(1))} (moved or copied from another checkpoint); refused"
        )
    return manifest


def write_manifest(path: Path, manifest: dict[str, Any], checksums: dict[str, str]) -> None:
    """Write ``vemesh.json`` into ``path`` and fsync it.

    It records every file's size and its checksum (``checksums``, computed by the ranks), and
    a checksum of the manifest's own content.
    """
    files = {p.name: p.stat().st_size for p in sorted(path.iterdir()) if p.is_file()}
    missing = sorted(set(files) - set(checksums))
    assert not missing, f"no checksum for {missing}"
    manifest = dict(manifest, files=files, checksums={n: checksums[n] for n in files})
    manifest["manifest_checksum"] = manifest_checksum(manifest)
    with open(path / MANIFEST, "w") as f:
        json.dump(manifest, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def check_files(path: str | os.PathLike, manifest: dict[str, Any], metadata: Metadata) -> None:
    """Every file the manifest lists has its recorded size, and every tensor chunk lies inside its file.

    Raises:
        DamagedCheckpointError: naming the first missing or truncated file.
    """
    path = Path(path)
    sizes: dict[str, int] = {}
    for name, expected in manifest["files"].items():
        file = path / name
        if not is_plain_name(name) or not file.is_file():
            raise DamagedCheckpointError(f"checkpoint '{path}': file '{name}' is missing")
        if file.is_symlink():
            raise DamagedCheckpointError(f"checkpoint '{path}': file '{name}' is a symbolic link to '{os.readlink(file)}'; refused")
        sizes[name] = file.stat().st_size
        if sizes[name] != expected:
            raise DamagedCheckpointError(
                f"checkpoint '{path}': file '{name}' has {sizes[name]} bytes, {expected} expected (truncated or overwritten)"
            )
    for index, info in metadata.storage_data.items():
        end = info.offset + info.length
        if sizes.get(info.relative_path, -1) < end:
            raise DamagedCheckpointError(
                f"checkpoint '{path}': tensor '{index.fqn}' lies at bytes [{info.offset}, {end}) of "
                f"'{info.relative_path}', which the manifest does not list with that size"
            )


# ------------------------------------------------------------------------ publishing
def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale(root: Path) -> None:
    """Delete ``.step_N.tmp`` / ``.step_N.old`` left behind by saves that crashed."""
    if root.is_dir():
        for p in root.iterdir():
            if _TMP_DIR.match(p.name):
                shutil.rmtree(p, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Atomically rename the finished ``tmp`` directory to ``final`` (replacing an older ``final``)."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():  # the same step saved again (after a restart): move the old one aside first
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def prune(root: Path, keep_last: int, keep: Path) -> list[Path]:
    """Keep the ``keep_last`` newest *good* checkpoints (and ``keep``); delete the older ones.

    Damaged checkpoints never count towards ``keep_last``, so the newest good one survives
    however many broken ones come after it; those newer than the oldest kept good one stay
    (for a person to look at). Returns the deleted directories.
    """
    deleted, good = [], 0
    for info in _iter_checkpoints(root, check_all=False):
        if good >= keep_last and info.path != keep and not info.path.is_symlink():
            shutil.rmtree(info.path, ignore_errors=True)
            deleted.append(info.path)
        elif info.path == keep or check(info.path) is None:
            good += 1
    return deleted
