"""Will it fit? Each rank class's peak memory and each dim's bytes per step, for a mesh or for every mesh.

:func:`predict` answers for one mesh (degrees PP, DP, CP, TP, EP), :func:`search` for every mesh of a world size,
ranked. The user's factory, parallelize function and step are traced on a fake world
(:mod:`vemesh.planning.user_model`), the presets through their own functions (:mod:`vemesh.models.gpt.planned`);
with PP each PP rank through torch's own schedule class (:mod:`vemesh.planning.pipeline_trace`): the micro-batches
in flight, the receive buffers and the sends are the schedule's. Checked against runs (``bench/plan_accuracy.py``).

Not traced: a mesh whose weights, gradients and optimizer state alone exceed the device (:func:`vemesh.planning.estimate.rank_static`:
what DDP, ZeRO-1 and FSDP2 allocate, to the byte but ZeRO-1's padding); a factory without its step (static, DP bytes:
:mod:`vemesh.planning.static_traffic`). A search leaves a preset's PP meshes out unless ``--trace-pp``
(:func:`vemesh.planning.search_jobs.not_searched`): each is traced as ``--pp N`` traces it, or not planned.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from vemesh.models.gpt import planned as gpt_planned
from vemesh.models.llama3 import planned as llama3_planned
from vemesh.models.llama3.config import check_ac, config_of, linear_share as llama3_linear_share
from vemesh.layout.names import divisors
from vemesh.parallel.context.ring import check_sequence_split
from vemesh.parallel.schedules import ZERO_BUBBLE, schedule_class, stage_owner, stages_per_rank
from vemesh.planning.estimate import Model, check_degrees, gpt_config, load_model, rank_static, stage_keys
from vemesh.planning.mesh_plan import MeshPlan, plan_mesh
from vemesh.planning.placement import place
from vemesh.planning.results import MeshFit, RankClass
from vemesh.planning.search_jobs import gib, not_searched, run, static_over, variants
from vemesh.planning.static_traffic import dp_traffic, nbytes
from vemesh.planning.pipeline_plan import predict_pipeline, shared_records
from vemesh.planning.speedups import check_user_float8, linear_share
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.user_model import predict_user
from vemesh.planning.user_template import blocks_of, template_of

__all__ = ["Job", "MeshFit", "RankClass", "predict", "search", "speedups_of"]

#: How a search ranks the meshes that fit.
RANKINGS = ("time", "inter-host", "peak")


@dataclass(frozen=True)
class Job:
    """What is trained, and how, apart from the mesh."""

    model: Any  #: ``--model``: ``gpt:...``, ``module:pkg.mod:factory``, or (Python API) the factory itself
    global_batch_size: int
    dtype: str = "fp32"
    dp_mode: str | None = None  #: ddp (vemesh DDP + AdamW), zero1 (+ DistributedOptimizer) or fsdp (FSDP2); None: zero1,
    #: or for the user's parallelize function what it applied
    micro_batch_size: int | None = None  #: sequences per forward on a DP rank (default: PP's 2 x PP micro-batches)
    pp_schedule: str = "1f1b"
    sequence_parallel: bool = False
    #: ``none``/``full`` (the GPT preset: each block recomputed in backward), and for the Llama 3 preset
    #: ``selective-op`` and ``selective-N`` too (:mod:`vemesh.models.llama3.parallelize`); a bool is none/full
    activation_checkpointing: bool | str = False
    parallelize: Any = None  #: ``--parallelize MODULE:FUNCTION`` (or the function): the user's own, run on the mesh
    step: Any = None  #: ``--step MODULE:FUNCTION`` (or the function): one forward and backward of a micro-batch
    loss: Any = None  #: ``--loss MODULE:FUNCTION`` (or the function): with PP, the schedule's ``loss_fn``
    before_optimizer: Any = None  #: ``--before-optimizer MODULE:FUNCTION`` (or the function): the loop's end of a step
    moe_load_factor: float = 1.0  #: the busiest EP rank's share of the slots over the balanced share
    timed: bool = False  #: count what a step-time prediction needs (FLOPs, memory-bound bytes, ops) while tracing
    #: where the step runs (a queued profile's): on ``cuda`` foreach AdamW, ZeRO-1's runs whole; a CPU's 512K chunks
    device: str = "cpu"
    #: what GPU users turn on, modelled on the traced step (:mod:`vemesh.planning.step_time`), not traced
    speed: Any = None  #: :class:`vemesh.planning.speedups.Speedups` (compile, Float8, async TP), None for none
    trace_pp: bool = False  #: a search traces its PP meshes through torch's schedule, as ``--pp N`` does
    optimizer_implementation: str | None = None  #: ``for-loop``, ``foreach``, ``fused``; None: as torch on ``device``
    gradient_sync: str | None = None  #: ``each``: every micro-batch's backward averages the gradients (else the last)
    compiled_loss: bool = False  #: the Llama 3 preset's loss compiled (``--compile``): traced as inductor holds it

    @property
    def mode(self) -> str:
        """``dp_mode``, zero1 when not given."""
        return self.dp_mode or "zero1"

    @property
    def llama3(self) -> bool:
        """Whether the model is the Llama 3 preset (``llama3:SIZE``)."""
        return isinstance(self.model, str) and self.model.startswith("llama3:")

    @property
    def user(self) -> bool:
        """Whether the user's own functions are traced (``--step`` given)."""
        return self.step is not None or self.parallelize is not None

    @property
    def name(self) -> str:
        """The model as the output names it."""
        return self.model if isinstance(self.model, str) else \
            f"{getattr(self.model, '__module__', '?')}:{getattr(self.model, '__qualname__', repr(self.model))}"


