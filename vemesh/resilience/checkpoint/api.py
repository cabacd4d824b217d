"""``save``, ``load`` and ``load_latest``: the three calls a training loop makes.

Every rank calls them with the same arguments. Decisions that read the file system (which
checkpoint is the latest good one, is this one complete, does it fit the model) are taken on
global rank 0 and broadcast, so every rank acts on the same answer and raises the same error;
failures inside torch's reader are gathered from every rank by torch itself. No rank is left
waiting in a collective that another rank skipped.
"""

from __future__ import annotations

import datetime
import functools
import json
import os
import shutil
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException

import vemesh.resilience.checkpoint.errors as errors
import vemesh.resilience.checkpoint.lock as lock
from vemesh.mesh.manager import VESCALE_DEVICE_MESH
from vemesh.parallel.fused import for_checkpoint
from vemesh.resilience.checkpoint.errors import (
    CheckpointError,
    CheckpointLockedError,
    CheckpointNotFoundError,
    DamagedCheckpointError,
)
from vemesh.resilience.checkpoint.files import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    check_files,
    checkpoint_path,
    is_step_dir,
    list_checkpoints,
    prune,
    publish,
    read_manifest,
    remove_stale,
    tmp_path,
    write_manifest,
)
from vemesh.resilience.checkpoint.guards import all_ranks_here, check_finite, check_layout, gather
from vemesh.resilience.checkpoint.integrity import checksum_share
from vemesh.resilience.checkpoint.safe_read import SafeFileSystemReader, SafeLoadPlanner, read_metadata
from vemesh.resilience.checkpoint.state import Entries, load_state, save_state

__all__ = ["save", "load", "load_latest", "acquire_lock", "release_lock"]

T = TypeVar("T")


def _declared_pause(fn: Callable[..., T]) -> Callable[..., T]:
    """``fn`` inside the hang watch's declared pause (:func:`vemesh.hangs.paused`): a save or a load waits on the
    slowest rank's files, which is no hang by the job's pace."""
    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> T:
        from vemesh.hangs import paused  # the watch imports torch.distributed's internals: on first use

        with paused():
            return fn(*args, **kwargs)
    return run


