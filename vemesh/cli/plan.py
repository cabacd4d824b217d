"""``vemesh plan``: fill in the missing degree and print the mesh; with ``--model``, will it fit.

Exit status: 1 when ``--device-memory`` is given and the answer is no (the planned mesh does not fit; in a search, no
mesh does), so that ``vemesh plan ... && torchrun ...`` launches only what fits; else 0 (2 on bad input).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shlex
import sys
from collections.abc import Iterator
from dataclasses import fields, replace
from typing import Any

from vemesh.cli.common import UsageError, check_rank, check_world, degree, positive, print_json, print_warnings
from vemesh.layout.describe import WIDTH, describe_layout, layout_document
from vemesh.layout.spec import VALID_DEVICE_TYPES
from vemesh.planning.api import Answer, answer, mesh_of, verdict
from vemesh.planning.fit_report import add_job_arguments, render_fit, render_search
from vemesh.planning.mesh_plan import MeshPlan
from vemesh.planning.placement import render as render_placement
from vemesh.planning.request import PlanRequest
from vemesh.planning.step_time import render as render_time


def add_plan(commands: Any) -> argparse.ArgumentParser:
    plan = commands.add_parser(
        "plan", help="fill in the missing degree and print the init_device_mesh call; with --model, each rank's "
        "peak memory and step time, or a search of every mesh (--device-memory)",
        description="Fill in the one missing degree (DP unless another is 'auto'), check the layout, "
        "and print the init_device_mesh(...) call. Dims run PP, DP, CP, TP (outermost first); "
        "dims of size 1 are left out. With --model (a preset, or your own factory with --parallelize and --step), "
        "trace one step on a fake world and predict each rank's peak memory, and with --device-profile its step "
        "time; with --device-memory and no degrees, plan every mesh of the world size and rank those that fit.",
    )
    plan.add_argument("--world-size", type=positive, required=True, metavar="N", help="total number of ranks")
    for name, default in (("pp", 1), ("dp", None), ("cp", 1), ("tp", 1)):
        plan.add_argument(f"--{name}", type=degree, default=1 if name == "cp" else None, metavar="N",
                          help=f"{name.upper()} degree or 'auto' (default: "
                          + ("auto, or 1 when another degree is auto)" if default is None else f"{default})"))
    plan.add_argument("--ep", type=positive, default=1, metavar="N",
                      help="expert-parallel degree; reuses the DP x CP ranks, so it must divide DP x CP (default: 1)")
    plan.add_argument("--dp-replicate", type=positive, default=1, metavar="N",
                      help="split DP into dp_replicate x dp_shard for HSDP (torchtitan's layout; a search splits "
                      "every mesh's DP) and list the flattens to make (default: 1, no split)")
    plan.add_argument("--device-type", choices=VALID_DEVICE_TYPES, default="cuda",
                      help="the device the job runs on: written into the call, and without --device-profile the "
                      "optimizer is planned as torch runs it there (cpu: a loop over tensors; else foreach) "
                      "(default: cuda)")
    add_job_arguments(plan, positive)
    plan.set_defaults(run=run_plan)
    return plan


def run_plan(args: argparse.Namespace) -> int:
    check_world(args.world_size, "argument --world-size")
    try:
        request = PlanRequest.from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if request.searches:
        return _search(request, args.json)
    try:
        plan = mesh_of(request)
    except ValueError as e:
        raise UsageError(str(e)) from None
    check_rank(plan.layout, args.rank)
    if request.model is not None:
        return _plan_model(request, plan, args.json)
    if args.json:
        doc: dict[str, Any] = {
            "world_size": plan.world_size,
            "degrees": plan.degrees,
            "ep": plan.ep,
            "filled_in": plan.filled,
            "init_device_mesh": plan.init_call(),
            "flatten": plan.flatten_calls(),
        }
        doc.update(layout_document(plan.layout, rank=args.rank, devices_per_host=plan.devices_per_host))
        print_json(doc)
    else:
        print(_plan_header(plan))
        print(describe_layout(plan.layout, rank=args.rank, devices_per_host=plan.devices_per_host))
        print("paste into the training script:")
        print("    from vemesh import VESCALE_DEVICE_MESH")
        call = plan.init_call()
        if len(call) + 4 <= WIDTH:
            print(f"    {call}")
        else:
            head, _, rest = call.partition("(")
            print(f"    {head}(\n        {rest[:-1]}\n    )")
        for line in plan.flatten_calls():
            print(f"    {line}")
    print_warnings(plan.warnings)
    return 0


def _answer(request: PlanRequest) -> Answer:
    try:
        return answer(request)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _plan_model(request: PlanRequest, plan: MeshPlan, as_json: bool) -> int:
    """``vemesh plan --model ...`` on one mesh: memory per rank class and bytes per dim."""
    found = _answer(request)
    fit, memory, plan = found.fit, found.device_memory, found.mesh or plan
    if as_json:
        print_json(found.document())
    else:
        print(_plan_header(plan))
        print(render_fit(found.job, fit))
        if found.profile is not None:
            print(render_time(list(found.times), found.profile))
        if found.placement is not None:
            print(render_placement(found.placement, found.baselines or {}, plan.devices_per_host or 0))
        said = verdict(fit, memory)
        if said:
            print(f"{said}: {'peak' if fit.traced else 'static'} {fit.peak / 2**30:.2f} GiB against "
                  f"{memory / 2**30:.2f} GiB per device")
        print(f"paste into the training script:\n    from vemesh import VESCALE_DEVICE_MESH\n    {plan.init_call()}")
        for line in plan.flatten_calls():
            print(f"    {line}")
    print_warnings(plan.warnings)
    return 1 if verdict(fit, memory) == "does not fit" else 0


@contextlib.contextmanager
def _progress() -> Iterator[None]:
    """Inside, the planner's INFO lines (each pipeline it traces, and how long it took) go to stderr as they come: a
    search that traces its PP meshes runs for minutes."""
    log = logging.getLogger("vemesh.planning")
    handler, level = logging.StreamHandler(sys.stderr), log.level
    handler.setFormatter(logging.Formatter("vemesh: %(message)s"))
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        yield
    finally:
        log.removeHandler(handler)
        log.setLevel(level)


def _search(request: PlanRequest, as_json: bool) -> int:
    """``vemesh plan --model ... --device-memory ...`` without a shape: every mesh that fits, ranked, and the command
    that plans the best alone."""
    with _progress():
        found = _answer(request)
    if as_json:
        doc = found.document()
        for row, fit in zip(doc["fits"], found.fits):
            row["plan_alone"] = plan_alone(request, fit)
        for row, fit in zip(doc["rejected"], found.rejected):  # a PP mesh left out: the command that plans it
            if fit.not_planned:
                row["plan_alone"] = plan_alone(request, replace(fit, micro_batch_size=found.job.micro_batch_size))
        print_json(doc)
    else:
        print(render_search(found.job, request.world_size, found.device_memory, request.devices_per_host,
                            request.order, list(found.fits), list(found.rejected), dp_replicate=request.dp_replicate))
        if found.fits:
            print(f"plan #1 alone (each rank class, its placement, the lines to paste): {plan_alone(request, found.fits[0])}")
    return 0 if found.fits else 1


#: a search's flags that a plan of one mesh does not take, or takes from the mesh
_SEARCH_ONLY = ("pp", "dp", "cp", "tp", "micro_batch_size", "choose", "jobs", "trace_pp", "rank_by")


def plan_alone(request: PlanRequest, fit: Any) -> str:
    """The ``vemesh plan`` command that plans ``fit``'s mesh of a search alone, with the figures the search gave it:
    the search's flags but a search's own, the mesh's degrees and micro-batch size (a search's default is 1, a plan
    of one mesh's the DP rank's whole share), and what ``--choose`` chose."""
    words = ["vemesh", "plan"]
    for field in fields(PlanRequest):
        value = getattr(request, field.name)
        if field.name in _SEARCH_ONLY or value is None or value is False or value == field.default:
            continue
        words += [f"--{field.name.replace('_', '-')}"] + ([] if value is True else [str(value)])
    d = fit.degrees
    for dim in ("PP", "DP", "CP", "TP") if d["CP"] > 1 else ("PP", "DP", "TP"):
        words += [f"--{dim.lower()}", str(d[dim])]
    words += ["--micro-batch-size", str(fit.micro_batch_size)]
    if fit.activation_checkpointing and not request.activation_checkpointing:  # chosen by --choose
        words += ["--activation-checkpointing"]
    return shlex.join(words)


def _plan_header(plan: MeshPlan) -> str:
    filled = f" ({plan.filled} filled in)" if plan.filled else ""
    header = f"plan: {plan.world_size} ranks = {plan.product()}{filled}"
    left_out = [n for n in plan.degrees if not plan.layout.has(n)]
    if left_out:
        header += f"\n  left out of the mesh (size 1): {', '.join(left_out)}"
    if plan.ep > 1:
        dpcp = plan.degrees["DP"] * plan.degrees["CP"]
        header += (f"\n  EP {plan.ep}: experts spread over groups of {plan.ep} of the {dpcp} DP x CP ranks "
                   "(EP reuses them; the mesh does not change)")
    return header