@functools.lru_cache(maxsize=32)
def _preset_factory(spec: str) -> Callable[[], Any]:
    """One factory per GPT spec, so that every mode, schedule and mesh of it copies one meta model."""
    return gpt_planned.factory(gpt_config(spec))


@functools.lru_cache(maxsize=32)
def _preset_functions(spec: str, mode: str, dtype: str, sequence_parallel: bool, checkpointed: bool,
                      pp_schedule: str, pp: bool, sync_each: bool = False) -> UserFunctions:
    """The GPT preset's functions (:mod:`vemesh.models.gpt.planned`), the same objects for the same job: with PP the
    step runs a batch through torch's ``pp_schedule``, the loss the example's; ``sync_each``: ``--gradient-sync each``."""
    step = gpt_planned.pipeline_step_for(pp_schedule) if pp else gpt_planned.step
    return UserFunctions(_preset_factory(spec),
                         gpt_planned.parallelize_for(mode, dtype, sequence_parallel, checkpointed, pp_schedule), step,
                         (spec, "vemesh.models.gpt.parallelize", f"vemesh.models.gpt.planned.{step.__qualname__}"),
                         keep_dp=True, loss=gpt_planned.loss_fn, pp_schedule=pp_schedule, sync_each=sync_each,
                         before_optimizer=gpt_planned.before_optimizer_for(pp_schedule),
                         before_optimizer_name=f"vemesh.models.gpt.planned.before_optimizer_for({pp_schedule!r})",
                         stage_kinds=gpt_planned.stage_kinds_for(gpt_config(spec), pp_schedule))


@functools.lru_cache(maxsize=64)
def _llama3_functions(spec: str, mode: str, dtype: str, ac: str, pp_schedule: str, compiled: bool) -> UserFunctions:
    """The Llama 3 preset's functions (:mod:`vemesh.models.llama3.planned`), the same objects for the same job."""
    step = llama3_planned.step_for(compiled)  # the loss as torch.compile holds it, where it is compiled
    return UserFunctions(llama3_planned.factory(config_of(spec)),
                         llama3_planned.parallelize_for(mode, dtype, ac, pp_schedule), step,
                         (spec, "vemesh.models.llama3.parallelize", f"vemesh.models.llama3.planned.{step.__name__}"),
                         loss=llama3_planned.compiled_loss_fn if compiled else llama3_planned.loss_fn,
                         pp_schedule=pp_schedule, sync_each=True,
                         before_optimizer=llama3_planned.before_optimizer,
                         before_optimizer_name="vemesh.models.llama3.planned.before_optimizer",
                         stage_kinds=llama3_planned.stage_kinds_for(config_of(spec), ac, pp_schedule))


