"""What a plan answers, whichever way the figures were found: one class of ranks, and one mesh.

Plain records, no computation: :mod:`vemesh.planning.fit` (the GPT preset) and :mod:`vemesh.planning.user_model`
(the user's own functions, traced) both return them, and :mod:`vemesh.planning.fit_report` prints them.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from vemesh.parallel.plan_keys import describe
from vemesh.planning.estimate import RankMemory

#: how a search's reason for a mesh it leaves out begins (:func:`vemesh.planning.search_jobs.not_searched`)
NOT_PLANNED = "not planned in a search: "

__all__ = ["NOT_PLANNED", "Counted", "MeshFit", "RankClass", "more_counts", "more_ops"]


@dataclass(frozen=True)
class RankClass:
    """The prediction for the ranks of one class (one PP rank; every rank without PP)."""

    name: str
    static: RankMemory
    activations: int  #: in-flight activations and the largest temporaries of a step
    extra: int  #: buffers: FSDP2's unsharded units in use; a pipeline stage's receive buffers
    sent: dict[str, int]  #: bytes per step by mesh name
    flops: int = 0  #: FLOPs per step (traced: by torch's FlopCounterMode formulas), 0 when not counted
    memory_bytes: int = 0  #: bytes the step's memory-bound ops read and write (measure.MemoryBoundBytes)
    optimizer_bytes: int = 0  #: the part of ``memory_bytes`` the optimizer's step moves
    ops: int = 0  #: ops dispatched in a step
    dtensor_ops: int = 0  #: of them, ops on DTensors
    #: per step, by mesh name and collective op: ``(bytes, calls)`` (what a step-time prediction times)
    collectives: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)
    #: what compile and Float8 change, per step (:class:`vemesh.planning.fusion.Fusion`'s counts)
    counts: dict[str, int] = field(default_factory=dict)

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
    dp_mode: str = ""  #: the data parallelism planned (for the user's functions: what they applied; "none": no wrapper)
    pp_schedule: str = ""  #: with PP: the schedule whose action list the classes (PP ranks) ran
    order: tuple[str, ...] = ()  #: a search with hosts: the placed order of the mesh dims, outermost first
    times: tuple[Any, ...] = ()  #: a search with a device profile: each class's StepTime on the placed mesh
    activation_checkpointing: bool | None = None  #: a search that chose it (``--choose``): whether this mesh recomputes

    @property
    def peak(self) -> int:
        return max(c.peak for c in self.classes)

    @property
    def step_time(self) -> float | None:
        """The slowest class's predicted seconds per step (a search with a device profile), else None."""
        return max(t.total for t in self.times) if self.times else None

    @property
    def not_planned(self) -> bool:
        """Whether a search left this mesh out without planning it (a preset's PP mesh without ``--trace-pp``)."""
        return self.reason is not None and self.reason.startswith(NOT_PLANNED)

    def shape(self) -> str:
        """The degrees, in the placed order when there is one: ``"PP=2 x DP=4 x TP=8"``."""
        names = [*self.order, *(n for n in self.degrees if n not in self.order)]
        return " x ".join(f"{n}={self.degrees[n]}" for n in names if self.degrees[n] > 1 or n == "DP")


