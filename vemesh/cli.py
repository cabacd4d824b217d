"""The ``vemesh`` command line: see which ranks land in which groups before you launch.

No process group, no GPU, no torch: it is the arithmetic of :mod:`vemesh.layout`::

    vemesh show --shape 2,2,2 [--names PP,DP,TP] [--devices-per-host 4] [--rank 5] [--flatten NAME=A,B]
                [--split DIM=A:2,B:4] [--json]
    vemesh plan --world-size 64 --devices-per-host 8 --tp 8 --pp 2 [--cp N] [--dp N|auto] [--json]

``python -m vemesh`` is the same. ``show`` prints the rank grid (hosts marked),
the groups along every dim and, with ``--rank``, one rank's view; ``plan`` fills
in the missing degree (DP unless one is ``auto``) and prints the layout and the
``init_device_mesh(...)`` call to paste. Layouts that waste bandwidth (a TP or
CP group across hosts, TP not innermost, a partly used host) get a
``vemesh: warning:`` on stderr, and are listed under ``"warnings"`` with
``--json``; they do not change the exit status.

Exit status: 0 on success, 2 on bad input, with one line ``vemesh: error: ...``
on stderr that names the bad value and the valid ones.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import textwrap
from collections.abc import Sequence
from typing import Any, NoReturn

from vemesh.layout.describe import WIDTH, LayoutWarning, check_layout, describe_layout, layout_document
from vemesh.planning.fit_report import add_job_arguments, job_from_args, refuse_job_flags
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.planning.mesh_plan import AUTO, MeshPlan, plan_mesh
from vemesh.layout.spec import DEFAULT_DIM_NAMES, VALID_DEVICE_TYPES, MeshSpec, MeshSpecError

__all__ = ["main", "MAX_WORLD"]

#: The largest world the CLI draws: the slowest 1,048,576-rank plan (CP groups across hosts) took
#: 7.5 s and 190 MB on this project's machine; half of it stays well inside the 10 s every accepted world must answer in.
MAX_WORLD = 1 << 19


class UsageError(Exception):
    """Bad command-line input: printed as one ``vemesh: error:`` line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vemesh`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    ``main(["show", "--shape", "2,2"])`` prints the layout and returns 0;
    ``main(["show", "--shape", "2,0"])`` prints ``vemesh: error: ...`` and returns 2.
    """
    try:
        args = _parser().parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
        return args.run(args)
    except UsageError as e:
        message = " ".join(str(e).split())  # one line, whatever the source
        if message.endswith("required: command"):
            message += " (choose from 'show', 'plan')"
        print(f"vemesh: error: {message}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return e.code if isinstance(e.code, int) else 0
    except BrokenPipeError:  # `vemesh show ... | head`: stop quietly, as the Python docs advise
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


def _join_negative_values(argv: Sequence[str]) -> list[str]:
    """``--shape -1,2`` as ``--shape=-1,2``: argparse would take a value starting with ``-`` for an option."""
    out: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg.startswith("--") and "=" not in arg and arg not in ("--json", "--help"):
            value = next(it, None)
            if value is not None and len(value) > 1 and value[0] == "-" and (value[1].isdigit() or value[1] == "."):
                out.append(f"{arg}={value}")
                continue
            out.append(arg)
            if value is not None:
                out.append(value)
            continue
        out.append(arg)
    return out


def _derived(layout: MeshLayout, steps: Sequence[tuple[str, str]]) -> MeshLayout:
    """``layout`` after each ``--flatten NAME=DIM,DIM`` and ``--split DIM=NAME:SIZE,NAME:SIZE``, in the order given."""
    for kind, spec in steps:
        name, sep, rest = spec.partition("=")
        example = "dp_shard_cp=dp_shard,cp" if kind == "flatten" else "dp_cp=EDP:2,EP:4"
        form = "NAME=DIM,DIM" if kind == "flatten" else "DIM=NAME:SIZE,NAME:SIZE"
        if not sep or not rest:
            raise UsageError(f"argument --{kind}: expected {form} such as {example}; got {spec!r}")
        try:
            if kind == "flatten":
                dims = tuple(rest.split(","))
                unknown = [d for d in dims if not layout.has(d)]
                if unknown:
                    raise UsageError(f"argument --flatten: unknown dim {unknown[0]!r} in {spec!r}; valid: {list(layout.names)}")
                if not name.isidentifier() or layout.has(name):
                    raise UsageError(f"argument --flatten: {name!r} must be a new plain name (not {list(layout.names)})")
                try:
                    layout = layout.flatten(dims, name)
                except ValueError as e:
                    raise UsageError(f"argument --flatten: the dims of {spec!r} must be distinct and in mesh order "
                                     f"{layout.dim_names}: {e}") from None
            else:
                pieces = [p.partition(":") for p in rest.split(",")]
                if any(not sep or not size.strip().isdigit() for _, sep, size in pieces):
                    raise UsageError(f"argument --split: expected {form} such as {example}; got {spec!r}")
                layout = layout.split(name, tuple(n for n, _, _ in pieces), tuple(int(s) for _, _, s in pieces))
        except (KeyError, ValueError) as e:
            raise UsageError(f"argument --{kind}: {str(e).strip(chr(34))}") from None
    return layout


def _check_world(world_size: int, where: str) -> None:
    if world_size > MAX_WORLD:
        raise UsageError(
            f"{where}: {world_size:,} ranks is more than vemesh draws ({MAX_WORLD:,} ranks at most, drawn in under 5 s)"
            "; check the sizes"
        )


# ------------------------------------------------------------------ commands
def _show(args: argparse.Namespace) -> int:
    try:
        spec = MeshSpec(device_type="cpu", mesh_shape=args.shape, mesh_dim_names=args.names)
    except MeshSpecError as e:
        raise UsageError(_spec_message(e)) from None
    if -1 in spec.mesh_shape and args.world_size is None:
        raise UsageError(f"argument --shape: {_csv(args.shape)} has a -1 to infer; pass --world-size N to fill it in")
    if args.world_size is not None:
        _check_world(args.world_size, "argument --world-size")
    _check_world(math.prod(abs(n) for n in spec.mesh_shape), "argument --shape")
    world_size = args.world_size if args.world_size is not None else math.prod(spec.mesh_shape)
    try:
        layout = spec.resolve(world_size)
    except ValueError as e:
        raise UsageError(f"argument --world-size: {e}") from None
    _check_rank(layout, args.rank)
    layout = _derived(layout, args.derive or [])
    warnings = check_layout(layout, args.devices_per_host)
    if args.json:
        _print_json(layout_document(layout, rank=args.rank, devices_per_host=args.devices_per_host))
    else:
        print(describe_layout(layout, rank=args.rank, devices_per_host=args.devices_per_host))
    _print_warnings(warnings)
    return 0


def _plan(args: argparse.Namespace) -> int:
    _check_world(args.world_size, "argument --world-size")
    if args.model is None:
        try:
            refuse_job_flags(args)
        except ValueError as e:
            raise UsageError(str(e)) from None
    elif args.device_memory is not None and args.pp is None and args.tp is None and args.dp is None:
        return _search(args)
    args.pp, args.tp = args.pp or 1, args.tp or 1
    try:
        plan = plan_mesh(
            args.world_size, pp=args.pp, dp=args.dp, cp=args.cp, tp=args.tp, ep=args.ep,
            dp_replicate=args.dp_replicate, devices_per_host=args.devices_per_host, device_type=args.device_type,
        )
    except ValueError as e:
        raise UsageError(str(e)) from None
    _check_rank(plan.layout, args.rank)
    if args.model is not None:
        return _plan_model(args, plan)
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
        _print_json(doc)
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
    _print_warnings(plan.warnings)
    return 0


def _plan_model(args: argparse.Namespace, plan: MeshPlan) -> int:
    """``vemesh plan --model ...`` on one mesh: memory per rank class and bytes per dim."""
    from vemesh.planning.fit import predict
    from vemesh.planning.fit_report import fit_document, render_fit

    try:
        job = job_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    d = plan.degrees
    try:
        fit = predict(job, dp=d["DP"], tp=d["TP"], pp=d["PP"], cp=d["CP"], ep=plan.ep)
    except ValueError as e:
        raise UsageError(str(e)) from None
    verdict = None
    if args.device_memory is not None:
        verdict = ("fits" if fit.peak <= args.device_memory else "does not fit") if fit.traced else \
            ("the static memory alone fits" if fit.peak <= args.device_memory else "does not fit")
    if args.json:
        doc = fit_document(job, fit)
        doc.update({"world_size": plan.world_size, "init_device_mesh": plan.init_call(), "flatten": plan.flatten_calls()})
        if verdict:
            doc.update({"device_memory": args.device_memory, "fits": verdict == "fits"})
        _print_json(doc)
    else:
        print(_plan_header(plan))
        print(render_fit(job, fit))
        if verdict:
            print(f"{verdict}: {'peak' if fit.traced else 'static'} {fit.peak / 2**30:.2f} GiB against "
                  f"{args.device_memory / 2**30:.2f} GiB per device")
        print(f"paste into the training script:\n    from vemesh import VESCALE_DEVICE_MESH\n    {plan.init_call()}")
        for line in plan.flatten_calls():
            print(f"    {line}")
    _print_warnings(plan.warnings)
    return 0


def _search(args: argparse.Namespace) -> int:
    """``vemesh plan --model ... --device-memory ...`` without a shape: every mesh that fits, ranked."""
    from vemesh.planning.fit import search
    from vemesh.planning.fit_report import render_search, search_document

    if args.micro_batch_size is None:
        args.micro_batch_size = 1
    try:
        job = job_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    rank_by = args.rank_by or ("inter-host" if args.devices_per_host else "peak")
    try:
        fits, rejected = search(job, args.world_size, device_memory=args.device_memory,
                                devices_per_host=args.devices_per_host, cp=args.cp, ep=args.ep, rank_by=rank_by)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if args.json:
        _print_json(search_document(job, args.world_size, args.device_memory, args.devices_per_host, rank_by, fits,
                                    rejected))
    else:
        print(render_search(job, args.world_size, args.device_memory, args.devices_per_host, rank_by, fits, rejected))
    return 0


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


# ------------------------------------------------------------------ parsing
def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vemesh",
        description="See a device mesh layout (which ranks form which groups, on which hosts) before launching.",
    )
    commands = parser.add_subparsers(dest="command", required=True)

    show = commands.add_parser(
        "show", help="draw a mesh: rank grid, groups along every dim, one rank's view",
        description="Draw a mesh: the rank grid with hosts marked, the groups along every dim, one rank's view.",
    )
    show.add_argument("--shape", type=_shape, required=True, metavar="N,N,...",
                      help="size per dim, outermost first, e.g. 2,2,2 (one -1 with --world-size)")
    defaults = "; ".join(f"{k}-D {','.join(v)}" for k, v in DEFAULT_DIM_NAMES.items())
    show.add_argument("--names", type=_names, metavar="A,B,...",
                      help=f"dim names, outermost first (default: {defaults})")
    show.add_argument("--world-size", type=_positive, metavar="N", help="fill in a -1 in --shape")
    show.add_argument("--flatten", action="append", dest="derive", metavar="NAME=DIM,DIM",
                      type=lambda text: ("flatten", text),
                      help="also show a flattened dim, as VESCALE_DEVICE_MESH.flatten makes it "
                      "(repeatable; a DIM may be an earlier NAME), e.g. dp_shard_cp=dp_shard,cp")
    show.add_argument("--split", action="append", dest="derive", metavar="DIM=NAME:SIZE,NAME:SIZE",
                      type=lambda text: ("split", text),
                      help="split a dim, as VESCALE_DEVICE_MESH.split does (repeatable, in order with --flatten); "
                      "a flattened DIM gives a second factorization, e.g. --flatten dp_cp=DP,CP --split dp_cp=EDP:2,EP:4")
    show.set_defaults(run=_show)

    plan = commands.add_parser(
        "plan", help="fill in the missing degree and print the init_device_mesh call",
        description="Fill in the one missing degree (DP unless another is 'auto'), check the layout, "
        "and print the init_device_mesh(...) call. Dims run PP, DP, CP, TP (outermost first); "
        "dims of size 1 are left out.",
    )
    plan.add_argument("--world-size", type=_positive, required=True, metavar="N", help="total number of ranks")
    for name, default in (("pp", 1), ("dp", None), ("cp", 1), ("tp", 1)):
        plan.add_argument(f"--{name}", type=_degree, default=1 if name == "cp" else None, metavar="N",
                          help=f"{name.upper()} degree or 'auto' (default: "
                          + ("auto, or 1 when another degree is auto)" if default is None else f"{default})"))
    plan.add_argument("--ep", type=_positive, default=1, metavar="N",
                      help="expert-parallel degree; reuses the DP x CP ranks, so it must divide DP x CP (default: 1)")
    plan.add_argument("--dp-replicate", type=_positive, default=1, metavar="N",
                      help="split DP into dp_replicate x dp_shard for HSDP (torchtitan's layout) and list the "
                      "flattens to make (default: 1, no split)")
    plan.add_argument("--device-type", choices=VALID_DEVICE_TYPES, default="cuda",
                      help="device type written into the call (default: cuda)")
    add_job_arguments(plan, _positive)
    plan.set_defaults(run=_plan)

    for sub in (show, plan):
        sub.add_argument("--devices-per-host", type=_positive, metavar="N",
                         help="ranks per host (torchrun --nproc-per-node), to mark hosts and check groups")
        sub.add_argument("--rank", type=int, metavar="R",
                         help="show this global rank's coordinate, host, groups and pipeline neighbors")
        sub.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    return parser


def _shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid shape {text!r}: expected integer sizes separated by commas, such as 2,2,2"
        ) from None


def _names(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))  # checked as init_device_mesh checks names: no spaces around them


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer")
    return value


def _degree(text: str) -> int | str:
    if text.strip().lower() in (AUTO, "-1"):
        return AUTO
    try:
        return _positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid degree {text!r}: expected a positive integer or 'auto'"
        ) from None


# ------------------------------------------------------------------ helpers
def _check_rank(layout: MeshLayout, rank: int | None) -> None:
    if rank is not None:
        try:
            layout.check_rank(rank)
        except ValueError as e:
            raise UsageError(f"argument --rank: {e}") from None


def _spec_message(error: MeshSpecError) -> str:
    """The library's own message, tagged with the argument it came from."""
    options = {"mesh_shape": "argument --shape: ", "mesh_dim_names": "argument --names: ", "": "argument --names: "}
    return options.get(error.field, "") + str(error)


def _print_json(doc: dict[str, Any]) -> None:
    """One top-level key per line, each value compact: readable for 8 ranks, few lines for 16384."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items())
    print("{\n" + body + "\n}")


def _print_warnings(warnings: list[LayoutWarning]) -> None:
    for w in warnings:
        print(textwrap.fill(f"vemesh: warning: {w}", width=WIDTH, subsequent_indent="  "), file=sys.stderr)


def _csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))
