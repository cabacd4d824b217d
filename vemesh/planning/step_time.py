"""Seconds per training step, from what a plan traced and a device profile: compute, communication, optimizer.

For each rank class of a traced plan (:class:`~vemesh.planning.results.RankClass`):

* **compute**: the FLOPs counted by torch's ``FlopCounterMode`` formulas over the traced step (forward, backward, every
  micro-batch), at the profile's peak matmul throughput for the dtype times its ``achievable`` fraction; plus
  the bytes every other op (norms, activations, softmax, the optimizer's elementwise math) reads and writes,
  at the memory bandwidth (:class:`~vemesh.planning.fusion.MemoryBoundBytes`); plus the framework's time per op
  dispatched, and per DTensor op on top (the profile's ``op_overhead_s``, ``dtensor_op_overhead_s``);
* **communication**, per mesh dim and collective kind, a latency-bandwidth model of the link the dim's groups
  cross (``host`` when every group lies inside one host of ``devices_per_host`` ranks, else ``network``, or
  ``rack`` when the profile has racks and some group lies in more than one), with
  nccl-tests' bus-bandwidth factors: ``2(n-1)/n`` of the buffer for an all-reduce, ``(n-1)/n`` of the full buffer
  for an all-gather, a reduce-scatter and an all-to-all, the whole tensor for a broadcast or a send; and one
  latency per ring step (``2(n-1)`` for an all-reduce, ``n-1`` for the others, 1 for a send), and per call the
  profile's ``collective_wait_s`` (the ranks reach a collective at different moments), and per call of torch's
  functional collectives (DTensor's redistributions: TP, SP, CP) its ``functional_wait_s`` on top. ZeRO-1's gather
  of the updated shards is timed as the profile's ``backend`` runs it (:func:`_gather_seconds`);
* **overlap**: what runs behind compute. The data-parallel gradient reduction (vemesh DDP's buckets, ZeRO-1's
  all-reduce) runs during backward, so it hides behind up to the backward's compute (2/3 of the step's); FSDP2
  prefetches its all-gathers and reduce-scatters behind the whole step's compute. Only the wrappers' own c10d
  collectives hide so: a functional collective on a gradient dim (CP's ring exchange, when FSDP shards over CP
  alone) is on the critical path; the profile's ``overlap`` says
  how much of that the device can really run at once (``vemesh calibrate`` measures it). ZeRO-1's gather of the updated
  shards after the step, and every TP, CP, EP and PP collective, are on the critical path: exposed; but under
  ``--async-tp`` a TP all-gather or reduce-scatter that torch's micro-pipeline pass fuses with its matmuls
  (:mod:`vemesh.planning.tp_overlap`) hides behind those matmuls, call by call;
* **optimizer**: the bytes the traced ``optimizer.step()`` reads and writes (its elementwise math over each
  local parameter, gradient, both moments, ZeRO-1's masters), at the memory bandwidth; they are not in compute;
* **the pipeline bubble**: with PP, torch's own action list of the schedule (:func:`pipeline_bubbles`) played on
  every PP rank at once: each rank runs its actions in order, a forward of a stage waits for that micro-batch's
  forward on the stage before, a backward (or an input pass) for the one on the stage after, a weight pass for its
  own input pass. A rank's actions share its compute (a forward 1, a full backward 2, an input or a weight pass 1
  each); the bubble of a rank is the pipeline's span less its own compute. Where ranks share compute engines
  (the profile's ``shared_compute``: more ranks than CPU cores), the ranks that compute while others wait run
  faster, as the engines' time is theirs.

The step time is compute + exposed communication + optimizer + bubble; the slowest rank class is the job's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from vemesh.planning.profiles import DeviceProfile, Link
from vemesh.planning.speedups import Speedups, compute_dtype, paced

__all__ = ["WORLD", "DimTime", "StepTime", "collective_seconds", "fed_flops", "op_name", "pipeline_bubbles", "render", "ring",
           "step_time"]

#: What a plan and a run call torch's default group (every rank: a training loop's all-reduce of its loss) when no
#: mesh name's group is every rank; it is timed on the link a group of every rank crosses.
WORLD = "world"
#: The kinds whose bus traffic is (n-1)/n of the buffer, with n-1 latency steps; the all-reduce's is twice that.
_ONE_PASS = ("all_gather", "reduce_scatter", "all_to_all")
_ALL_REDUCE = ("all_reduce",)
#: What ZeRO-1 runs after the optimizer step (the updated shards to every rank): not hidden behind backward.
_GATHERS = ("all_gather", "broadcast")


_CANONICAL = {"allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "_allgather_base": "all_gather",
              "allgather": "all_gather", "all_gather_into_tensor": "all_gather", "_reduce_scatter_base": "reduce_scatter",
              "reduce_scatter_tensor": "reduce_scatter", "alltoall": "all_to_all", "alltoall_base": "all_to_all",
              "all_to_all_single": "all_to_all"}


#: torch's functional collectives (``torch.ops._c10d_functional``), by the names the trace records: what DTensor's
#: redistributions (TP, SP) and CP's exchanges call. c10d's own ops (DDP's, FSDP2's, ZeRO-1's) are named otherwise
#: (``allreduce_``, ``_allgather_base_``, ``alltoall_base_``, ``send``).
FUNCTIONAL = frozenset({"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor",
                        "all_gather_into_tensor_coalesced", "all_gather_into_tensor_out", "reduce_scatter_tensor",
                        "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"})


def op_name(key: str) -> str:
    """A trace's collective key without the matmul FLOPs :mod:`vemesh.planning.tp_overlap` pairs it with:
    ``all_gather_into_tensor@96`` is ``all_gather_into_tensor``."""
    return key.split("@")[0]


def fed_flops(key: str) -> int:
    """The matmul FLOPs per call that a key of :mod:`vemesh.planning.tp_overlap` names (0 for an unpaired one)."""
    _, _, flops = key.partition("@")
    return int(flops) if flops else 0


def _base(op: str) -> str:
    """An op as torch names it: ``allreduce_[1]`` (a trace's key for an all-reduce of 1 value) is ``allreduce_``, and
    ``all_gather_into_tensor@FLOPS`` (one async TP fuses with its matmuls, :mod:`vemesh.planning.tp_overlap`)
    ``all_gather_into_tensor``."""
    return op_name(op).split(".")[0].split("[")[0]


def _values(op: str) -> int | None:
    """The values per call of a trace's key ``allreduce_[K]`` (an all-reduce of few values), else None."""
    return int(op.split("[")[1].rstrip("]")) if "[" in op else None


def _kind(op: str) -> str:
    """A collective op's kind as ``vemesh calibrate`` names it: ``allreduce_`` and ``all_reduce`` are ``all_reduce``."""
    base = _base(op).rstrip("_")
    return _CANONICAL.get(base, base)


def ring(kind: str, n: int) -> tuple[float, int]:
    """``(bus factor, latency steps)`` of one ``kind`` collective over ``n`` ranks (nccl-tests' bus bandwidth):
    ``(2(n-1)/n, 2(n-1))`` for an all-reduce, ``((n-1)/n, n-1)`` for an all-gather, a reduce-scatter or an
    all-to-all, ``(1, 1)`` for the rest (a broadcast, a send). ``vemesh calibrate`` fits its links by the same rule."""
    if kind in _ALL_REDUCE:
        return 2 * (n - 1) / n, 2 * (n - 1)
    if kind in _ONE_PASS:
        return (n - 1) / n, n - 1
    return 1.0, 1


def _wait(op: str, profile: DeviceProfile) -> float:
    """Seconds one call of ``op`` waits on top of its latency and bandwidth (see the module docstring)."""
    functional = _base(op) in FUNCTIONAL
    return profile.collective_wait_s + (profile.functional_wait_s if functional else 0.0)


def _gather_seconds(nbytes: float, calls: int, n: int, profile: DeviceProfile, link_name: str) -> float:
    """ZeRO-1's gather of the updated shards, ``calls`` gathers of ``nbytes`` in all (as traced, an all-gather per
    buffer), as the job's backend runs it (``vemesh.parallel.optim.param_buffer``, the one rule): on gloo one
    broadcast per rank of its slice, all issued at once and then waited for, so ``n`` broadcasts of ``1/n`` of each
    buffer and one wait per buffer; elsewhere the all-gather."""
    from vemesh.parallel.optim.param_buffer import param_gather_for_backend  # torch: only when a ZeRO-1 plan is timed

    if n <= 1:
        return 0.0
    wait = calls * _wait("all_gather", profile)
    if param_gather_for_backend(profile.backend) == "broadcast":
        return collective_seconds("broadcast", nbytes, n * calls, n, profile.link(link_name, "broadcast", n)) + wait
    return collective_seconds("all_gather", nbytes, calls, n, profile.link(link_name, "all_gather", n)) + wait


def collective_seconds(op: str, nbytes: float, calls: int, n: int, link: Link, backend: str = "nccl") -> float:
    """Seconds that ``calls`` collectives ``op`` of ``nbytes`` in all (nccl-tests' size) take over ``n`` ranks.

    On gloo an all-reduce of ``K < 2n`` values (a loss, a gradient norm, a flag: a trace keys it ``allreduce_[K]``)
    takes ``K / 2n`` of the ring's latency steps: gloo's ring cuts the buffer into at least ``2n`` segments and
    sends only those that hold values (``gloo/allreduce.cc``); one value over 4 ranks took 0.5 ms here, 8 or more
    5 to 6 ms. nccl runs every step."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    factor, steps = ring(_kind(op), n)
    values = _values(op)
    if backend == "gloo" and values is not None:
        steps = steps * min(1.0, values / (2 * n))
    return calls * steps * link.latency_s + factor * nbytes / link.bandwidth


@dataclass(frozen=True)
class DimTime:
    """One mesh dim's communication in a step: its link class, the seconds in all, and how many of them hide."""

    link: str
    seconds: float
    hidden: float

    @property
    def exposed(self) -> float:
        return self.seconds - self.hidden


@dataclass(frozen=True)
class StepTime:
    """One rank class's step: the parts (seconds) and their sum."""

    name: str
    compute: float
    optimizer: float
    bubble: float
    dims: dict[str, DimTime] = field(default_factory=dict)
    #: the device's work in ``compute`` where the host's dispatch set it instead (a queued profile's), else None
    device: float | None = None
    #: timed with --compile's rules where the eager step would be bound by the host's dispatch (a queued profile's)
    compiled_host_bound: bool = False
    #: the dtype most of its matmuls ran in (:func:`~vemesh.planning.speedups.compute_dtype`), whose peak is the MFU's
    dtype: str | None = None
    #: the share of its FLOPs timed at the fp8 rate (``--float8``: the Linears' matmuls but the head's), else 0
    fp8_share: float = 0.0

    @property
    def exposed(self) -> float:
        return sum(d.exposed for d in self.dims.values())

    @property
    def total(self) -> float:
        return self.compute + self.exposed + self.optimizer + self.bubble


def step_time(fit: Any, profile: DeviceProfile, *, dtype: str, dp_mode: str, grad_dims: tuple[str, ...],
              sizes: dict[str, int], links: dict[str, str], speed: Any = None) -> list[StepTime]:
    """Each rank class's :class:`StepTime` of a traced ``fit`` (see the module docstring).

    Args:
        grad_dims: the dims gradients reduce over (the data dims' gradient dim, and EDP for experts).
        sizes: each dim's group size; ``links``: the link class its groups cross (``host``, ``network``, ``rack``).
        speed: a :class:`~vemesh.planning.speedups.Speedups` (compile, Float8, async TP), its rules applied.
    """
    speed = speed or Speedups()
    out = []
    for index, c in enumerate(fit.classes):
        if not c.flops:  # an untimed trace (Job.timed false) counted nothing: a step of 0 s would be silently wrong
            raise ValueError(f"{c.name}: the plan counted no FLOPs (traced without timing, or not traced); a step "
                             "time needs a traced step planned with a device profile (Job(..., timed=True))")
        device, host = speed.compute_parts(c, index, profile, dtype)
        ran_in = compute_dtype(getattr(c, "counts", None) or {}, dtype)  # the dtype most of its matmuls ran in
        compute = paced(device, host, profile)
        backward = compute * 2 / 3
        # what the gradient dims' wrapper collectives may hide behind, shared by them: HSDP's dp_shard and dp_replicate
        # (FSDP2's gathers and reduce-scatters, its all-reduce of the shard) hide behind the same compute, not each
        # behind its own copy of it
        left = {"fsdp": compute, "backward": backward}
        dims: dict[str, DimTime] = {}
        for dim, ops in sorted(c.collectives.items()):
            link_name = links.get(dim, "host")
            n = sizes.get(dim, 1)
            fsdp_gather = dim in grad_dims and dp_mode == "fsdp"

            def moved(op: str, b: int) -> float:  # the bytes on the wire: FSDP2's and TP's Float8 gathers move fewer
                if _kind(op) == "all_gather" and fsdp_gather:
                    return speed.gathered_bytes(b)
                return speed.tp_gathered_bytes(fed_flops(op), b) if _kind(op) == "all_gather" and dim == "TP" else b
            each = {op: _gather_seconds(b, calls, n, profile, link_name)
                    if dim in grad_dims and dp_mode == "zero1" and _kind(op) == "all_gather"
                    else collective_seconds(op, moved(op, b), calls, n, profile.link(link_name, _kind(op), n),
                                            profile.backend)
                    + (calls * _wait(op, profile) if n > 1 else 0.0) for op, (b, calls) in ops.items()}
            seconds = sum(each.values())
            # on a gradient dim, only the wrappers' own (c10d) collectives run behind compute: a functional one
            # there is the forward's or backward's own exchange (CP's ring when FSDP shards over CP alone)
            wrapper = {op: t for op, t in each.items() if _base(op) not in FUNCTIONAL}
            if dim in grad_dims and dp_mode == "fsdp":
                hidable = cover = min(sum(wrapper.values()), left["fsdp"])
                left["fsdp"] -= cover
            elif dim in grad_dims:  # the gradient reduction in backward; ZeRO-1's gather after the step is exposed
                hidable = cover = min(sum(t for op, t in wrapper.items() if _kind(op) not in _GATHERS), left["backward"])
                left["backward"] -= cover
            elif dim == "TP" and speed.async_tp:  # each gather or scatter fused with its matmuls, behind them only
                hidable = sum(min(t, ops[op][1] * speed.matmul_seconds(fed_flops(op), profile, ran_in))
                              for op, t in each.items() if fed_flops(op))
                cover = hidable
            else:
                hidable, cover = 0.0, 0.0
            dims[dim] = DimTime(link_name, seconds, profile.overlap * min(hidable, cover))
        optimizer = c.optimizer_bytes / profile.memory_bandwidth
        eager = Speedups().compute_parts(c, index, profile, dtype) if speed.compile else (0.0, 0.0)
        out.append(StepTime(c.name, compute, optimizer, 0.0, dims, device if profile.queued and host > device else None,
                            profile.queued and eager[1] > eager[0], ran_in, speed.fp8_flops(c, index) / c.flops))
    pp = fit.degrees.get("PP", 1)
    if pp > 1 and fit.pp_schedule and len(out) == pp:
        bubbles = pipeline_bubbles(fit.pp_schedule, pp, fit.micro_batches, [t.compute for t in out],
                                   profile.shared_compute)
        out = [replace(t, bubble=b) for t, b in zip(out, bubbles)]
    return out


_WEIGHT = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}


