"""What a plan answers, whichever way the figures were found: one class of ranks, and one mesh.

Plain records, no computation: :mod:`vemesh.planning.fit` (the GPT preset) and :mod:`vemesh.planning.user_model`
(the user's own functions, traced) both return them, and :mod:`vemesh.planning.fit_report` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vemesh.planning.estimate import RankMemory

__all__ = ["MeshFit", "RankClass"]


@dataclass(frozen=True)
class RankClass:
    """The prediction for the ranks of one class (one PP rank; every rank without PP)."""

    name: str
    static: RankMemory
    activations: int  #: in-flight activations and the largest temporaries of a step
    extra: int  #: buffers: FSDP2's unsharded units in use; a pipeline stage's receive buffers
    sent: dict[str, int]  #: bytes per step by mesh name

    @property
    def peak(self) -> int:
        return self.static.total + self.activations + self.extra


@dataclass(frozen=True)
class MeshFit:
    """One mesh's prediction and, for a search, whether it fits and what it costs."""

    degrees: dict[str, int]
    classes: list[RankClass]
    micro_batches: int
    micro_batch_size: int
    reason: str | None = None  #: why it does not fit (None: it fits, or no device memory was given)
    slow_bytes: int = 0  #: bytes per step over links between hosts, the worst rank's
    slow_dims: tuple[str, ...] = field(default=())
    traced: bool = True  #: False for a module factory: static memory only, no activations
    notes: tuple[str, ...] = ()  #: assumptions the figures rest on, printed with them
    dp_mode: str = ""  #: the data parallelism planned (for the user's functions: what they applied)

    @property
    def peak(self) -> int:
        return max(c.peak for c in self.classes)

    def shape(self) -> str:
        return " x ".join(f"{n}={d}" for n, d in self.degrees.items() if d > 1 or n == "DP")
