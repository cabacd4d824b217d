"""The ``vemesh`` command line: see which ranks land in which groups before you launch.

No process group, no GPU, no torch: it is the arithmetic of :mod:`vemesh.layout`::

    vemesh show --shape 2,2,2 [--names PP,DP,TP] [--devices-per-host 4] [--rank 5] [--flatten NAME=A,B]
                [--split DIM=A:2,B:4] [--derived [--ep N] [--dp-replicate N]] [--json]
    vemesh plan --world-size 64 --devices-per-host 8 --tp 8 --pp 2 [--cp N] [--dp N|auto] [--json]
    vemesh check --model module:MODULE:FACTORY --parallelize MODULE:FUNCTION --step MODULE:FUNCTION --world-size N
                 [--dp N] [--tp N] [--cp N] [--ep N] [--model-kwargs K=V,...] [--json]
    vemesh diagnose DIR [--stragglers] [--shape 2,2 --dim-names dp,tp] [--json]

``python -m vemesh`` is the same. ``show`` prints the rank grid (hosts marked),
the groups along every dim and, with ``--rank``, one rank's view; ``plan`` fills
in the missing degree (DP unless one is ``auto``) and prints the layout and the
``init_device_mesh(...)`` call to paste. Layouts that waste bandwidth (a TP or
CP group across hosts, TP not innermost, a partly used host) get a
``vemesh: warning:`` on stderr, and are listed under ``"warnings"`` with
``--json``; they do not change the exit status.

Exit status: 0 on success, 2 on bad input, with one line ``vemesh: error: ...``
on stderr that names the bad value and the valid ones; 1 when the answer is no:
``check`` finds a difference, ``plan --device-memory`` finds no mesh that fits.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from typing import NoReturn

from vemesh.cli.common import MAX_WORLD, UsageError, positive
from vemesh.cli.calibrate import add_calibrate
from vemesh.cli.check import add_check
from vemesh.cli.diagnose import add_diagnose
from vemesh.cli.plan import add_plan
from vemesh.cli.show import add_show

__all__ = ["MAX_WORLD", "build_parser", "main"]


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise UsageError(message)


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``vemesh`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status.

    ``main(["show", "--shape", "2,2"])`` prints the layout and returns 0;
    ``main(["show", "--shape", "2,0"])`` prints ``vemesh: error: ...`` and returns 2.
    """
    try:
        args = build_parser().parse_args(_join_negative_values(sys.argv[1:] if argv is None else argv))
        return args.run(args)
    except UsageError as e:
        message = " ".join(str(e).split())  # one line, whatever the source
        if message.endswith("required: command"):
            message += " (choose from 'show', 'plan', 'check', 'diagnose', 'calibrate')"
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


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="vemesh",
        description="Before launching: see a device mesh's layout (which ranks form which groups, on which hosts), "
        "plan which mesh fits and runs fastest for your model, calibrate this machine, check a parallelized model "
        "against one process; after a hang: name its dim, group and missing rank.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    show, plan = add_show(commands), add_plan(commands)
    add_diagnose(commands)
    add_calibrate(commands)
    add_check(commands)
    for sub in (show, plan):
        sub.add_argument("--devices-per-host", type=positive, metavar="N",
                         help="ranks per host (torchrun --nproc-per-node), to mark hosts and check groups")
        sub.add_argument("--rank", type=int, metavar="R",
                         help="show this global rank's coordinate, host, groups and pipeline neighbors")
        sub.add_argument("--json", action="store_true", help="print a JSON document instead of text")
    return parser