def pipeline_bubbles(schedule: str, pp: int, n_microbatches: int, busy: list[float], shared: float = 1.0) -> list[float]:
    """Each PP rank's idle seconds in one step of ``schedule`` when rank ``r`` computes for ``busy[r]`` seconds: torch's
    action list played on every rank at once (see the module docstring); communication is not in it.

    ``shared`` (the profile's ``shared_compute``): how many ranks share one compute engine when all of them run (a CPU
    host with more ranks than cores). ``busy`` is timed with every rank running; while only some PP ranks compute
    (the others wait in the bubble), each runs up to ``shared`` times faster, ``pp / active`` at most. 1 on a device
    of its own: each rank's pace is its own."""
    from vemesh.parallel.schedules import actions, stages_per_rank  # torch: a request (fit_report) imports this module

    n_stages = pp * stages_per_rank(schedule)
    order = {}
    for rank, steps in actions(schedule, pp, n_microbatches).items():
        flat = []
        for a in steps:
            for one in (a.sub_actions or (a,)) if a is not None else ():
                kind = one.computation_type.value
                if kind in _WEIGHT:
                    flat.append((one.stage_index, kind, one.microbatch_index))
        order[rank] = flat
    unit = [busy[r] / max(1.0, sum(_WEIGHT[k] for _, k, _ in order[r])) for r in range(pp)]
    done: dict[tuple[int, str, int], float] = {}

    def ready(stage: int, kind: str, mb: int) -> bool:
        if kind == "F":
            deps = [(stage - 1, "F", mb)] if stage > 0 else []
        elif kind in ("B", "I"):
            deps = [(stage, "F", mb)] + ([(stage + 1, "B", mb)] if stage < n_stages - 1 else [])
        else:
            deps = [(stage, "I", mb)]
        # a backward waits for the next stage's backward or its input pass, whichever it ran
        return all(d in done or (d[1] == "B" and (d[0], "I", d[2]) in done) for d in deps)

    at = [0] * pp  # each rank's next action
    left: dict[int, float] = {}  # the ranks computing now: the work their action has left
    now, finished = 0.0, [0.0] * pp
    while any(at[r] < len(order[r]) for r in range(pp)):
        for r in range(pp):
            if r not in left and at[r] < len(order[r]) and ready(*order[r][at[r]]):
                left[r] = _WEIGHT[order[r][at[r]][1]] * unit[r]
        if not left:
            raise RuntimeError(f"the {schedule} action list over {pp} ranks does not complete (a wait with no end)")
        speed = min(shared, pp / len(left))
        step = min(left.values()) / speed
        now += step
        for r in list(left):
            left[r] -= step * speed
            if left[r] <= 1e-12 * max(1.0, unit[r]):
                done[order[r][at[r]]] = finished[r] = now
                at[r] += 1
                del left[r]
    span = max(finished)
    return [max(0.0, span - b) for b in busy]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.3f} ms" if seconds < 10 else f"{seconds:9.2f} s "


