"""``vemesh show``: draw a mesh, its groups along every name, one rank's view."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from typing import Any

from vemesh.cli.common import (UsageError, check_rank, check_world, csv, names, positive, print_json, print_warnings,
                               shape, spec_message)
from vemesh.layout.data_dims import data_dims
from vemesh.layout.describe import check_layout, describe_layout, layout_document
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.parallel_dims import ParallelDims
from vemesh.layout.spec import DEFAULT_DIM_NAMES, MeshSpec, MeshSpecError


def add_show(commands: Any) -> argparse.ArgumentParser:
    show = commands.add_parser(
        "show", help="draw a mesh: rank grid, groups along every dim, one rank's view",
        description="Draw a mesh: the rank grid with hosts marked, the groups along every dim, one rank's view.",
    )
    show.add_argument("--shape", type=shape, required=True, metavar="N,N,...",
                      help="size per dim, outermost first, e.g. 2,2,2 (one -1 with --world-size)")
    defaults = "; ".join(f"{k}-D {','.join(v)}" for k, v in DEFAULT_DIM_NAMES.items())
    show.add_argument("--names", type=names, metavar="A,B,...",
                      help=f"dim names, outermost first (default: {defaults})")
    show.add_argument("--world-size", type=positive, metavar="N", help="fill in a -1 in --shape")
    show.add_argument("--flatten", action="append", dest="derive", metavar="NAME=DIM,DIM",
                      type=lambda text: ("flatten", text),
                      help="also show a flattened dim, as VESCALE_DEVICE_MESH.flatten makes it "
                      "(repeatable; a DIM may be an earlier NAME), e.g. dp_shard_cp=dp_shard,cp")
    show.add_argument("--split", action="append", dest="derive", metavar="DIM=NAME:SIZE,NAME:SIZE",
                      type=lambda text: ("split", text),
                      help="split a dim, as VESCALE_DEVICE_MESH.split does (repeatable, in order with --flatten); "
                      "a flattened DIM gives a second factorization, e.g. --flatten dp_cp=DP,CP --split dp_cp=EDP:2,EP:4")
    show.add_argument("--derived", action="store_true",
                      help="also show every dim a job derives from these (dims among PP,DP,CP,TP): dp_cp with CP, "
                      "the HSDP split, EDP x EP, as ParallelDims makes them (implied by --ep and --dp-replicate)")
    show.add_argument("--ep", type=positive, default=1, metavar="N", help="with --derived: the expert-parallel degree")
    show.add_argument("--dp-replicate", type=positive, default=1, metavar="N",
                      help="with --derived: split DP into dp_replicate x dp_shard (HSDP)")
    show.set_defaults(run=run_show)
    return show


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


def run_show(args: argparse.Namespace) -> int:
    try:
        spec = MeshSpec(device_type="cpu", mesh_shape=args.shape, mesh_dim_names=args.names)
    except MeshSpecError as e:
        raise UsageError(spec_message(e)) from None
    if -1 in spec.mesh_shape and args.world_size is None:
        raise UsageError(f"argument --world-size: needed for the -1 in --shape {csv(args.shape)}")
    if args.world_size is not None:
        check_world(args.world_size, "argument --world-size")
    check_world(math.prod(abs(n) for n in spec.mesh_shape), "argument --shape")
    world_size = args.world_size if args.world_size is not None else math.prod(spec.mesh_shape)
    try:
        layout = spec.resolve(world_size)
    except ValueError as e:
        raise UsageError(f"argument --world-size: {e}") from None
    check_rank(layout, args.rank)
    if args.derived or args.ep > 1 or args.dp_replicate > 1:  # the job's derived dims, by the one rule
        try:
            layout = ParallelDims.of(layout, dp_replicate=args.dp_replicate, ep=args.ep).layout()
        except ValueError as e:
            raise UsageError(f"argument --derived: {e}") from None
    layout = _derived(layout, args.derive or [])
    warnings = check_layout(layout, args.devices_per_host)
    data = _data_dims(layout) if args.derived or args.ep > 1 or args.dp_replicate > 1 else None
    if args.json:
        print_json({**layout_document(layout, rank=args.rank, devices_per_host=args.devices_per_host),
                    **({"data": data} if data else {})})
    else:
        print(describe_layout(layout, rank=args.rank, devices_per_host=args.devices_per_host))
        if data:
            print(f"  data dims: {', '.join(data['batch']) or 'none'}; gradients and the loss average over "
                  f"{data['grad'] or 'nothing'}; FSDP2 shards over {', '.join(data['fsdp']) or 'nothing'}"
                  + (f"; expert gradients over {data['expert'][0]}" if data["expert"] else ""))
    print_warnings(warnings)
    return 0


def _data_dims(layout: MeshLayout) -> dict[str, Any]:
    """The one data-dims rule's answer (:func:`vemesh.layout.data_dims.data_dims`), for ``--derived``."""
    try:
        found = data_dims(layout)
    except ValueError as e:
        raise UsageError(f"argument --derived: {e}") from None
    return {"batch": list(found.batch), "grad": found.grad, "fsdp": list(found.fsdp), "expert": list(found.expert)}
