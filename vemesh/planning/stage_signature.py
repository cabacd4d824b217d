"""What a replayed action's record is keyed by, of its pipeline stage (:mod:`vemesh.planning.pipeline_replay`).

Two stages of one signature run alike actions: the middle stages of a pipeline share their records across its PP
ranks, and a search's PP meshes across meshes. The signature is the stage's role (first, last), its parameters' and
buffers' classes, shapes, dtypes and placements, and its modules' kinds: each module's type (torch's
``CheckpointWrapper``, a compiled module) and the forward set on the instance, if any (the Llama 3 preset's
``selective-N`` checkpoints blocks 0, N, 2N, ... by replacing their ``forward``). Stages of one shape whose blocks
recompute differently hold other activations: keyed by their parameters alone, PP ranks 3 and 6 of ``llama3:8b`` over
PP 8 under ``selective-3`` replayed PP rank 1's records and planned up to 2% more than their whole trace.
"""

from __future__ import annotations

import functools
from typing import Any

__all__ = ["stage_signature", "tensor_kinds"]


def stage_signature(stage: Any) -> tuple:
    """The signature of torch's ``PipelineStage`` ``stage`` (see the module docstring)."""
    module = stage.submod
    return (stage.is_first, stage.is_last, tensor_kinds(module.parameters()), tensor_kinds(module.buffers()),
            tuple((type(m).__name__, _callable(m.__dict__.get("forward"))) for m in module.modules()))


def tensor_kinds(tensors: Any) -> tuple:
    """Each tensor's class, shape, dtype and placements (a DTensor's shape is the global one: with its placements,
    the local shard's)."""
    return tuple((type(t).__name__, tuple(t.shape), t.dtype, str(getattr(t, "placements", ""))) for t in tensors)


def _callable(f: Any) -> Any:
    """A forward set on an instance, by what it calls (a ``functools.partial``: its function and keywords)."""
    if f is None:
        return None
    if isinstance(f, functools.partial):
        return _callable(f.func), tuple(sorted((k, _callable(v) if callable(v) else repr(v))
                                               for k, v in f.keywords.items()))
    f = getattr(f, "__func__", f)
    return f"{getattr(f, '__module__', '')}.{getattr(f, '__qualname__', type(f).__qualname__)}"