def render(times: list[StepTime], profile: DeviceProfile, width: int = 40) -> str:
    """The slowest class's step on ``profile``: one line per part, the exposed time per dim as a bar."""
    t = max(times, key=lambda x: x.total)
    said = "measured by vemesh calibrate" if profile.measured else "published specifications, NOT MEASURED here"
    lines = [f"step time on {profile.name} ({said}): {t.total * 1e3:.3f} ms ({t.name}; the slowest class)"]
    host = "" if t.device is None else f"  the host's dispatch sets it; the device's work is {t.device * 1e3:.3f} ms"
    fp8 = f", the Linears' ({t.fp8_share:.0%} of the FLOPs) in fp8" if t.fp8_share else ""
    parts = [("compute", t.compute, f"  matmuls in {t.dtype}{fp8}" + (f";{host[1:]}" if host else "") if t.dtype
              else host),
             ("optimizer", t.optimizer, "")]
    parts += [(f"{dim} exposed", d.exposed, f"  {d.link} link; {d.seconds * 1e3:.3f} ms in all, "
               f"{d.hidden * 1e3:.3f} ms hidden behind compute") for dim, d in t.dims.items()]
    if t.bubble:
        parts.append(("PP bubble", t.bubble, ""))
    label = max(16, *(len(name) + 1 for name, _, _ in parts))  # "dp_replicate exposed" is 20 letters
    for name, seconds, why in parts:
        bar = "#" * round(width * seconds / t.total) if t.total else ""
        lines.append(f"  {name:<{label}}{_ms(seconds)}  |{bar:<{width}}|{why}")
    if t.compiled_host_bound:
        lines.append("  note: eager, this step is bound by the host's dispatch. --compile's time counts each compiled "
                     "kernel at an eager op's host time, and there a GPU's compiled blocks cost the host more (on an "
                     "H200, GPT 12 x 768's compiled step measured 1.13 to 1.48x its eager one, planned at 0.81): "
                     "measure before choosing compile for this job")
    return "\n".join(lines)