@dataclass(frozen=True)
class Counted:
    """What one trace counted on rank 0: the categories held at the step peak, the peak, bytes per step by name."""

    held: dict[str, int]  #: params, buffers (the model's own), grads, optimizer, activations at the peak
    peak: int
    sent: dict[str, int]
    dp_mode: str
    moe: bool
    flops: int = 0  #: FLOPs of the step (by torch's FlopCounterMode formulas)
    memory_bytes: int = 0  #: bytes the step's memory-bound ops move (measure.MemoryBoundBytes)
    optimizer_bytes: int = 0  #: the part of ``memory_bytes`` that ``optimizer.step()`` moves
    ops: int = 0  #: ops dispatched in the step (each costs the framework's per-op time)
    dtensor_ops: int = 0  #: of them, ops on DTensors (each also costs DTensor's sharding propagation)
    by_op: dict[str, dict[str, tuple[int, int]]] = field(default_factory=dict)  #: (bytes, calls) by dim and op
    #: each part of the step ("step": forward and backward, "optimizer") with its own peak and what it held there;
    #: ``peak`` and ``held`` are the highest part's
    phases: dict[str, tuple[int, dict[str, int]]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)  #: :class:`vemesh.planning.fusion.Fusion`'s counts
    #: the model's largest kind of buffer: ``(name, bytes of one)`` (:class:`~vemesh.planning.fake_world.Held`)
    largest_buffer: tuple[str, int] | None = None
    compiled: str | None = None  #: the first module the user's functions compiled (:func:`user_code.compiled_module`)
    #: the TP plan entries torch's parallelize_module skipped, once each (:mod:`vemesh.parallel.plan_keys`)
    skipped_plan: tuple[tuple[str, str, str], ...] = ()
    #: the functions of transformers that took their tracing branch on the plan's fake tensors
    #: (:mod:`vemesh.planning.library_branches`)
    branches: tuple[str, ...] = ()
    #: ``(calls, bytes)`` of the functional collectives a step issued and no op read (by difference over the
    #: micro-batches and blocks; with PP, the traced actions'): held by torch's work registry in a run, step after
    #: step (:meth:`~vemesh.planning.measure.CollectiveBytes.unwaited`)
    unwaited: tuple[int, int] = (0, 0)
    #: the bytes of HF's KV cache at the end of a training forward under torch's activation checkpointing
    #: (:class:`~vemesh.planning.library_branches.TrainingCache`); 0: none
    training_cache: int = 0
    torch_ddp: bool = False  #: the user's functions wrapped torch's DDP, run as it is (:mod:`vemesh.planning.torch_ddp`)
    #: the stages are torch's tracer frontend's (``pipeline(...).build_stage``), whose graph keeps the split model alive
    split_graph: bool = False

    @property
    def weights(self) -> int:
        """The params column: the parameters' local shards and the model's own buffers."""
        return self.held["params"] + self.held.get("buffers", 0)

    def buffers_note(self) -> str | None:
        """Said where the model's own buffers are a tenth of the params column or more (torchtitan's Llama3 keeps a
        RoPE table of 131,072 positions in each block): no wrapper shards them, and the column holds them."""
        held = self.held.get("buffers", 0)
        if self.largest_buffer is None or held < self.weights / 10:
            return None
        name, size = self.largest_buffer
        return (f"the params column includes the model's own buffers, {_mib(held)} a rank, which TP, FSDP2 and ZeRO-1 "
                f"leave whole; the largest: {name}, {_mib(size)} each")

    def split_graph_note(self) -> str | None:
        """Said where the stages are torch's tracer frontend's: each keeps every stage's parameters alive."""
        if not self.split_graph:
            return None
        return ("your stages are torch's tracer frontend's (pipeline(...).build_stage): each holds the split model's "
                "graph, which keeps every stage's parameters alive where the model was built; the peak counts this "
                "rank's stage's, as a job holds on its GPU when it builds the model on the CPU or the meta device "
                "(built on the GPU, each rank holds all of them there; a CPU run holds them too)")

    def compiled_note(self) -> str | None:
        """Said where the user's functions compiled modules: the trace ran them eagerly."""
        if self.compiled is None:
            return None
        return (f"your functions compiled modules with torch.compile (the first: {self.compiled!r}); the trace ran them "
                "eagerly, as it runs every step: the peak is eager's (inductor's recomputation is not modelled), and "
                "--compile with --device-profile times what inductor fuses")

    def skipped_note(self) -> str | None:
        """Said where torch's parallelize_module skipped entries of the user's TP plan: planned unsharded."""
        return describe(list(self.skipped_plan), "and planned so: the figures are of the model as it would run") \
            if self.skipped_plan else None

    def unwaited_note(self, at_least: bool = False) -> str | None:
        """Said, first and in capitals, where the step issued collectives that nothing waits on: the run's memory
        grows by their bytes every step, which a plan of one step does not show. ``at_least``: the count is of the
        traced actions of a pipeline (its replayed ones run no collective)."""
        calls, nbytes = self.unwaited
        if not calls:
            return None
        least = "at least " if at_least else ""
        return (f"MEMORY LEAK: each step issues {least}{calls} collective{'s' if calls > 1 else ''} "
                f"({_mib(nbytes)}) that nothing waits on, which torch's work registry holds in a run, so its memory "
                "grows by that every step past this plan's peak until it fails: a TP collective that activation "
                "checkpointing's recompute issues before the last tensor it needs, whose result is read only after it "
                "(torch.utils.checkpoint stops there; pytorch/torchtitan issue 2763), as in a block whose attention "
                "and MLP run side by side. Recompute whole blocks: checkpoint(..., use_reentrant=False, "
                "early_stop=False) (Hugging Face: gradient_checkpointing_kwargs={'use_reentrant': False, "
                "'early_stop': False})")

    def branches_note(self) -> str | None:
        """Said where transformers counted the plan's fake tensors as a trace and took that branch (its masks)."""
        if not self.branches:
            return None
        return (f"transformers took its tracing branch in {', '.join(self.branches)}: it counts the plan's fake "
                "tensors (shapes, no values) as a trace and does not read the positions or mask your step gives, "
                "so where a run of unpadded, unpacked batches leaves the causal mask to SDPA, the plan builds the "
                "4-D mask: the peak may be over that run's by the mask and what the attention does with it (HF's "
                "Llama given an all-ones mask: 2% over; called without positions or a mask, exact; "
                "vemesh.planning.library_branches)")

    def cache_note(self) -> str | None:
        """Said where HF's KV cache was on in a training forward under torch's activation checkpointing."""
        if not self.training_cache:
            return None
        return (f"HF's KV cache was on in training (use_cache, which transformers' causal models default to) under "
                f"torch's activation checkpointing: it held {_mib(self.training_cache)} of keys and values at the "
                "forward's end, which the checkpoint would have freed, and the recompute appends its own; the figures "
                "count them as a run holds them. Call the model with use_cache=False (HF's "
                "gradient_checkpointing_enable sets it) to free them")

    def torch_ddp_note(self) -> str | None:
        """Said where the user's functions wrapped torch's DDP: what of it ran, and what did not."""
        if not self.torch_ddp:
            return None
        return ("torch's DistributedDataParallel ran as it is, its C++ reducer on the fake world: its buckets (a copy "
                "of the gradients, beside .grad unless gradient_as_bucket_view=True) count in grads, each all-reduced "
                "as torch's default hook does; not run there: the constructor's check of the ranks' parameter shapes, "
                "and the buckets' re-cut after the first step (the same bytes, in the order the gradients came)")

    @classmethod
    def of_phases(cls, phases: dict[str, tuple[int, dict[str, int]]], *rest: Any, counts: dict[str, int]) -> Counted:
        """The count whose peak is the highest of ``phases``' (each ``(peak, held)``)."""
        peak, held = max(phases.values(), key=lambda p: p[0])
        return cls(held, peak, *rest, phases=phases, counts=counts)

    def scaled(self, smaller: Counted, times: int) -> Counted:
        """This trace plus ``times`` x (this - ``smaller``): more blocks or micro-batches, by difference. Each part of
        the step is scaled on its own and the peak is the highest part's: the part that peaks can change as the
        blocks grow (the optimizer's step with few, the backward with many), which a difference of peaks misses."""
        phases = {k: (p + times * (p - smaller.phases[k][0]), _more(h, smaller.phases[k][1], times))
                  for k, (p, h) in self.phases.items() if k in smaller.phases}
        peak, held = max(phases.values(), key=lambda p: p[0]) if phases else \
            (self.peak + times * (self.peak - smaller.peak), _more(self.held, smaller.held, times))
        return replace(self, held=held, peak=peak, phases=phases, sent=_more(self.sent, smaller.sent, times),
                       flops=self.flops + times * (self.flops - smaller.flops),
                       memory_bytes=self.memory_bytes + times * (self.memory_bytes - smaller.memory_bytes),
                       optimizer_bytes=self.optimizer_bytes + times * (self.optimizer_bytes - smaller.optimizer_bytes),
                       ops=self.ops + times * (self.ops - smaller.ops),
                       dtensor_ops=self.dtensor_ops + times * (self.dtensor_ops - smaller.dtensor_ops),
                       by_op=more_ops(self.by_op, smaller.by_op, times),
                       counts=_more(self.counts, smaller.counts, times),
                       unwaited=tuple(a + times * (a - b) for a, b in zip(self.unwaited, smaller.unwaited)))


def more_counts(a: dict[str, int], b: dict[str, int], times: int) -> dict[str, int]:
    """``a + times x (a - b)``, key by key (the counts of more blocks or micro-batches, by difference)."""
    return _more(a, b, times)


def _more(a: dict[str, int], b: dict[str, int], times: int) -> dict[str, int]:
    """``a + times x (a - b)``, key by key."""
    return {k: a.get(k, 0) + times * (a.get(k, 0) - b.get(k, 0)) for k in sorted(set(a) | set(b))}


def more_ops(a: dict[str, dict[str, tuple[int, int]]], b: dict[str, dict[str, tuple[int, int]]],
              times: int) -> dict[str, dict[str, tuple[int, int]]]:
    """:func:`_more` of ``(bytes, calls)`` by dim and op."""
    out = {}
    for dim in sorted(set(a) | set(b)):
        x, y = a.get(dim, {}), b.get(dim, {})
        out[dim] = {op: tuple(u + times * (u - v) for u, v in zip(x.get(op, (0, 0)), y.get(op, (0, 0))))
                    for op in sorted(set(x) | set(y))}
    return out  # type: ignore[return-value]


def _mib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