@_declared_pause
def save(
    checkpoint_dir: str | os.PathLike,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any | None = None,
    step: int,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = 3,
) -> Path:
    """Save the model (and optimizer) as ``checkpoint_dir/step_NNNNNN``, atomically.

    Args:
        checkpoint_dir: the run's checkpoint root (a directory shared by all hosts).
        model: the model, bare or wrapped in DDP; its parameters may be DTensors. With pipeline
            parallelism, the list of this rank's stage modules (which keep the full model's
            parameter names): every stage's entries go into one checkpoint.
        optimizer: a :class:`~vemesh.optim.DistributedOptimizer`, any ``torch.optim`` optimizer over
            the model's parameters, or None.
        step: the number of optimizer steps taken so far (``load`` returns it).
        extra: anything JSON can hold (a data-loader position, the config ...); ``load`` returns it.
        keep_last: keep this many newest checkpoints and delete older ones (None: keep all).

    Returns:
        The published directory, e.g. ``ckpt/step_000030``, the same on every rank.

    Every rank writes its shards (each replica once: DCP drops duplicates) into
    ``.step_000030.tmp``; once all ranks are done, rank 0 adds ``vemesh.json`` and renames the
    directory to ``step_000030``. A crash before the rename leaves the older checkpoints as they were.
    """
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise ValueError(f"keep_last must be a positive int or None, got {keep_last!r}")
    try:
        extra_json = json.loads(json.dumps(extra or {}))
    except (TypeError, ValueError) as e:
        raise ValueError(_not_json(extra, e)) from None
    root = Path(checkpoint_dir)
    all_ranks_here(f"checkpoint.save(step={step})")
    tensors, optim_meta = save_state(model, optimizer)
    check_layout(step, tensors)
    check_finite(step, tensors)
    tmp, final = tmp_path(root, step), checkpoint_path(root, step)

    def prepare() -> None:
        _check_root(root, "save into")
        other = lock.conflict(root)
        if other is not None:
            raise CheckpointLockedError(f"cannot save into '{root}': another job holds its lock ({other})")
        try:
            root.mkdir(parents=True, exist_ok=True)
            remove_stale(root)  # saves that crashed before publishing
            tmp.mkdir()
        except OSError as e:
            raise CheckpointError(f"cannot save into '{root}': {e.strerror or e}") from None

    _decide_on_rank0(prepare)
    try:
        try:
            dcp.save({k: for_checkpoint(v) for k, v in tensors.items()}, storage_writer=dcp.FileSystemWriter(tmp, sync_files=True, overwrite=False), no_dist=_no_dist())
        except CheckpointException as e:
            raise CheckpointError(f"saving step {step} into '{tmp}' failed: {_summary(e)}") from None
        # every rank checksums its share of the files, in parallel; rank 0 records them all
        names = _decide_on_rank0(lambda: sorted(p.name for p in tmp.iterdir() if p.is_file()))
        rank, world = _rank_and_world()
        try:
            share: dict[str, str] | str = checksum_share(tmp, names, rank, world)
        except OSError as e:  # told to every rank through the gather, so none is left waiting
            share = f"rank {rank} could not read back '{tmp}': {e.strerror or e}"
        shares = gather(share)
        failed = [x for x in shares if isinstance(x, str)]
        if failed:
            raise CheckpointError(f"saving step {step} failed: {failed[0]}")
        checksums = {k: v for x in shares for k, v in x.items()}
        manifest = {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "step": step,
            "extra": extra_json,
            "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "world_size": world,
            "mesh": _mesh_description(),
            "torch": torch.__version__,
            "optimizer": optim_meta,
        }

        def finish() -> None:
            try:
                write_manifest(tmp, manifest, checksums)
                publish(tmp, final)
            except OSError as e:
                raise CheckpointError(f"publishing step {step} as '{final}' failed: {e.strerror or e}") from None
            if keep_last is not None:
                prune(root, keep_last, keep=final)

        _decide_on_rank0(finish)
    except BaseException:
        if _rank_and_world()[0] == 0:  # no partial save is left to fill the disk
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def acquire_lock(checkpoint_dir: str | os.PathLike) -> dict[str, Any]:
    """Take ``checkpoint_dir`` for this job, at start (see :mod:`vemesh.resilience.checkpoint.lock`).

    Rank 0 creates the directory and ``.vemesh.lock`` in it (which also proves it writable);
    every rank returns the holder it wrote, or raises the same error.

    Raises:
        CheckpointLockedError: another live job holds it; the text names host, pid, start time
            and torchrun run id.
        CheckpointError: the directory is not writable, or is itself a checkpoint.
    """
    root = Path(checkpoint_dir)
    return _decide_on_rank0(lambda: _check_root(root, "lock") or lock.take(root))


def release_lock(checkpoint_dir: str | os.PathLike) -> None:
    """Give ``checkpoint_dir`` back at the end of the job (only the holder's lock is removed)."""
    _decide_on_rank0(lambda: lock.release(Path(checkpoint_dir)))


