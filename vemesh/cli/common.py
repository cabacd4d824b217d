"""What the ``vemesh`` commands share: the usage error, argument types, and the JSON and warning printers."""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from typing import Any

from vemesh.layout.describe import WIDTH, LayoutWarning
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.spec import MeshSpecError
from vemesh.planning.mesh_plan import AUTO

#: The largest world the CLI draws: the slowest 1,048,576-rank plan (CP groups across hosts) took
#: 7.5 s and 190 MB on this project's machine; half of it stays well inside the 10 s every accepted world must answer in.
MAX_WORLD = 1 << 19


class UsageError(Exception):
    """Bad command-line input: printed as one ``vemesh: error:`` line, exit status 2."""


def check_world(world_size: int, where: str) -> None:
    if world_size > MAX_WORLD:
        raise UsageError(
            f"{where}: {world_size:,} ranks is more than vemesh draws ({MAX_WORLD:,} ranks at most, drawn in under 5 s)"
            "; check the sizes"
        )


def shape(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"invalid shape {text!r}: expected integer sizes separated by commas, such as 2,2,2"
        ) from None


def names(text: str) -> tuple[str, ...]:
    return tuple(text.split(","))  # checked as init_device_mesh checks names: no spaces around them


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"invalid value {text!r}: expected a positive integer")
    return value


def degree(text: str) -> int | str:
    if text.strip().lower() in (AUTO, "-1"):
        return AUTO
    try:
        return positive(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"invalid degree {text!r}: expected a positive integer or 'auto'"
        ) from None


def check_rank(layout: MeshLayout, rank: int | None) -> None:
    if rank is not None:
        try:
            layout.check_rank(rank)
        except ValueError as e:
            raise UsageError(f"argument --rank: {e}") from None


def spec_message(error: MeshSpecError) -> str:
    """The library's own message, tagged with the argument it came from."""
    options = {"mesh_shape": "argument --shape: ", "mesh_dim_names": "argument --names: ", "": "argument --names: "}
    return options.get(error.field, "") + str(error)


def print_json(doc: dict[str, Any]) -> None:
    """One top-level key per line, each value compact: readable for 8 ranks, few lines for 16384."""
    body = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in doc.items())
    print("{\n" + body + "\n}")


def print_warnings(warnings: list[LayoutWarning]) -> None:
    for w in warnings:
        print(textwrap.fill(f"vemesh: warning: {w}", width=WIDTH, subsequent_indent="  "), file=sys.stderr)


def csv(values: Sequence[int]) -> str:
    return ",".join(map(str, values))
