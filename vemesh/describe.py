"""Render a :class:`~vemesh.layout.MeshLayout` as text a person can check before launching.

Pure: it needs no process group, so ``vemesh show`` and the live mesh's
``describe()`` print the same thing.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping

from .layout import MeshLayout

__all__ = ["describe_layout"]

_FULL_LIMIT = 64  # meshes up to this many ranks are drawn in full
_GROUPS_SHOWN = 3  # larger meshes show this many groups per dim, then a count


def _fmt_groups(groups: list[list[int]], full: bool) -> str:
    if full or len(groups) <= _GROUPS_SHOWN:
        return " ".join(_fmt_ranks(g) for g in groups)
    head = " ".join(_fmt_ranks(g) for g in groups[: _GROUPS_SHOWN - 1])
    return f"{head} ... {_fmt_ranks(groups[-1])}"


def _fmt_ranks(ranks: list[int]) -> str:
    if len(ranks) > 8:
        step = ranks[1] - ranks[0]
        if all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"[{ranks[0]}..{ranks[-1]}" + (f" step {step}]" if step != 1 else "]")
        return "[" + ", ".join(map(str, ranks[:3])) + f", ... {ranks[-1]}] ({len(ranks)} ranks)"
    return "[" + ", ".join(map(str, ranks)) + "]"


def _grid(layout: MeshLayout) -> list[str]:
    """Rows of global ranks: the last dim runs across, the next-to-last down, outer dims as blocks."""
    width = len(str(layout.world_size - 1))
    inner = layout.shape[-1]
    rows_dim = layout.shape[-2] if layout.ndim >= 2 else 1
    lines: list[str] = []
    outer = itertools.product(*(range(s) for s in layout.shape[:-2]))
    for block, prefix in enumerate(outer):
        if prefix:
            label = ", ".join(f"{n}={c}" for n, c in zip(layout.dim_names, prefix))
            lines.append(f"  {label}:")
        for row in range(rows_dim):
            first = (block * rows_dim + row) * inner
            cells = " ".join(str(r).rjust(width) for r in range(first, first + inner))
            lines.append(f"    {cells}")
    return lines


def describe_layout(
    layout: MeshLayout,
    *,
    rank: int | None = None,
    devices_per_host: int | None = None,
    flattened: Mapping[str, tuple[int, ...]] | None = None,
) -> str:
    """Describe ``layout``: sizes, the rank grid, every dim's groups and ``rank``'s own view.

    Args:
        layout: the mesh.
        rank: a global rank whose coordinate, groups and neighbors to show.
        devices_per_host: ranks per host, for the host of ``rank``.
        flattened: extra flattened dims (name -> dim indices) to list with the others.
    """
    dims = ", ".join(f"{n}={s}" for n, s in zip(layout.dim_names, layout.shape))
    lines = [f"mesh ({dims}): {layout.world_size} ranks"]
    full = layout.world_size <= _FULL_LIMIT
    if full:
        across = layout.dim_names[-1]
        down = f", {layout.dim_names[-2]} down" if layout.ndim >= 2 else ""
        lines.append(f"  ranks ({across} across{down}):")
        lines.extend(_grid(layout))
    groups: dict[str, tuple[int, ...]] = {n: (i,) for i, n in enumerate(layout.dim_names)}
    groups.update(flattened or {})
    lines.append("  groups:")
    pad = max(len(n) for n in groups)
    for name, ds in groups.items():
        all_groups = layout.all_groups(ds)
        lines.append(f"    {name.ljust(pad)} ({len(all_groups)} x {layout.group_size(ds)}): {_fmt_groups(all_groups, full)}")
    if rank is not None:
        coord = layout.coordinate(rank)
        where = ", ".join(f"{n}={c}" for n, c in zip(layout.dim_names, coord))
        host = ""
        if devices_per_host:
            host = f", host {rank // devices_per_host} local rank {rank % devices_per_host}"
        lines.append(f"  rank {rank}: ({where}){host}")
        for name, ds in groups.items():
            lines.append(f"    {name.ljust(pad)} group {_fmt_ranks(layout.group_ranks(rank, ds))}")
        if "PP" in layout.dim_names:
            pp = layout.dim_index("PP")
            prev, nxt = layout.neighbor(rank, pp, -1), layout.neighbor(rank, pp, 1)
            lines.append(f"    pipeline: previous stage rank {prev}, next stage rank {nxt}")
    return "\n".join(lines)