@_declared_pause
def load(
    checkpoint: str | os.PathLike,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any | None = None,
    strict: bool = True,
) -> tuple[int, dict[str, Any]]:
    """Load a checkpoint into ``model`` (and ``optimizer``), on any mesh.

    Args:
        checkpoint: one checkpoint (``ckpt/step_000030``), or a root: then the latest good one
            in it, as :func:`load_latest` picks it.
        model: the model, bare or wrapped in DDP, built on this run's mesh (or this rank's list of
            pipeline stages; strict checks then cover the stages of all ranks together).
        optimizer: built over ``model`` (after it is wrapped), or None to load the weights only.
        strict: every model entry and optimizer state must match by name, both ways; shapes
            must match either way.

    Returns:
        ``(step, extra)`` as given to :func:`save`.

    Raises:
        CheckpointNotFoundError: no checkpoint at ``checkpoint``.
        DamagedCheckpointError: missing, truncated or unreadable files; unsafe metadata.
        IncompatibleCheckpointError: the checkpoint does not fit the model or optimizer; the text
            lists every difference, e.g. "parameter 'h.0.attn.q.weight' has shape (64, 64) in
            the checkpoint but (128, 128) in the model".

    A checkpoint saved on ``(DP, TP) = (2, 2)`` loads on ``(4, 1)``, ``(1, 4)`` or one process:
    each rank reads the slices of each parameter (and of its optimizer state) that it holds.
    """
    path = Path(checkpoint)
    kind = _decide_on_rank0(lambda: _kind(path))
    if kind == "root":
        loaded = load_latest(path, model=model, optimizer=optimizer, strict=strict)
        assert loaded is not None  # _kind saw a step directory
        return loaded
    manifest, entries = _decide_on_rank0(lambda: _inspect(path))
    _verify_checksums(path, manifest)
    template, apply_optimizer_state = load_state(model, optimizer, entries, manifest.get("optimizer"), str(path), strict)
    try:
        dcp.load({k: for_checkpoint(v) for k, v in template.items()}, storage_reader=SafeFileSystemReader(path), planner=SafeLoadPlanner(), no_dist=_no_dist())
    except CheckpointException as e:
        raise DamagedCheckpointError(f"checkpoint '{path}' could not be read: {_summary(e)}") from None
    apply_optimizer_state()
    return manifest["step"], manifest.get("extra") or {}


def load_latest(
    checkpoint_dir: str | os.PathLike,
    *,
    model: nn.Module | Sequence[nn.Module],
    optimizer: Any | None = None,
    strict: bool = True,
) -> tuple[int, dict[str, Any]] | None:
    """Load the newest good checkpoint under ``checkpoint_dir``; None if it holds none (a fresh run).

    A damaged checkpoint (unfinished save, missing or truncated file, unreadable data) is skipped
    with a warning on rank 0 and the previous one is tried. An incompatible one (another model
    shape) raises :class:`IncompatibleCheckpointError` at once: older ones would not fit either.

    Raises:
        DamagedCheckpointError: checkpoints exist but every one is damaged (the text lists why).

    With ``step_000040`` truncated and ``step_000030`` good, every rank gets ``(30, extra)`` and
    rank 0 warns "skipping damaged checkpoint: checkpoint 'ckpt/step_000040': file
    '__1_0.distcp' has 1200 bytes, 3154 expected (truncated or overwritten) (trying the previous one)".
    """
    candidates = _decide_on_rank0(lambda: _check_root(Path(checkpoint_dir), "resume from") or
                                  [(i.path, i.problem) for i in list_checkpoints(checkpoint_dir, verify="sizes")])
    if not candidates:
        return None
    reasons = []
    for path, problem in candidates:
        if problem is None:
            try:
                return load(path, model=model, optimizer=optimizer, strict=strict)
            except (DamagedCheckpointError, CheckpointNotFoundError) as e:
                problem = str(e)
        reasons.append(problem)
        _warn0(f"skipping damaged checkpoint: {problem} (trying the previous one)")
    raise DamagedCheckpointError(f"no usable checkpoint under '{checkpoint_dir}':\n  " + "\n  ".join(reasons))


# --------------------------------------------------------------------------- helpers
def _not_json(extra: Any, error: Exception) -> str:
    """Why ``extra`` is refused, naming the first entry JSON cannot hold: an object with ``state_dict()`` (an LR
    scheduler, a sampler) goes in as its state dict."""
    def first(value: Any, at: str) -> tuple[str, Any] | None:
        if isinstance(value, dict):
            return next((f for k, v in value.items() if (f := first(v, f"{at}[{k!r}]"))), None)
        if isinstance(value, (list, tuple)):
            return next((f for i, v in enumerate(value) if (f := first(v, f"{at}[{i}]"))), None)
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            return at, value
        return None

    found = first(extra, "extra")
    if found is None:
        return f"extra must be JSON-serializable: {error}"
    at, value = found
    text = f"extra must be JSON-serializable; {at} is a {type(value).__name__}, which JSON cannot hold"
    if callable(getattr(value, "state_dict", None)):
        text += (": put its state_dict() there instead (an LR scheduler's is JSON), and after load call its "
                 "load_state_dict() with that entry of the extra that load returns")
    return text


