"""What ``vemesh plan --model`` prints: the tables of :mod:`vemesh.planning.fit` as text, and as JSON."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from vemesh.planning.request import OPTIMIZER_IMPLEMENTATIONS

if TYPE_CHECKING:  # torch is imported only when a model is planned: `vemesh show` starts fast
    from vemesh.planning.fit import Job, MeshFit

__all__ = ["HOW", "add_job_arguments", "fit_document", "render_fit",
           "render_search", "search_document"]

#: How each figure is obtained, put in the JSON: for the user's own functions (``--parallelize``, ``--step``) and
#: for the presets, which the same engine traces through their own functions
HOW = {
    "params, grads, optimizer": "held at the step peak by the model the parallelize function (yours, or the preset's) "
    "returned, on rank 0 of "
    "a fake world of the planned mesh: each parameter's local shard (a DTensor's, FSDP2's, an EP slice) and ZeRO-1's "
    "flat parameter buffer (the plain parameters are views of it; it holds a copy of the DTensor ones), the "
    "gradients the wrappers keep, the --optimizer state (ZeRO-1's shard and fp32 masters with --dp-mode zero1)",
    "activations": "everything else the step holds at the peak, traced on fake tensors under torch's MemTracker "
    "through warm-up and training steps (optimizer.step included); 8 or more identical blocks: 3 and 4 traced, the rest "
    "by difference, each part of the step on its own; with PP every PP rank through torch's schedule (3 and 4 blocks "
    "per stage traced)",
    "bytes": "every collective of a training step on the dispatcher (your TP, CP and EP ones; DDP's, ZeRO-1's, FSDP2's), "
    "by the mesh dim of its group; several micro-batches: 1 and 2 traced, the rest by difference. The size of each "
    "collective's tensor, as nccl-tests counts it",
    "not seen": "anything outside the step (data loading, evaluation, checkpoints); memory the allocator keeps besides "
    "tensors (fragmentation, CUDA context, nccl buffers); values (MoE routing is assumed, see the notes)",
}


def _unit(n: float) -> tuple[float, str]:
    return (2**30, "GiB") if n >= 2**30 else (2**20, "MiB")


def _class_row(c: Any) -> dict[str, Any]:
    s = c.static
    return {"name": c.name, "params": s.params, "grads": s.grads, "optimizer": s.optimizer, "masters": s.masters,
            "activations": c.activations, "buffers": c.extra, "peak": c.peak, "bytes_per_step": c.sent,
            "calls_per_step": {dim: sum(calls for _, calls in ops.values()) for dim, ops in sorted(c.collectives.items())}}


def _name(ref: Any) -> str | None:
    if ref is None or isinstance(ref, str):
        return ref
    return f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"


def _job_fields(job: Job) -> dict[str, Any]:
    """What the job trains with, as both documents give it (a mesh's own figures aside)."""
    return {"global_batch_size": job.global_batch_size, "dtype": job.dtype,
            "optimizer_implementation": job.optimizer_implementation or ("foreach" if job.device == "cuda" else "for-loop"),
            "moe_load_factor": job.moe_load_factor, "activation_checkpointing": job.activation_checkpointing,
            "speedups": ({**{k: getattr(job.speed, k) for k in ("compile", "float8", "float8_all_gather", "async_tp")},
                          "compiled_loss": job.compiled_loss} if job.speed else None)}


def _sync(job: Job, degrees: dict[str, int]) -> str:
    """Which micro-batches' backward averages the gradients over DP (under PP, torch's schedule's: the last)."""
    return "last" if degrees["PP"] > 1 else job.gradient_sync or ("each" if job.llama3 else "last")


def fit_document(job: Job, fit: MeshFit) -> dict[str, Any]:
    """The JSON of one mesh's prediction."""
    f = _job_fields(job)
    if f["speedups"] is not None:  # under TP the loss is vocabulary-parallel, traced eager
        f["speedups"]["compiled_loss"] = job.compiled_loss and fit.degrees["TP"] == 1
    return {"model": job.name, "parallelize": _name(job.parallelize), "step": _name(job.step), "degrees": fit.degrees,
            "global_batch_size": job.global_batch_size, "micro_batch_size": fit.micro_batch_size,
            "micro_batches": fit.micro_batches, "dtype": job.dtype, "gradient_sync": _sync(job, fit.degrees),
            "dp_mode": fit.dp_mode or job.mode, "optimizer_implementation": f["optimizer_implementation"],
            "moe_load_factor": job.moe_load_factor, "activation_checkpointing": job.activation_checkpointing,
            "speedups": f["speedups"], "pp_schedule": job.pp_schedule if fit.degrees["PP"] > 1 else None,
            "peak": fit.peak, "activations_traced": fit.traced, "notes": _notes(fit), "classes": [_class_row(c) for c in fit.classes],
            "how": HOW}


def search_document(job: Job, world_size: int, device_memory: int | None, devices_per_host: int | None,
                    rank_by: str, fits: list[MeshFit], rejected: list[MeshFit], dp_replicate: int = 1) -> dict[str, Any]:
    """The JSON of a search: the job, the meshes that fit, best first, and the rejected ones with their reasons.
    What depends on a mesh is each fit's own (its micro-batches, DP mode, gradient sync, PP schedule and, where the
    search chose it, activation checkpointing)."""
    return {"model": job.name, "parallelize": _name(job.parallelize), "step": _name(job.step), "world_size": world_size, "device_memory": device_memory,
            "devices_per_host": devices_per_host, "ranked_by": rank_by, "dp_replicate": dp_replicate, **_job_fields(job),
            "fits": [{"degrees": f.degrees, "order": list(f.order), "peak": f.peak,
                      "inter_host_bytes_per_step": f.slow_bytes,
                      "inter_host_dims": list(f.slow_dims), "micro_batch_size": f.micro_batch_size,
                      "micro_batches": f.micro_batches, "dp_mode": f.dp_mode or job.mode,
                      "gradient_sync": _sync(job, f.degrees),
                      "pp_schedule": job.pp_schedule if f.degrees["PP"] > 1 else None,
                      **({"activation_checkpointing": f.activation_checkpointing}
                         if f.activation_checkpointing is not None else {}),
                      "classes": [_class_row(c) for c in f.classes]} for f in fits],
            "rejected": [{"degrees": f.degrees, "reason": f.reason} for f in rejected],
            "how": HOW}


def _ac_text(job: Job) -> str:
    ac = job.activation_checkpointing
    return "" if ac in (False, "none") else ", activation checkpointing" + (f" {ac}" if isinstance(ac, str) else "")


def _switches(job: Job, tp: int | None) -> str:
    """The job's speed switches, as its line says them (``tp``: the mesh's TP; None: a search's meshes, every TP)."""
    speed = job.speed
    if speed is None:
        return ""
    loss = {1: " (the loss too)", None: " (the loss too; under TP traced eager)"}.get(tp, " (the loss under TP: "
                                                                                          "traced eager)")
    on = [n for n, v in (("compile" + (loss if job.compiled_loss else ""), speed.compile),
                         (f"float8 {speed.float8}", speed.float8), ("float8 all-gather", speed.float8_all_gather),
                         ("async TP", speed.async_tp)) if v]
    return (f"; timed with {', '.join(on)}" if job.timed else f"; with {', '.join(on)}") if on else ""


def render_fit(job: Job, fit: MeshFit) -> str:
    """One mesh's tables: memory per rank class, bytes per dim per step."""
    div, unit = _unit(fit.peak)
    d = fit.degrees
    per_dp = job.global_batch_size // d["DP"]
    item = "sample" if job.user else "sequence"  # a user's model may be of images; the presets take sequences
    batch = f"; global batch {job.global_batch_size}, {per_dp} {item}{'s' if per_dp != 1 else ''} per DP rank in " \
        f"{fit.micro_batches} micro-batch{'es' if fit.micro_batches > 1 else ''} of {fit.micro_batch_size}" \
        if fit.traced else ""
    given = f", AdamW {job.optimizer_implementation}" if job.optimizer_implementation else ""
    lines = [f"job: {job.name}, {job.dtype}, {fit.dp_mode or job.mode}" + given + _ac_text(job) + batch
             + (f", {job.pp_schedule}" if d["PP"] > 1 else "") + _switches(job, d["TP"]),
             f"memory per rank ({unit}):" if fit.traced else f"static memory per rank ({unit}); ACTIVATIONS ARE NOT "
             "INCLUDED: give your step (--step MODULE:FUNCTION) and the planner traces them:"]
    buffers = any(c.extra for c in fit.classes)
    head = ["params", "grads", "optimizer", "masters", "activations"] + (["buffers"] if buffers else []) \
        + ["peak" if fit.traced else "static"]
    width = max(12, *(len(c.name) + 2 for c in fit.classes))
    lines.append(f"  {'':{width}}" + "".join(f"{h:>12}" for h in head))
    for c in fit.classes:
        s = c.static
        values = [s.params, s.grads, s.optimizer, s.masters, c.activations] \
            + ([c.extra] if buffers else []) + [c.peak]
        cells = [f"{v / div:12.2f}" for v in values]
        if not fit.traced:
            cells[4] = f"{'-':>12}"
        lines.append(f"  {c.name:{width}}" + "".join(cells))
    if (fit.dp_mode or job.mode) == "zero1" and d["DP"] > 1:
        lines.append("  (ZeRO-1: params is the whole TP shard on every DP rank, with ZeRO-1's flat parameter buffer, "
                     "which holds a second copy of DTensor parameters; the optimizer's state and the fp32 masters are "
                     "split over DP)")
    if (fit.dp_mode or job.mode) == "fsdp" and fit.traced and d["DP"] > 1 and any(not c.static.grads for c in fit.classes):
        from vemesh.planning.user_notes import fsdp_reduces_whole  # here: building a request imports no torch

        whole = all(fsdp_reduces_whole(c.collectives) for c in fit.classes)
        lines.append("  (FSDP2: each column is what the rank holds at its peak; grads are the "
                     + ("whole gradients FSDP2's all-reduces make (torch's replicate_with_fsdp)" if whole else
                        "sharded gradients FSDP2's reduce-scatters make")
                     + ", none yet at the peak (zero_grad() freed the last step's); the "
                     + ("unreduced" if whole else "unsharded") + " ones before them count in activations)")
    dims = sorted({k for c in fit.classes for k in c.sent})
    if dims:
        sdiv, sunit = _unit(max(max(c.sent.values(), default=0) for c in fit.classes))
        lines.append(f"bytes each rank's collectives move per step, by mesh dim ({sunit}):")
        cols = [max(12, len(k) + 2) for k in dims]  # dp_replicate is 12 letters: a column wider than its name
        lines.append(f"  {'':{width}}" + "".join(f"{k:>{n}}" for k, n in zip(dims, cols)))
        for c in fit.classes:
            lines.append(f"  {c.name:{width}}" + "".join(f"{c.sent.get(k, 0) / sdiv:{n}.2f}" for k, n in zip(dims, cols)))
    else:
        lines.append("no collectives: a single rank")
    lines.extend(f"note: {n}" for n in _notes(fit))
    return "\n".join(lines)


def render_search(job: Job, world_size: int, device_memory: int | None, devices_per_host: int | None,
                  rank_by: str, fits: list[MeshFit], rejected: list[MeshFit], top: int = 10, dp_replicate: int = 1) -> str:
    """The meshes that fit, ranked, and why the others do not; with ``dp_replicate``, each mesh's DP split for HSDP."""
    cost = {"time": "the shortest predicted step, each mesh's dims placed on the hosts",
            "inter-host": "the fewest bytes a rank sends per step between hosts, then the lowest peak"}.get(
        rank_by, "the lowest peak per rank")
    memory = (f", {device_memory / 2**30:.1f} GiB per device" if device_memory >= 2**30 else
              f", {device_memory / 2**20:.1f} MiB per device") if device_memory else ""
    hosts = f", {devices_per_host} devices per host" if devices_per_host else ""
    chosen = any(f.activation_checkpointing is not None for f in fits)  # --choose: each mesh's own mbs and AC
    unplanned = [f for f in rejected if f.not_planned]
    rejected = [f for f in rejected if not f.not_planned]
    lines = [f"plan: {job.name}" + (f" through {_name(job.parallelize)}" if job.parallelize else ""),
             f"  {world_size} ranks{memory}{hosts}; global batch {job.global_batch_size}, "
             + ("each mesh's own micro-batch (the mbs column), " if chosen else
                f"micro-batch {job.micro_batch_size} (--micro-batch-size B sets it), " if job.micro_batch_size else
                "micro-batches of 2 x PP per DP rank, ")
             + f"{job.dtype}, {job.dp_mode or ('as the function applies' if job.user else 'zero1')}"
             + ("" if chosen else _ac_text(job)) + _switches(job, None)
             + (f", HSDP: each DP split into dp_replicate {dp_replicate} x dp_shard DP / {dp_replicate}"
                if dp_replicate > 1 else "") + f"; ranked by {cost}",
             f"{len(fits) + len(rejected) + len(unplanned)} meshes considered (" + _considered(job, world_size) + ")"
             + f"; {len(fits)} fit" + (f" of the {len(fits) + len(rejected)} planned ({len(unplanned)} with PP left "
                                        "out: see below)" if unplanned else "")
             + (f"; the best {min(top, len(fits))}:" if fits else "")]
    timed = any(f.times for f in fits)
    if fits:
        lines.append(f"  {'#':>3}  {'mesh (outermost first)':28} " + ("  mbs  AC  " if chosen else "")
                     + f"{'peak':>10}  {'between hosts':>15}  "
                     + ("  step time  exposed comm  " if timed else "") + "dims between hosts")
    for i, f in enumerate(fits[:top], 1):
        when = ""
        if timed:
            slowest = max(f.times, key=lambda t: t.total)
            when = f"{_ms(slowest.total):>11} {_ms(slowest.exposed):>13}  "
        choice = f"{f.micro_batch_size:>5}  {'on' if f.activation_checkpointing else 'off':>3} " if chosen else ""
        lines.append(f"  {i:>3}  {f.shape():28} {choice}{_size(f.peak, 1):>10}  {_size(f.slow_bytes, 2):>15}  {when}"
                     f"{', '.join(f.slow_dims) or '-'}")
    if timed and len(fits) > 1:
        lines.extend(_why_slower(fits[0], fits[1:top]))
    piped = any(f.degrees["PP"] > 1 for f in fits[:top]) and not job.user
    if piped:
        lines.append("PP meshes traced through torch's schedule, as --pp N plans each (--trace-pp)")
    if rejected:
        lines.append(f"{len(rejected)} mesh{'es' if len(rejected) != 1 else ''} rejected:")
        lines.extend(f"  {f.shape():28} {f.reason}" for f in rejected)
    if unplanned:
        degrees = sorted({f.degrees["PP"] for f in unplanned})
        lines.append(f"{len(unplanned)} mesh{'es' if len(unplanned) != 1 else ''} with PP {', '.join(map(str, degrees))} "
                     f"not planned: {unplanned[0].reason.split(': ', 1)[1]}"
                     .replace(f"plan it with --pp {unplanned[0].degrees['PP']}", "plan one with --pp N"))
    if not fits and device_memory:
        lines.append(_none_fit(job, rejected + unplanned))
    return "\n".join(lines)


def _none_fit(job: Any, rejected: list[MeshFit]) -> str:
    """What a search in which no mesh fits can be asked again with, from what it was asked: each switch that lowers
    a mesh's peak and was not given, and the PP meshes it left out."""
    tries = []
    ac = job.activation_checkpointing
    if ac in (False, "none") and not job.user:
        tries.append("--activation-checkpointing " + ("full or selective-op" if job.llama3 else "full"))
    if (job.micro_batch_size or 1) > 1:
        tries.append(f"a --micro-batch-size below {job.micro_batch_size}")
    if not job.user and job.mode in ("ddp", "zero1"):
        tries.append("--dp-mode fsdp (FSDP2 shards the parameters and gradients too)")
    unplanned = sum(f.not_planned for f in rejected)
    if unplanned:
        tries.append(f"--trace-pp, which plans the {unplanned} PP mesh{'es' if unplanned != 1 else ''} left out")
    best = min((f for f in rejected if f.classes and f.traced), key=lambda f: f.peak, default=None)
    lowest = (f"of the meshes traced, the lowest peak is {best.shape()}'s, {_size(best.peak, 1)}" if best is not None
              else "no mesh was traced")
    return f"none fits: {lowest}" + (f"; search again with {'; or '.join(tries)}" if tries else "")


def _considered(job: Any, world_size: int) -> str:
    """Which meshes a search tried, in words."""
    if not job.user:
        return f"PP x DP x CP x TP = {world_size}, TP up to the heads, PP up to the blocks"
    if job.loss is None:
        return f"DP x CP x TP = {world_size}, every TP; your functions refuse what they cannot run; PP with --loss"
    return (f"PP x DP x CP x TP = {world_size}, every TP, PP up to the blocks, {job.pp_schedule} with PP; your functions "
            "refuse what they cannot run")


def _why_slower(best: MeshFit, others: list[MeshFit]) -> list[str]:
    """One line per runner-up: the part of its step that costs it the most against the best mesh, and, where that part
    alone is more than the whole difference, the part that gains it the most back (it read "+0.02ms, most of it DP
    exposed (+0.78ms)", where TP's exposed time was 0.76 ms less)."""
    first = max(best.times, key=lambda t: t.total)
    lines = [f"why the others are slower than {best.shape()} ({_ms(first.total)}):"]
    for f in others:
        t = max(f.times, key=lambda x: x.total)
        parts = {"compute": t.compute - first.compute, "optimizer": t.optimizer - first.optimizer,
                 "the PP bubble": t.bubble - first.bubble,
                 **{f"{d} exposed": (t.dims[d].exposed if d in t.dims else 0.0)
                    - (first.dims[d].exposed if d in first.dims else 0.0) for d in {**first.dims, **t.dims}}}
        part, extra = max(parts.items(), key=lambda kv: kv[1])
        diff = t.total - first.total
        if extra > diff * 1.01:  # another part is less on this mesh
            back, less = min(parts.items(), key=lambda kv: kv[1])
            why = f": {part} +{_ms(extra)}, {back} -{_ms(-less)}"
        else:
            why = f", {'most of it' if 2 * extra >= diff else 'the largest part'} {part} (+{_ms(extra)})"
        lines.append(f"  {f.shape():28} +{_ms(diff)}{why}")
    return lines


def _ms(seconds: float) -> str:
    """Seconds as milliseconds, to 3 significant places below 10 ms: ``1.62ms``, ``11107.4ms``."""
    ms = seconds * 1e3
    return f"{ms:.2f}ms" if abs(ms) < 10 else f"{ms:.1f}ms"


def _size(n: float, places: int) -> str:
    """Bytes in GiB, or MiB under one GiB."""
    return f"{n / 2**30:.{places}f}GiB" if n >= 2**30 else f"{n / 2**20:.{places}f}MiB"


def add_job_arguments(plan: argparse.ArgumentParser, positive: Callable[[str], int]) -> None:
    """The ``vemesh plan`` flags that describe a job (``--model`` and what goes with it)."""
    job = plan.add_argument_group(
        "will it fit? (with --model: memory per rank and bytes per dim; with --device-memory and no --pp/--tp/--dp: "
        "every mesh of the world size that fits, ranked)")
    job.add_argument("--model", metavar="SPEC", help="gpt:n_layer=N,n_embd=N,n_head=N[,vocab=N,seq_len=N] (the GPT "
                     "preset), llama3:8b|70b|405b[,seq_len=N] (Llama 3.1's shapes, torchtitan's parallelization, "
                     "FSDP2 by default), or module:MODULE:FACTORY, your own model (MODULE: a dotted module importable from the "
                     "current directory, or a file path such as ./mymodel.py); without --step, static memory only")
    job.add_argument("--parallelize", metavar="MODULE:FUNCTION", help="your parallelize function, FUNCTION(model, "
                     "mesh) -> model (with --pp: this rank's torch PipelineStages), run on VESCALE_DEVICE_MESH built for the "
                     "planned mesh on torch's fake backend (default: the data parallelism --dp-mode names, and "
                     "nothing else)")
    job.add_argument("--step", metavar="MODULE:FUNCTION", help="your step, FUNCTION(model, micro_batch_size): one "
                     "forward and backward of a micro-batch on tensors it makes, run on fake tensors (with --pp: "
                     "FUNCTION(schedule, batch_size), one schedule.step(...) of a DP rank's batch)")
    job.add_argument("--moe-load-factor", metavar="F", help="MoE: the busiest EP rank receives F x the balanced "
                     "share of the slots (default: 1, balanced; a run's measured expert_load is its own F)")
    job.add_argument("--global-batch-size", type=positive, metavar="N", help="samples per step: sequences, for the presets (default: 32)")
    job.add_argument("--dtype", choices=("fp32", "bf16"),
                     help="the model's dtype: a preset computes in it, your own model is converted to it before your "
                          "function; the step is timed in the dtype its matmuls ran in (FSDP2's MixedPrecisionPolicy, "
                          "autocast) (default: fp32)")
    job.add_argument("--optimizer", choices=("adamw",), default="adamw", help="the optimizer (AdamW's two moments)")
    job.add_argument("--optimizer-implementation", choices=OPTIMIZER_IMPLEMENTATIONS, help="how AdamW steps, as "
                     "torchtitan's optimizer.implementation names it: torch's loop over tensors (foreach=False), its "
                     "foreach kernels, or its fused kernel (default: as torch picks on the device: foreach on a GPU, "
                     "the loop on cpu)")
    job.add_argument("--gradient-sync", metavar="last|each", help="with several micro-batches a step: the last "
                     "micro-batch's backward averages the gradients over DP (no_sync or FSDP2's "
                     "set_requires_gradient_sync(False) on the others; your functions' default), or each one's "
                     "(torchtitan's loop; FSDP2 then reduce-scatters every micro-batch and holds no unsharded gradient "
                     "between them)")
    job.add_argument("--dp-mode", choices=("ddp", "zero1", "fsdp"),
                     help="vemesh DDP + AdamW, + the ZeRO-1 DistributedOptimizer, or torch's FSDP2 (default: zero1)")
    job.add_argument("--micro-batch-size", type=positive, metavar="N",
                     help="sequences per forward on a DP rank (default: the whole share; with PP 2 x PP micro-batches "
                     "where they divide it, else the fewest of at least PP; 1 when searching)")
    job.add_argument("--pp-schedule", metavar="NAME", help="torch's pipeline schedule: gpipe, 1f1b, interleaved-1f1b, "
                     "interleaved-zb, zbv or dualpipev (default: 1f1b)")
    job.add_argument("--loss", metavar="MODULE:FUNCTION", help="with --pp and your functions: loss_fn(output, target), "
                     "as torch's schedule takes it (your --parallelize returns the PipelineStages, your --step gets "
                     "the schedule and the batch size); in a search, PP meshes are tried too")
    job.add_argument("--before-optimizer", metavar="MODULE:FUNCTION", help="with your functions: FUNCTION(model) "
                     "after the last micro-batch's backward and before optimizer.step(), on what --parallelize "
                     "returned: your loop's clip_grad_norm_, its all-reduce of the loss (timed and counted in the step)")
    job.add_argument("--sequence-parallel", action="store_true", help="TP with sequence parallelism")
    job.add_argument("--activation-checkpointing", nargs="?", const="full", default=False, metavar="MODE",
                     help="none, full (the bare flag: recompute each block in backward, keeping only its input), and "
                     "for the Llama 3 preset selective-op (torchtitan's per-op policy: keep the matmuls' and "
                     "attention's outputs, but every second matmul's) or selective-N (every N-th block full)")
    speed = plan.add_argument_group("what GPU users turn on, modelled on the traced step's time (needs --device-profile)")
    speed.add_argument("--compile", nargs="?", const=True, default=False, metavar="model[,loss]", help="torch.compile: "
                       "the pointwise ops and the reductions beside them fuse into one kernel per run, paying only the "
                       "bytes that leave it; for the Llama 3 preset the bare flag also compiles the loss, as torchtitan "
                       "does (model,loss; model: the blocks alone), which holds no fp32 logits")
    speed.add_argument("--float8", choices=("tensorwise", "rowwise"), help="torchao's Float8 training: the Linear "
                       "matmuls (not the output head) at the profile's fp8 rate, their casts and scales paid in bytes "
                       "(needs --dtype bf16)")
    speed.add_argument("--float8-all-gather", action="store_true", help="FSDP2 gathers the Float8 weights in 1 byte "
                       "an element")
    speed.add_argument("--async-tp", action="store_true", help="each TP all-gather or reduce-scatter that torch's "
                       "micro-pipeline pass fuses with its matmuls runs under them; the rest is exposed")
    job.add_argument("--device-memory", metavar="SIZE", help="memory per device, with a unit: 80GiB, 24GB")
    job.add_argument("--choose", metavar="WHAT", help="a search by time chooses these for each mesh too, the fastest "
                     "that fits: micro-batch-size (the largest that fits without PP; every size with PP, whose "
                     "bubble shrinks with more micro-batches), activation-checkpointing (the GPT preset: on only "
                     "where nothing fits without it); comma-separated")
    job.add_argument("--trace-pp", action="store_true", help="a search traces each PP mesh through torch's "
                     "schedule, as --pp N plans it (seconds to minutes a mesh), where otherwise a preset's PP meshes are "
                     "left out, each named with the --pp N that plans it (your own functions' are always traced)")
    job.add_argument("--jobs", type=int, metavar="N", help="a search plans its meshes in N processes at once, "
                     "each mesh in one (default 1): on N free cores a search whose meshes are traced (--trace-pp, your own "
                     "functions' PP meshes) takes about 1/N of the time")
    job.add_argument("--rank-by", choices=("time", "inter-host", "peak"),
                     help="search order: the predicted step time (needs --device-profile), the bytes between hosts, "
                     "or the peak (default: time with --device-profile, else inter-host with --devices-per-host, "
                     "else peak)")
    job.add_argument("--device-profile", metavar="NAME|FILE", help="predict the step time on this device: a built-in "
                     "profile (a100-sxm-80gb, h100-sxm, h200-sxm, h100-hbm2e-500w: published specifications) or a JSON file "
                     "(vemesh calibrate --output FILE measures this machine); with --devices-per-host placing the "
                     "mesh on hosts (default: the profile's)")


def _notes(fit: MeshFit) -> list[str]:
    """``fit``'s notes, a memory leak first (its figures are of one step, and the run's grow past them)."""
    return sorted(fit.notes, key=lambda n: not n.startswith("MEMORY LEAK"))
