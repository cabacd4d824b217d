"""``vemesh.planning.plan``: will it fit, from Python. The same figures as ``vemesh plan --model ... --json``.

>>> from vemesh.planning import PlanRequest, plan                     # doctest: +SKIP
>>> doc = plan(PlanRequest(world_size=8, model=make, parallelize=parallelize, step=step, tp=2, global_batch_size=16))
>>> doc["peak"], doc["classes"][0]["bytes_per_step"]                  # doctest: +SKIP
(30012416, {'DP': 23371776, 'TP': 11010048})

The question is one :class:`~vemesh.planning.request.PlanRequest`, the value ``vemesh plan`` builds from its flags;
``plan(model, world_size=8, tp=2, ...)`` builds it from keywords. Give the degrees for one mesh; give
``device_memory`` and no ``pp``/``dp``/``tp`` for every mesh of ``world_size`` that fits, ranked (the JSON of
``vemesh plan`` searching). Bad values raise ``ValueError`` with the line ``vemesh plan`` prints.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, replace
from typing import Any

from vemesh.layout.data_dims import data_dims
from vemesh.layout.describe import link_of
from vemesh.layout.names import divisors, listed
from vemesh.planning.fit_report import fit_document, search_document
from vemesh.planning.mesh_plan import MeshPlan, plan_mesh
from vemesh.planning.placement import Placement, place
from vemesh.planning.profiles import DeviceProfile, load_profile
from vemesh.planning.request import PlanRequest
from vemesh.planning.step_time import WORLD, StepTime, step_time

__all__ = ["Answer", "answer", "hosts_of", "mesh_of", "model_document", "plan", "verdict", "whole_hosts"]


def plan(request: PlanRequest | Any = None, /, **fields: Any) -> dict[str, Any]:
    """The prediction for one mesh, or the ranked search, as the dict ``vemesh plan --json`` prints.

    ``request`` is a :class:`PlanRequest`, or the model (also as ``model=``, the flag's name) with the request's
    other fields as keywords.
    """
    if "model" in fields and not isinstance(request, PlanRequest):
        if request is not None:
            raise TypeError(f"plan() got the model twice: {request!r} and model={fields['model']!r}; give one")
        request = fields.pop("model")
    if isinstance(request, PlanRequest):
        if fields:
            raise TypeError(f"plan(PlanRequest(...)) takes no other arguments; got {', '.join(sorted(fields))} "
                            "(set them on the request)")
    else:
        known = {f.name for f in dataclasses.fields(PlanRequest)} - {"model"}
        for name in sorted(set(fields) - known):  # TypeError, as Python's for an unknown keyword, with the choices
            close = difflib.get_close_matches(name, sorted(known), n=1)
            raise TypeError(f"plan() got an unknown argument {name!r}"
                            + (f"; did you mean {close[0]!r}?" if close else "")
                            + f" (the arguments are vemesh plan's flags: {', '.join(sorted(known))})")
        request = PlanRequest(model=request, **fields)
    return answer(request).document()


@dataclass(frozen=True)
class Answer:
    """The planner's answer to a request with a model: one mesh's fit, or the search's fits and rejections."""

    request: PlanRequest
    job: Any  #: :class:`~vemesh.planning.fit.Job`
    device_memory: int | None
    mesh: MeshPlan | None = None  #: one mesh
    fit: Any = None  #: :class:`~vemesh.planning.results.MeshFit` of that mesh
    fits: tuple[Any, ...] = ()  #: the search: the meshes that fit, best first
    rejected: tuple[Any, ...] = ()  #: the search: the meshes that do not, with why
    times: tuple[Any, ...] = ()  #: with a device profile: each rank class's StepTime (vemesh.planning.step_time)
    profile: Any = None  #: the DeviceProfile the times are on
    placement: Placement | None = None  #: with hosts (--devices-per-host or the profile's): the chosen dim order
    baselines: dict[str, Placement] | None = None  #: torchtitan's order and the chosen one reversed

    def document(self) -> dict[str, Any]:
        """What ``vemesh plan --json`` prints."""
        r = self.request
        if self.mesh is None:
            doc = search_document(self.job, r.world_size, self.device_memory, r.devices_per_host, r.order,
                                  list(self.fits), list(self.rejected), dp_replicate=r.dp_replicate)
            if self.profile is not None:
                for row, f in zip(doc["fits"], self.fits):
                    row.update(time_document(f.times, self.profile, f, self.job))
            return doc
        doc = model_document(self.job, self.mesh, self.fit, self.device_memory)
        if self.profile is not None:
            doc.update(time_document(self.times, self.profile, self.fit, self.job))
        if self.placement is not None:
            doc["placement"] = dict(self.placement.document(), devices_per_host=self.mesh.devices_per_host,
                                    baselines={k: p.document() for k, p in (self.baselines or {}).items()})
        return doc


def answer(request: PlanRequest) -> Answer:
    """Plan ``request`` (which names a model): the search when it :attr:`~PlanRequest.searches`, else one mesh."""
    from vemesh.planning.fit import predict, search, speedups_of  # torch: planning traces the model
    from vemesh.planning.user_template import forget_models  # torch, as above

    forget_models()  # this plan builds the user's model afresh: nothing from an earlier plan can be stale
    if request.model is None:
        raise ValueError("a plan of memory and bytes needs a model (--model gpt:... or module:MODULE:FACTORY)")
    job, memory = request.job(), request.memory()
    profile = load_profile(request.device_profile) if request.device_profile is not None else None
    # a GPU (a queued profile's; without one, any --device-type but cpu): its optimizer as torch runs it there, foreach
    # over whole tensors, whose temporaries a CPU's per-tensor loop never holds at once (a memory-only plan of a cuda
    # job planned the CPU's: 12.4 GiB for 13.9 under vemesh DDP, docs/planning.md)
    if profile.queued if profile is not None else request.device_type != "cpu":
        job = replace(job, device="cuda")
    if request.searches:
        per_host = request.devices_per_host or (profile.devices_per_host if profile is not None else None)
        if per_host:
            whole_hosts(request.world_size, per_host)  # before any trace: a placement that cannot be is said at once
        timed = (lambda f, m: time_of(f, m, profile, job, speedups_of)) if profile is not None else None
        fits, rejected = search(job, request.world_size, device_memory=memory, devices_per_host=per_host,
                                cp=request.cp, ep=request.ep, rank_by=request.order, timed=timed,
                                choose=request.choices, jobs=request.jobs or 1, dp_replicate=request.dp_replicate)
        return Answer(request, job, memory, fits=tuple(fits), rejected=tuple(rejected), profile=profile)
    mesh = mesh_of(request, profile.devices_per_host if profile is not None else None)
    if profile is not None or mesh.devices_per_host:
        hosts_of(mesh, profile)  # before the trace: a placement that cannot be is said at once
    d = mesh.degrees
    fit = predict(job, dp=d["DP"], tp=d["TP"], pp=d["PP"], cp=d["CP"], ep=mesh.ep, dp_replicate=request.dp_replicate)
    timed = (lambda f, m: time_of(f, m, profile, job, speedups_of)) if profile is not None else None
    if mesh.devices_per_host and mesh.world_size > mesh.devices_per_host:  # hosts: choose the order of the dims
        best, baselines = place(fit, mesh, mesh.devices_per_host, timed)
        return Answer(request, job, memory, mesh=best.mesh, fit=fit, times=best.times, profile=profile,
                      placement=best, baselines=baselines)
    if timed is None:
        return Answer(request, job, memory, mesh=mesh, fit=fit)
    return Answer(request, job, memory, mesh=mesh, fit=fit, times=tuple(timed(fit, mesh)), profile=profile)


def hosts_of(mesh: MeshPlan, profile: DeviceProfile | None = None) -> int:
    """Ranks per host (``--devices-per-host``, else the profile's, else one host), checked to fill whole hosts."""
    return whole_hosts(mesh.world_size, mesh.devices_per_host or (profile.devices_per_host if profile else mesh.world_size))


def whole_hosts(world: int, per_host: int) -> int:
    """``per_host``, checked to place ``world`` ranks on whole hosts (or on part of one); else one line naming it."""
    if world > per_host and world % per_host:
        choices = listed(divisors(world), 64)
        raise ValueError(f"--devices-per-host {per_host} does not divide the world size {world}, so the mesh cannot be "
                         f"placed on whole hosts; choose one of {choices}")
    return per_host


def time_of(fit: Any, mesh: MeshPlan, profile: DeviceProfile, job: Any, speed_of: Any = None) -> list[StepTime]:
    """Each rank class's step time on ``profile``, the mesh placed on hosts of ``mesh.devices_per_host`` ranks;
    ``speed_of(job, fit)`` gives the job's switches (:func:`vemesh.planning.fit.speedups_of`)."""
    layout, per_host = mesh.layout, hosts_of(mesh, profile)
    found = data_dims(layout)
    # the dims gradients are averaged over: the data dim, HSDP's replica and shard dims (FSDP2's 2-D mesh), EDP
    grad = tuple(dict.fromkeys(n for n in (found.grad, *found.fsdp, *(("EDP",) if found.expert else ())) if n))
    used = {dim for c in fit.classes for dim in c.collectives}
    sizes, links = {}, {}
    for dim in used:
        if dim != WORLD and (dim == "other" or not layout.has(dim)):
            raise ValueError(f"the step ran collectives on a group that is no mesh dim ({dim}); the time model times "
                             "each collective by its mesh dim's link")
        dims = layout.dim_names if dim == WORLD else dim  # the default group: every rank, all the dims at once
        sizes[dim] = layout.world_size if dim == WORLD else layout.group_size(dim)
        links[dim] = link_of(layout, dims, per_host, profile.hosts_per_rack)
    return step_time(fit, profile, dtype=job.dtype, dp_mode=fit.dp_mode or job.mode, grad_dims=grad, sizes=sizes,
                     links=links, speed=speed_of(job, fit) if speed_of is not None else None)


def time_document(times: tuple[StepTime, ...], profile: DeviceProfile, fit: Any, job: Any) -> dict[str, Any]:
    """The JSON of a step-time prediction: the slowest class's seconds at the top, every class's parts."""
    slowest = max(times, key=lambda t: t.total)
    world = fit.degrees["PP"] * fit.degrees["DP"] * fit.degrees["CP"] * fit.degrees["TP"]
    flops = sum(c.flops for c in fit.classes) / len(fit.classes)
    return {
        "step_time": slowest.total,
        "device_profile": {"name": profile.name, "measured": profile.measured, "sources": profile.sources,
                           "assumptions": profile.assumptions},
        "time": _time_parts(slowest),
        "sequences_per_second_per_device": job.global_batch_size / slowest.total / world,
        # of the peak of the dtype the step's matmuls ran in (FSDP2's mixed precision: bf16 over fp32 parameters)
        "mfu": flops / slowest.total / profile.flops(slowest.dtype or job.dtype),
        "time_by_class": [dict(name=t.name, step_time=t.total, **_time_parts(t)) for t in times],
    }


def _time_parts(t: StepTime) -> dict[str, Any]:
    return {"compute": t.compute, "compute_dtype": t.dtype, "compute_fp8_share": t.fp8_share,
            "host_bound_device_work": t.device,
            "optimizer": t.optimizer, "bubble": t.bubble,
            "exposed_communication": t.exposed,
            "communication": {d: {"link": x.link, "seconds": x.seconds, "hidden": x.hidden, "exposed": x.exposed}
                              for d, x in t.dims.items()}}


def mesh_of(request: PlanRequest, devices_per_host: int | None = None) -> MeshPlan:
    """The one mesh of ``request``'s degrees (PP and TP 1 when not given), on hosts of ``request.devices_per_host``
    ranks (else ``devices_per_host``)."""
    return plan_mesh(request.world_size, pp=request.pp or 1, dp=request.dp, cp=request.cp, tp=request.tp or 1,
                     ep=request.ep, dp_replicate=request.dp_replicate,
                     devices_per_host=request.devices_per_host or devices_per_host, device_type=request.device_type)


def verdict(fit: Any, device_memory: int | None) -> str | None:
    """``"fits"`` / ``"does not fit"`` against ``device_memory`` (None without one); static-only plans say so."""
    if device_memory is None:
        return None
    if fit.traced:
        return "fits" if fit.peak <= device_memory else "does not fit"
    return "the static memory alone fits" if fit.peak <= device_memory else "does not fit"


def model_document(job: Any, mesh: MeshPlan, fit: Any, device_memory: int | None) -> dict[str, Any]:
    """The JSON of one mesh's prediction, with the mesh's lines to paste and the verdict."""
    doc = fit_document(job, fit)
    doc.update({"world_size": mesh.world_size, "init_device_mesh": mesh.init_call(), "flatten": mesh.flatten_calls()})
    said = verdict(fit, device_memory)
    if said:
        doc.update({"device_memory": device_memory, "fits": said == "fits"})
    return doc