def _kind(path: Path) -> str:
    if not path.is_dir():
        raise CheckpointNotFoundError(f"no checkpoint at '{path}': no such directory")
    if is_step_dir(path) or (path / MANIFEST).exists() or (path / ".metadata").exists():
        return "checkpoint"
    if list_checkpoints(path, verify="sizes"):
        return "root"
    raise CheckpointNotFoundError(f"no checkpoint at '{path}': neither a checkpoint nor a directory of step_N checkpoints")


def _check_root(root: Path, what: str) -> None:
    """Refuse a checkpoint given where the directory of checkpoints is expected."""
    if root.is_dir() and (is_step_dir(root) or (root / MANIFEST).exists()):
        raise CheckpointError(
            f"cannot {what} '{root}': it is a checkpoint itself, not a directory of checkpoints; "
            f"pass its parent '{root.parent}'"
        )


def _verify_checksums(path: Path, manifest: dict[str, Any]) -> None:
    """Every rank checks its share of the files against the manifest; all raise if any differs."""
    recorded: dict[str, str] = manifest.get("checksums") or {}  # none in version-1 checkpoints
    rank, world = _rank_and_world()
    mine = checksum_share(path, list(recorded), rank, world)
    bad = sorted(name for share in gather(sorted(n for n, c in mine.items() if c != recorded[n])) for name in share)
    if bad:
        raise DamagedCheckpointError(
            f"checkpoint '{path}': file '{bad[0]}' does not match its checksum (damaged, or replaced by another "
            f"file){f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}"
        )


def _rank_and_world() -> tuple[int, int]:
    return (dist.get_rank(), dist.get_world_size()) if _distributed() else (0, 1)


def _inspect(path: Path) -> tuple[dict[str, Any], Entries]:
    manifest = read_manifest(path)
    metadata = read_metadata(path)
    check_files(path, manifest, metadata)
    entries = {
        key: (tuple(md.size), str(md.properties.dtype).removeprefix("torch."))
        for key, md in metadata.state_dict_metadata.items()
    }
    return manifest, entries  # type: ignore[return-value]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def _no_dist() -> bool:
    return not (dist.is_available() and dist.is_initialized())


def _mesh_description() -> dict[str, Any] | None:

    if not VESCALE_DEVICE_MESH.is_initialized():
        return None
    return {"shape": list(VESCALE_DEVICE_MESH.shape), "dim_names": list(VESCALE_DEVICE_MESH.mesh_dim_names)}


def _decide_on_rank0(fn: Callable[[], T]) -> T:
    """Run ``fn`` on global rank 0 and give its result (or its CheckpointError) to every rank.

    Also a barrier: no rank returns before rank 0 has finished ``fn``.
    """
    if not _distributed():
        return fn()
    payload: list[Any] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload[0] = ("ok", fn())
        except CheckpointError as e:
            payload[0] = ("error", type(e).__name__, str(e))
        except Exception as e:  # noqa: BLE001 - tell the others before raising, so they do not hang
            failure = e
            payload[0] = ("error", "CheckpointError", f"rank 0 failed: {type(e).__name__}: {e}")
    dist.broadcast_object_list(payload, src=0)
    if failure is not None:
        raise failure
    if payload[0][0] == "ok":
        return payload[0][1]
    _, cls_name, message = payload[0]
    raise getattr(errors, cls_name)(message)


def _warn0(message: str) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=3)


def _summary(e: CheckpointException) -> str:
    """One line per failing rank: ``rank 1: RuntimeError: ...``."""
    lines = []
    for rank, (exc, _) in sorted(e.failures.items()):
        text = str(exc).strip().splitlines()
        lines.append(f"rank {rank}: {'' if isinstance(exc, CheckpointError) else type(exc).__name__ + ': '}{text[0] if text else ''}")
    return "; ".join(lines)