@functools.lru_cache(maxsize=64)
def _traced_llama3(job: Job, *, dp: int, tp: int, pp: int, cp: int, ep: int, dp_replicate: int) -> MeshFit:
    """The Llama 3 preset traced like any user model: with PP its stages through torch's schedule (the step of a DP
    rank's batch), else a micro-batch. FSDP2 keeps fp32 parameters and computes in the job's dtype."""
    if ep > 1:
        raise ValueError(f"EP {ep}: the Llama 3 preset is dense (no experts); plan it with --ep 1")
    fns = _llama3_functions(job.model, job.mode, job.dtype, check_ac(job.activation_checkpointing), job.pp_schedule,
                            job.compiled_loss)
    if pp > 1:
        fns = replace(fns, step=llama3_planned.pipeline_step_for(job.pp_schedule),
                      names=(fns.names[0], fns.names[1],
                             f"vemesh.models.llama3.planned.pipeline_step_for({job.pp_schedule!r})"))
    return (predict_pipeline if pp > 1 else predict_user)(
        fns, world_size=pp * dp * cp * tp, degrees={"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep},
        dp_replicate=dp_replicate, global_batch_size=job.global_batch_size, micro_batch_size=job.micro_batch_size,
        dtype="fp32" if job.mode == "fsdp" else job.dtype, dp_mode=job.mode, load_factor=1.0, timed=job.timed,
        device=job.device, optimizer_implementation=job.optimizer_implementation)


@functools.lru_cache(maxsize=64)  # a search asked again (another device memory, placement or ranking) traces nothing
def _traced_preset(job: Job, *, dp: int, tp: int, pp: int, cp: int, ep: int, dp_replicate: int) -> MeshFit:
    """The GPT preset traced like any user model (with PP through torch's schedule). FSDP2 keeps fp32 parameters and
    computes in the job's dtype (the example's mixed precision), so its trace starts from fp32; DDP and ZeRO-1 train
    the model in the job's dtype (ZeRO-1 with fp32 masters)."""
    fns = _preset_functions(job.model, job.mode, job.dtype, job.sequence_parallel, job.activation_checkpointing,
                            job.pp_schedule, pp > 1, job.gradient_sync == "each")
    fit = (predict_pipeline if pp > 1 else predict_user)(
        fns, world_size=pp * dp * cp * tp, degrees={"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep},
        dp_replicate=dp_replicate, global_batch_size=job.global_batch_size, micro_batch_size=job.micro_batch_size,
        dtype="fp32" if job.mode == "fsdp" else job.dtype, dp_mode=job.mode, load_factor=job.moe_load_factor,
        timed=job.timed, device=job.device, optimizer_implementation=job.optimizer_implementation)
    return replace(fit, notes=tuple(n for n in fit.notes if not n.startswith(("dp mode ", "gradient accumulation"))))


def predict(job: Job, *, dp: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
            dp_replicate: int = 1) -> MeshFit:
    """The prediction per rank class for the mesh ``(PP, DP, CP, TP)`` (EP folded over DP x CP), traced; with PP
    through torch's schedule (:func:`~vemesh.planning.pipeline_plan.predict_pipeline`). Raises ``ValueError`` (one
    line, naming the value) for what the job or the mesh cannot be.
    """
    if job.user:
        if job.dp_mode is not None and job.dp_mode not in ("ddp", "zero1", "fsdp"):
            raise ValueError(f"dp_mode must be ddp, zero1 or fsdp; got {job.dp_mode!r}")
        fns = UserFunctions.of(job.model, job.parallelize, job.step, job.loss, job.pp_schedule, job.before_optimizer)
        fns = replace(fns, sync_each=job.gradient_sync == "each")
        return (predict_pipeline if pp > 1 else predict_user)(fns, world_size=pp * dp * cp * tp,
                            degrees={"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep}, dp_replicate=dp_replicate,
                            global_batch_size=job.global_batch_size, micro_batch_size=job.micro_batch_size,
                            dtype=job.dtype, dp_mode=job.dp_mode, load_factor=job.moe_load_factor, timed=job.timed,
                            device=job.device, optimizer_implementation=job.optimizer_implementation)
    if job.llama3:
        if pp > 1:
            _check_pipeline(job, pp, dp * cp, config_of(job.model).n_layers, job.model)
        return _traced_llama3(_as_traced(job), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_replicate)
    if not isinstance(job.model, str):
        raise ValueError(f"a model given as {type(job.model).__name__} needs its step (step=...) to be traced; "
                         "without one, give --model as gpt:... or module:package.module:factory")
    model = load_model(job.model)
    check_degrees(model, dp=dp * cp, tp=tp, pp=pp, ep=ep, dtype=job.dtype, dp_mode=job.mode)
    cfg = dict(model.config)
    if model.kind != "gpt":
        return _static_only(model, job, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
    if cp > 1:  # said here, not as the preset's step failing in the trace: the example's rule (load balanced)
        check_sequence_split(cfg["block_size"], cp, True, what=f"seq_len {cfg['block_size']}")
    if cfg.get("moe_experts"):  # as the example: MoE on DP/TP/CP meshes, DDP or ZeRO-1; every block a MoE
        for bad, why in ((job.mode == "fsdp", "--dp-mode fsdp"),
                         (cfg.get("moe_every", 1) > 1, "moe_every > 1 (blocks of two kinds)")):
            if bad:
                raise ValueError(f"MoE with {why} is not modeled yet; plan it with dp-mode ddp or zero1, "
                                 "moe_every=1")
    if pp > 1:
        _check_pipeline(job, pp, dp * cp, model.n_layer, "the model")
    return _traced_preset(_as_traced(job), dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=dp_replicate)


def _check_pipeline(job: Job, pp: int, data_ranks: int, blocks: int, model: str) -> None:
    """A preset's pipeline, refused before a trace: an unknown schedule; more stages than blocks; a zero-bubble
    schedule with FSDP2 over data ranks (FSDP2 misses the weight pass's gradients, as the example says) or under
    selective-op (torch's selective checkpoint takes one backward a region; the input and weight passes are two),
    each of which was refused from inside a trace, naming the preset's functions."""
    schedule_class(job.pp_schedule)  # a ValueError names the schedules
    if pp * stages_per_rank(job.pp_schedule) > blocks:
        raise ValueError(f"{pp * stages_per_rank(job.pp_schedule)} pipeline stages need at least as many blocks; "
                         f"{model} has {blocks}")
    if job.pp_schedule in ZERO_BUBBLE and job.activation_checkpointing == "selective-op":
        raise ValueError(f"--activation-checkpointing selective-op with --pp-schedule {job.pp_schedule}: torch's "
                         "selective checkpoint allows one backward through a region, and a zero-bubble schedule runs "
                         "two (the input pass, then the weight pass); choose full or selective-N, or --pp-schedule "
                         "gpipe, 1f1b or interleaved-1f1b")
    if job.pp_schedule in ZERO_BUBBLE and job.mode == "fsdp" and data_ranks > 1:
        default = " (the Llama 3 preset's default)" if job.llama3 else ""
        raise ValueError(f"--pp-schedule {job.pp_schedule} with --dp-mode fsdp{default} over DP x CP = {data_ranks}: "
                         "torch's zero-bubble schedules add the weight pass's gradients outside autograd's hooks, so "
                         f"FSDP2 never reduces them; plan {job.pp_schedule} with --dp-mode ddp or zero1, or fsdp with "
                         "--pp-schedule gpipe, 1f1b or interleaved-1f1b")


def _as_traced(job: Job) -> Job:
    """``job`` as its trace sees it: the switches (``speed``) change only the step time, so it reuses the trace."""
    return replace(job, speed=None, trace_pp=False)


def _static_only(model: Model, job: Job, *, dp: int, tp: int, pp: int, cp: int, ep: int) -> MeshFit:
    """A module factory: its static memory and DP bytes; no forward to trace, so no activations."""
    if pp > 1 or cp > 1:
        raise ValueError("PP and CP need the GPT example's stage cut and attention (--model gpt:...); a module factory "
                         "is planned on DP only")
    keys = stage_keys(model, 1)[0]
    static = rank_static(model, keys, "every rank", dp=dp, tp=tp, ep=ep, dtype=job.dtype, dp_mode=job.mode)
    (dense, _), extra = dp_traffic(model, keys, job, dp, tp, 1)
    return MeshFit({"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep},
                   [RankClass("every rank", static, 0, extra, {"DP": nbytes(dense)} if dense else {})],
                   1, job.global_batch_size // dp, traced=False, dp_mode=job.mode)


@shared_records()  # its PP meshes replay each other's records (pipeline_plan)
def search(job: Job, world_size: int, *, device_memory: int | None = None, devices_per_host: int | None = None,
           cp: int = 1, ep: int = 1, rank_by: str | None = None,
           timed: Callable[[MeshFit, MeshPlan], list[Any]] | None = None,
           choose: tuple[str, ...] = (), jobs: int = 1, dp_replicate: int = 1) -> tuple[list[MeshFit], list[MeshFit]]:
    """Every ``(PP, DP, CP, TP)`` mesh of ``world_size`` ranks (CP and EP as given): ``(fitting, rejected)``.

    With ``devices_per_host`` (and more ranks than one host), each mesh's dims are placed on the hosts
    (:func:`vemesh.planning.placement.place`: the order whose step is shortest, else whose bytes between hosts
    are fewest). ``timed(fit, mesh)`` (a device profile) times each placed mesh. The fitting ones are ranked by
    ``rank_by``: ``"time"`` (the shortest predicted step; needs ``timed``), ``"inter-host"`` (the default with
    ``devices_per_host``: the fewest bytes a rank sends per step over links between hosts, then the lowest
    peak) or ``"peak"`` (the lowest peak). A mesh is rejected, with its reason, when its peak is over
    ``device_memory`` or when the job cannot run on it (TP that does not divide the heads, ...).

    ``choose`` (a search by time) also chooses, for each mesh, what :func:`_variants` lists: the micro-batch size and
    the GPT preset's activation checkpointing. Without PP the first variant that fits is taken (the largest
    micro-batch, no recompute: the same FLOPs in fewer passes, so fewer ops and fewer FSDP2 gathers); with PP every
    variant that fits is timed and the fastest kept (more micro-batches shrink the bubble).

    ``jobs``: the meshes are planned in that many processes at once (:mod:`vemesh.planning.search_jobs`).
    ``dp_replicate``: each mesh's DP split for HSDP (:func:`~vemesh.planning.search_jobs.not_searched` says which not).
    """
    rank_by = rank_by or ("time" if timed else "inter-host" if devices_per_host else "peak")
    if rank_by not in RANKINGS:
        raise ValueError(f"rank_by must be one of {', '.join(RANKINGS)}; got {rank_by!r}")
    if rank_by == "inter-host" and not devices_per_host:
        raise ValueError("ranking by inter-host bytes needs --devices-per-host")
    if rank_by == "time" and timed is None:
        raise ValueError("--rank-by time needs a device profile (--device-profile NAME|FILE) to time each mesh")
    if job.user:  # the user's functions: every TP they take; PP too when they give the schedule's loss_fn
        limit = {"n_head": world_size}
        n_layer = _user_stages(job, world_size)
    elif job.llama3:  # TP up to the KV heads, PP up to the blocks
        cfg = config_of(job.model)
        limit, n_layer = {"n_head": cfg.n_kv_heads}, cfg.n_layers
    else:
        if not isinstance(job.model, str) or load_model(job.model).kind != "gpt":
            raise ValueError("searching needs the activations: give the GPT preset (--model gpt:...), or your model's "
                             "step (--step MODULE:FUNCTION, with --parallelize for TP, CP or EP)")
        model = load_model(job.model)
        limit, n_layer = dict(model.config), model.n_layer
    slots: list[MeshFit | tuple[list[Job], dict[str, int], MeshPlan]] = []  # in the order of the meshes
    for pp in divisors(world_size):
        for tp in divisors(world_size // pp):
            if (world_size // pp // tp) % cp:
                continue
            dp = world_size // pp // tp // cp
            degrees = {"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep}
            if tp > limit.get("n_head", 1) or pp > n_layer:
                continue  # not even a candidate: more TP ranks than heads, more stages than blocks
            reason = not_searched(job, degrees, dp_replicate)
            if reason is not None:
                slots.append(MeshFit(degrees, [], 0, 0, reason=reason))
                continue
            if not job.user and not job.llama3 and pp == 1 and device_memory is not None:  # a trace saved where the weights cannot fit
                over = static_over(job, device_memory, dp=dp // dp_replicate, tp=tp, cp=cp, ep=ep, degrees=degrees)
                if over is not None:
                    slots.append(over)
                    continue
            mesh = plan_mesh(world_size, pp=pp, dp=dp, cp=cp, tp=tp, ep=ep, dp_replicate=dp_replicate,
                             devices_per_host=devices_per_host)
            slots.append((variants(job, choose, job.global_batch_size // dp if job.global_batch_size % dp == 0 else 0),
                          degrees, mesh))
    tasks = [(slot[0], slot[1], device_memory, dp_replicate) for slot in slots if isinstance(slot, tuple)]
    # in processes, the PP meshes first, the longest pipelines first: a traced pipeline costs about its PP ranks
    planned = iter(run(_tried, tasks, jobs, cost=lambda task: task[1]["PP"]))
    fits, rejected = [], []
    for slot in slots:
        if isinstance(slot, MeshFit):
            rejected.append(slot)
            continue
        (tried, degrees, mesh), chosen, refusal = slot, None, None
        for index, fit in next(planned):
            if isinstance(fit, str):
                refusal = refusal or MeshFit(degrees, [], 0, 0, reason=fit)
                continue
            if device_memory is not None and fit.peak > device_memory:
                over = f"peak {gib(fit.peak)} > device memory {gib(device_memory)}"
                refusal = replace(fit, reason=over + (" with every micro-batch size and activation checkpointing "
                                                      "tried" if choose else ""))
                continue
            fit = _placed(fit, mesh, devices_per_host, timed)
            if choose:
                fit = replace(fit, activation_checkpointing=tried[index].activation_checkpointing)
            if chosen is None or (fit.step_time or 0) < (chosen.step_time or 0):
                chosen = fit
        if chosen is None:
            rejected.append(refusal)
        else:
            fits.append(chosen)
    keys = {"time": lambda f: (f.step_time, f.peak), "inter-host": lambda f: (f.slow_bytes, f.peak),
            "peak": lambda f: (f.peak, f.slow_bytes)}
    fits.sort(key=keys[rank_by])
    rejected.sort(key=lambda f: (f.peak if f.classes else math.inf))
    return fits, rejected


def _tried(tried: list[Job], degrees: dict[str, int], memory: int | None, hsdp: int) -> list[tuple[int, MeshFit | str]]:
    """One mesh of a search: each variant's plan, or the line that refuses it, by the variant's index; without PP up to
    the first that fits (the same FLOPs in fewer passes), with PP every one (more micro-batches shrink the bubble)."""
    out: list[tuple[int, MeshFit | str]] = []
    pp, dp, cp, tp, ep = (degrees[d] for d in ("PP", "DP", "CP", "TP", "EP"))
    for index, variant in enumerate(tried):
        try:
            fit = predict(variant, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, dp_replicate=hsdp)
        except ValueError as e:
            out.append((index, str(e)))
            continue
        out.append((index, fit))
        if pp == 1 and (memory is None or fit.peak <= memory):
            break
    return out


def _user_stages(job: Job, world_size: int) -> int:
    """The most PP ranks a search gives the user's functions: 1 without ``--loss`` (no pipeline to run), else the
    model's identical blocks when it has them (one a stage at least), else the world size (the functions refuse
    what they cannot cut, one line per mesh)."""
    if job.loss is None:
        return 1
    fns = UserFunctions.of(job.model, job.parallelize, job.step, job.loss, job.pp_schedule, job.before_optimizer)
    found = blocks_of(fns.factory, fns.names[0])
    return found[1] if found is not None else world_size


def _placed(fit: MeshFit, mesh: MeshPlan, devices_per_host: int | None,
            timed: Callable[[MeshFit, MeshPlan], list[Any]] | None) -> MeshFit:
    """``fit`` with its dims placed on the hosts (the best order) and, with a profile, timed."""
    if devices_per_host and mesh.world_size > devices_per_host:
        best, _ = place(fit, mesh, devices_per_host, timed)
        return replace(fit, slow_dims=best.crossing, slow_bytes=best.cross_bytes, order=best.order, times=best.times)
    if timed is not None:
        return replace(fit, times=tuple(timed(fit, mesh)))
    return fit


def speedups_of(job: Any, fit: Any) -> Any:
    """The job's switches (:class:`~vemesh.planning.speedups.Speedups`) for ``fit``: under Float8 the Llama 3 preset's
    output head stays bf16 on the rank class that holds it (torchtitan's rule), its TP all-gathers into the block
    Linears move Float8 under ``tensorwise`` (torchtitan's Float8 TP styles), and FSDP2's Float8 share of the
    gathered parameters is the preset's block Linear weights, or a user model's Linear weights but a head named
    ``output`` or ``lm_head``."""
    speed = job.speed
    if speed is None:
        return None
    if job.llama3:
        cfg, d = config_of(job.model), fit.degrees
        tokens = job.global_batch_size // d["DP"] * cfg.seq_len // d["CP"]
        head = 6 * tokens * cfg.dim * cfg.vocab_size // d["TP"]  # forward 2, backward 4 FLOPs a weight and token
        last = stage_owner(d["PP"] * stages_per_rank(job.pp_schedule) - 1, d["PP"], job.pp_schedule) if d["PP"] > 1 else 0
        bf16 = tuple(head if d["PP"] == 1 or i == last else 0 for i in range(len(fit.classes)))
        # the head's matmul per micro-batch, fed by a TP all-gather that stays bf16 (torchtitan's plain ColwiseParallel)
        fed = 2 * fit.micro_batch_size * (cfg.seq_len // d["CP"]) * cfg.dim * (cfg.vocab_size // d["TP"])
        return replace(speed, bf16_flops=bf16, float8_share=llama3_linear_share(cfg), bf16_fed=(fed,),
                       float8_tp_gathers=speed.float8 == "tensorwise" and d["TP"] > 1)
    if speed.float8 is not None and job.user:  # the function's mixed precision and wrapper, as its trace read them
        fns = UserFunctions.of(job.model, job.parallelize, job.step, job.loss, job.pp_schedule, job.before_optimizer)
        check_user_float8(speed, fit, job.dtype, fns.names[1])
        if speed.float8_all_gather:
            return replace(speed, float8_share=linear_share(template_of(fns), ("output", "lm_head")))
    return speed
