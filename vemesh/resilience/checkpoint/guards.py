"""Cross-rank checks that run before a checkpoint is written, so a bad save fails at once, on every rank.

* :func:`all_ranks_here`: every rank called ``save``. A save called on rank 0 alone fails after the
  process group's timeout (at most 10 minutes by default), naming the ranks that never came,
  instead of hanging for torch's 30 minutes.
* :func:`check_layout`: the ranks agree on the step, and on the shape and dtype of every entry
  that several ranks hold (pipeline stages hold different ones).
* :func:`check_finite`: no tensor to be saved holds nan or inf, so no checkpoint ever holds them.

Each gathers every rank's answer and raises the same :class:`CheckpointError` on every rank.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vemesh.resilience.checkpoint.errors import CheckpointError

__all__ = ["all_ranks_here", "check_layout", "check_finite", "gather"]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def gather(value: Any) -> list[Any]:
    """Every rank's ``value``, by rank (just ``[value]`` without a process group)."""
    if not _distributed():
        return [value]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


def all_ranks_here(what: str) -> None:
    """A barrier that names the missing ranks when not every rank arrives within the group's timeout."""
    if not _distributed():
        return
    try:  # torch's own default here would be 30 minutes, whatever the group's timeout is
        dist.monitored_barrier(timeout=_group_timeout(), wait_all_ranks=True)
    except ValueError:  # "monitored_barrier is only implemented for GLOO backend": a plain barrier then
        dist.barrier()
        return
    except RuntimeError as e:
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(
            f"{what} on rank {dist.get_rank()}: not every rank arrived ({text}); every rank must call it, with the same arguments"
        ) from None


def _group_timeout() -> timedelta | None:
    """The default process group's own timeout (what ``init_device_mesh(timeout=...)`` set), if it can be read."""
    try:
        group = dist.distributed_c10d._get_default_group()
        return group._get_backend(torch.device("cpu")).options._timeout
    except (AttributeError, RuntimeError):
        return None


def _entry(t: torch.Tensor) -> tuple[tuple[int, ...], str]:
    return tuple(t.shape), str(t.dtype).removeprefix("torch.")


def check_layout(step: int, tensors: dict[str, torch.Tensor]) -> None:
    """Every rank saves the same step, and entries held by several ranks agree in shape and dtype.

    Ranks first exchange a digest of (step, entries): when all agree (every rank holds the same
    state, as without pipeline stages), that is the whole check. Only otherwise are the entry
    lists themselves gathered, to compare what overlaps and to name the disagreement.
    """
    entries = {k: _entry(t) for k, t in tensors.items()}
    digest = hashlib.sha256(repr((step, sorted(entries.items()))).encode()).hexdigest()
    if len(set(gather(digest))) == 1:
        return
    answers = gather((step, entries))
    steps = sorted({s for s, _ in answers})
    if len(steps) > 1:
        by_step = {s: [r for r, (x, _) in enumerate(answers) if x == s] for s in steps}
        raise CheckpointError(
            "ranks disagree on the step to save: " + "; ".join(f"ranks {rs} passed step={s}" for s, rs in by_step.items())
            + ". Every rank must call checkpoint.save with the same step"
        )
    seen: dict[str, tuple[tuple[tuple[int, ...], str], int]] = {}
    for rank, (_, entries) in enumerate(answers):
        for key, entry in entries.items():
            if key in seen and seen[key][0] != entry:
                (shape, dtype), other = seen[key]
                raise CheckpointError(
                    f"ranks disagree on the state to save: {key!r} is {shape} {dtype} on rank {other} but "
                    f"{entry[0]} {entry[1]} on rank {rank}. Every rank must build the same model and optimizer"
                )
            seen.setdefault(key, (entry, rank))


def check_finite(step: int, tensors: dict[str, torch.Tensor]) -> None:
    """No tensor to be saved holds nan or inf (checked on each rank's local data)."""
    bad = None
    for key, t in tensors.items():
        local = t._local_tensor if isinstance(t, DTensor) else t
        if local.is_floating_point() and not bool(torch.isfinite(local).all()):
            bad = key
            break
    found = [(r, k) for r, k in enumerate(gather(bad)) if k is not None]
    if found:
        rank, key = found[0]
        raise CheckpointError(
            f"refusing to save step {step}: {key!r} holds nan or inf (first found on rank {rank}); "
            "a checkpoint never holds non-finite values, so the last good one is kept"
        )
