"""``vemesh diagnose DIR``: what hung (or who straggles), in mesh terms, from every rank's dump."""

from __future__ import annotations

import argparse
import json
from typing import Any

from vemesh.cli.common import UsageError, shape
from vemesh.hangs.diagnose import diagnose, load
from vemesh.hangs.stragglers import stragglers, stragglers_text

__all__ = ["add_diagnose"]


def add_diagnose(commands: Any) -> argparse.ArgumentParser:
    sub = commands.add_parser(
        "diagnose", help="name a hang's dim, group and missing rank from the dumps of VEMESH_HANG_DIR (or torch's own)",
        description="Read the dumps every rank wrote on a hang (VEMESH_HANG_DIR) and say which mesh dim, which group "
                    "and which rank never came, where it was, and which ranks entered different collectives. "
                    "Also reads torch's own Flight Recorder dumps, given the mesh's --shape and --dim-names.",
    )
    sub.add_argument("directory", metavar="DIR", help="the directory of the dumps")
    sub.add_argument("--stragglers", action="store_true",
                     help="per dim, which rank enters the group's collectives last, and by how much (a healthy run's dumps)")
    sub.add_argument("--shape", type=shape, metavar="A,B,...", help="the mesh shape, for torch's own dumps")
    sub.add_argument("--dim-names", metavar="A,B,...", help="the mesh's dim names, for torch's own dumps (mesh_<dim> groups)")
    sub.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    sub.set_defaults(run=_run)
    return sub


def _run(args: argparse.Namespace) -> int:

    names = tuple(args.dim_names.split(",")) if args.dim_names else None
    try:
        job = load(args.directory, args.shape, names)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    if args.stragglers:
        if args.json:
            print(json.dumps({"stragglers": [d.as_dict() for d in stragglers(job)]}, indent=2))
        else:
            print(stragglers_text(job))
        return 0
    found = diagnose(job)
    print(json.dumps(found.as_dict(), indent=2, default=str) if args.json else found.text())
    return 0
