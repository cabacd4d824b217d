"""Render a :class:`~vemesh.layout.MeshLayout` for a person (text) or a program (a JSON-ready dict).

Pure: it needs no process group and no torch, so ``vemesh show`` and the live
mesh's ``describe()`` print the same thing. On shape ``(PP=2, DP=2, TP=2)``
with 4 devices per host, ``describe_layout(layout, rank=5, devices_per_host=4)``
is::

    mesh (PP=2, DP=2, TP=2): 8 ranks on 2 hosts of 4 devices
      ranks (TP across, DP down; "h1" marks the first rank of host 1):
        PP=0:
          h0 0 1
             2 3
        PP=1:
          h1 4 5
             6 7
      groups along each dim:
        PP: 4 groups of 2, each spans 2 hosts
            [0, 4] [1, 5] [2, 6] [3, 7]
        DP: 4 groups of 2, each on one host
            [0, 2] [1, 3] [4, 6] [5, 7]
        TP: 4 groups of 2, each on one host
            [0, 1] [2, 3] [4, 5] [6, 7]
      rank 5: PP=1, DP=0, TP=1; host 1, local rank 1
        PP group [1, 5] (index 1)
        DP group [5, 7] (index 0)
        TP group [4, 5] (index 1)
        pipeline: previous stage rank 1, next stage none (last stage)

Rank 2 would instead see ``host 0, local rank 2``, TP group ``[2, 3]`` and
``previous stage none (first stage), next stage rank 6``. Meshes of more than
64 ranks drop the grid and list three groups per dim, so a 16384-rank mesh
still fits on one screen. :func:`check_layout` finds the layouts that waste
bandwidth; the text never includes them (the CLI prints them to stderr).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vemesh.layout.mesh_layout import MeshLayout

__all__ = ["LayoutWarning", "check_layout", "describe_layout", "hosts_of", "layout_document", "link_of", "spans_hosts"]

WIDTH = 80  # columns the text fits in
FULL_LIMIT = 64  # meshes up to this many ranks are drawn in full
_GROUPS_SHOWN = 3  # larger meshes show this many groups per dim
_HOST_DIMS = ("TP", "CP")  # dims whose groups should stay on one host


@dataclass(frozen=True)
class LayoutWarning:
    """A layout that works but wastes bandwidth.

    ``kind`` is ``"spans_hosts"`` (a TP or CP group crosses a host boundary),
    ``"tp_not_innermost"`` (TP ranks are not consecutive) or ``"partial_host"``
    (the world size is not a multiple of the devices per host).
    """

    kind: str
    dim: str | None
    message: str

    def __str__(self) -> str:
        return self.message


def hosts_of(group: Sequence[int], devices_per_host: int) -> list[int]:
    """The hosts that ``group``'s global ranks run on, ascending: rank ``r`` is on host ``r // devices_per_host``."""
    return sorted({r // devices_per_host for r in group})


def spans_hosts(layout: MeshLayout, dims: Any, devices_per_host: int) -> bool:
    """Whether some group along ``dims`` holds ranks of more than one host of ``devices_per_host`` ranks: the one
    rule for which link a dim's collectives cross (the layout warnings, the step time, the search, the placement)."""
    return any(len(hosts_of(g, devices_per_host)) > 1 for g in layout.all_groups(dims))


def link_of(layout: MeshLayout, dims: Any, devices_per_host: int, hosts_per_rack: int | None = None) -> str:
    """The link class a dim's collectives cross: ``"host"`` when every group lies inside one host, ``"rack"`` when
    some group lies in more than one rack of ``hosts_per_rack`` hosts (given racks), else ``"network"``."""
    if not spans_hosts(layout, dims, devices_per_host):
        return "host"
    if hosts_per_rack and spans_hosts(layout, dims, devices_per_host * hosts_per_rack):
        return "rack"
    return "network"


def check_layout(layout: MeshLayout, devices_per_host: int | None = None) -> list[LayoutWarning]:
    """Warnings for ``layout``, computed from its groups; empty when the layout is fine.

    Exactly these, in this order:

    * ``spans_hosts`` for ``TP`` and for ``CP``: some group along the dim holds
      ranks of more than one host (needs ``devices_per_host``);
    * ``tp_not_innermost``: ``TP`` has size > 1 and a dim of size > 1 comes after
      it, so TP ranks are not consecutive (size-1 dims after TP do not count);
    * ``partial_host``: the world size is not a multiple of ``devices_per_host``.

    On ``(DP=2, TP=8)`` with 4 devices per host, TP group ``[0..7]`` covers hosts
    0 and 1, so the result is one ``spans_hosts`` warning for TP.
    """
    dph = _check_devices_per_host(devices_per_host)
    found: list[LayoutWarning] = []
    names = layout.dim_names
    if dph is not None:
        for name in _HOST_DIMS:
            if not layout.has(name) or layout.group_size(name) == 1:
                continue
            if spans_hosts(layout, name, dph):
                groups = layout.all_groups(name)
                crossing = [g for g in groups if len(hosts_of(g, dph)) > 1]
                first = crossing[0]
                hosts = hosts_of(first, dph)
                found.append(LayoutWarning("spans_hosts", name, (
                    f"{name} groups cross hosts: {len(crossing)} of {len(groups)} {name} groups span more than "
                    f"one host of {dph} devices (e.g. {_fmt_ranks(first)} on hosts {_fmt_hosts(hosts)}), "
                    f"so {name} collectives leave the fast intra-host links"
                )))
    if "TP" in names:
        i = names.index("TP")
        if layout.shape[i] > 1 and layout.strides[i] != 1:
            inner = [n for n, s in zip(names[i + 1 :], layout.shape[i + 1 :]) if s > 1]
            found.append(LayoutWarning("tp_not_innermost", "TP", (
                f"TP is not the innermost dim: {', '.join(inner)} come{'s' if len(inner) == 1 else ''} after it, "
                f"so TP ranks are {layout.strides[i]} apart (e.g. {_fmt_ranks(layout.group_at((i,), 0))}); "
                f"put TP last to keep each TP group on one host"
            )))
    if dph is not None and layout.world_size % dph:
        used = layout.world_size % dph
        found.append(LayoutWarning("partial_host", None, (
            f"the world size {layout.world_size} is not a multiple of {dph} devices per host: "
            f"the last host would use {used} of its {dph} devices"
        )))
    return found


def describe_layout(
    layout: MeshLayout,
    *,
    rank: int | None = None,
    devices_per_host: int | None = None,
) -> str:
    """Describe ``layout``: sizes, the rank grid with host boundaries, every name's groups and ``rank``'s view.

    Args:
        layout: the mesh, with its flattened and split names (all are listed).
        rank: a global rank whose coordinate, host, groups and pipeline neighbors to show.
        devices_per_host: ranks per host; hosts are marked in the grid and in the groups.

    Returns:
        Lines of at most 80 columns (group lists wrap); see the module docstring.
    """
    dph = _check_devices_per_host(devices_per_host)
    if rank is not None:
        layout.check_rank(rank)
    dims = ", ".join(f"{n}={s}" for n, s in zip(layout.dim_names, layout.shape))
    lines = [f"mesh ({dims}): {layout.world_size} ranks"]
    hosts = _hosts_phrase(layout.world_size, dph)
    if len(lines[0]) + len(hosts) <= WIDTH:
        lines[0] += hosts
    elif hosts:
        lines.append(" " + hosts)
    full = layout.world_size <= FULL_LIMIT
    if full:
        across = layout.dim_names[-1]
        down = f", {layout.dim_names[-2]} down" if layout.ndim >= 2 else ""
        marks = '; "h1" marks the first rank of host 1' if dph is not None and layout.world_size > dph else ""
        lines.append(f"  ranks ({across} across{down}{marks}):")
        lines.extend(_grid(layout, dph))
    else:
        lines.append(f"  ranks: grid left out above {FULL_LIMIT} ranks (--rank R shows one rank)")
        if dph is not None:
            n_hosts = -(-layout.world_size // dph)
            shown = range(n_hosts) if n_hosts <= _GROUPS_SHOWN else (0, 1, None, n_hosts - 1)
            spans = [
                "..." if h is None else f"h{h} [{h * dph}..{min((h + 1) * dph, layout.world_size) - 1}]"
                for h in shown
            ]
            lines.extend(_wrap(spans, "  hosts: ", "         "))
    if len(layout.factorizations) > 1:
        lines.extend(_wrap([" and ".join(f"({', '.join(f)})" for f in layout.factorizations)],
                           "  factorizations of the ranks: ", "    "))
    lines.append("  groups along each dim:")
    for name in layout.names:
        all_groups = layout.all_groups(name)
        header = f"    {name}: {len(all_groups)} group{'s' if len(all_groups) > 1 else ''} of {layout.group_size(name)}"
        if dph is not None:
            header += f", {_span_phrase([len(hosts_of(g, dph)) for g in all_groups])}"
        lines.append(header)
        shown = all_groups if full or len(all_groups) <= _GROUPS_SHOWN else [*all_groups[:2], None, all_groups[-1]]
        tokens = ["..." if g is None else _fmt_ranks(g) for g in shown]
        lines.extend(_wrap(tokens, " " * 8, " " * 8))
    if rank is not None:
        lines.extend(_rank_view(layout, rank, dph))
    return "\n".join(lines)


def layout_document(
    layout: MeshLayout,
    *,
    rank: int | None = None,
    devices_per_host: int | None = None,
) -> dict[str, Any]:
    """The layout as a JSON-ready dict: every group in full, whatever the size.

    Keys: ``shape``, ``dim_names``, ``world_size``, ``devices_per_host``, ``num_hosts``
    (null without hosts), ``groups`` (dim name -> list of groups, ordered as
    :meth:`MeshLayout.all_groups`), ``groups_spanning_hosts`` (dim name -> how many
    of its groups cross a host boundary; only with hosts), ``warnings`` (messages of
    :func:`check_layout`) and, with ``rank``, ``rank`` (its coordinate, host, local
    rank, groups, index in each group and pipeline neighbors). A layout with flattened or split
    names also has ``flattened`` (name -> its dims and groups), and one with a second
    factorization ``factorizations`` (the dims of each).
    """
    dph = _check_devices_per_host(devices_per_host)
    groups = {name: layout.all_groups(name) for name in layout.dim_names}
    doc: dict[str, Any] = {
        "shape": list(layout.shape),
        "dim_names": list(layout.dim_names),
        "world_size": layout.world_size,
        "devices_per_host": dph,
        "num_hosts": None if dph is None else -(-layout.world_size // dph),
        "groups": groups,
    }
    if dph is not None:
        doc["groups_spanning_hosts"] = {
            name: sum(len(hosts_of(g, dph)) > 1 for g in gs) for name, gs in groups.items()
        }
    others = [n for n in layout.names if n not in layout.dim_names]
    if others:
        doc["flattened"] = {n: {"dims": list(layout.named(n).parts), "groups": layout.all_groups(n)} for n in others}
    if len(layout.factorizations) > 1:
        doc["factorizations"] = [list(f) for f in layout.factorizations]
    doc["warnings"] = [w.message for w in check_layout(layout, dph)]
    if rank is not None:
        layout.check_rank(rank)
        view: dict[str, Any] = {
            "rank": rank,
            "coordinate": dict(zip(layout.dim_names, layout.coordinate(rank))),
            "host": None if dph is None else rank // dph,
            "local_rank": None if dph is None else rank % dph,
            "groups": {n: layout.group_ranks(rank, n) for n in layout.dim_names},
            "index_in_group": {n: layout.index_in_group(rank, n) for n in layout.dim_names},
        }
        if layout.has("PP"):
            view["pipeline"] = {"previous": layout.neighbor(rank, "PP", -1), "next": layout.neighbor(rank, "PP", 1)}
        doc["rank"] = view
    return doc


# ------------------------------------------------------------------ helpers
def _check_devices_per_host(devices_per_host: int | None) -> int | None:
    if devices_per_host is None:
        return None
    if not isinstance(devices_per_host, int) or isinstance(devices_per_host, bool) or devices_per_host < 1:
        raise ValueError(f"devices per host must be a positive integer; got {devices_per_host!r}")
    return devices_per_host


def _hosts_phrase(world_size: int, dph: int | None) -> str:
    if dph is None:
        return ""
    n_hosts = -(-world_size // dph)
    phrase = f" on {n_hosts} host{'s' if n_hosts > 1 else ''} of {dph} device{'s' if dph > 1 else ''}"
    if world_size % dph:
        phrase += f" (the last uses {world_size % dph})"
    return phrase


def _span_phrase(spans: list[int]) -> str:
    crossing = [s for s in spans if s > 1]
    if not crossing:
        return "each on one host" if len(spans) > 1 else "on one host"
    lo, hi = min(crossing), max(crossing)
    count = f"{lo}" if lo == hi else f"{lo}-{hi}"
    if len(crossing) == len(spans):
        return f"each spans {count} hosts" if len(spans) > 1 else f"spans {count} hosts"
    return f"{len(crossing)} of {len(spans)} span {count} hosts"


def _fmt_hosts(hosts: list[int]) -> str:
    if len(hosts) > 3 and hosts == list(range(hosts[0], hosts[-1] + 1)):
        return f"{hosts[0]}-{hosts[-1]}"
    return ", ".join(map(str, hosts))


def _fmt_ranks(ranks: Sequence[int]) -> str:
    """``[0, 4]``; runs of more than 4 evenly spaced ranks as ``[0..7]`` or ``[0..56 step 8]``."""
    if len(ranks) > 4:
        step = ranks[1] - ranks[0]
        if all(b - a == step for a, b in zip(ranks, ranks[1:])):
            return f"[{ranks[0]}..{ranks[-1]}" + (f" step {step}]" if step != 1 else "]")
        if len(ranks) > 8:
            return "[" + ", ".join(map(str, ranks[:3])) + f", ... {ranks[-1]}] ({len(ranks)} ranks)"
    return "[" + ", ".join(map(str, ranks)) + "]"


def _wrap(tokens: list[str], first: str, rest: str, width: int = WIDTH) -> list[str]:
    """Join ``tokens`` with spaces after ``first``, going on after ``rest`` past ``width`` columns."""
    lines: list[str] = []
    line, empty = first, True
    for token in tokens:
        if not empty and len(line) + 1 + len(token) > width:
            lines.append(line)
            line = rest + token
        else:
            line += token if empty else " " + token
        empty = False
    lines.append(line)
    return lines


def _grid(layout: MeshLayout, dph: int | None) -> list[str]:
    """Rows of global ranks: the last dim runs across, the next-to-last down, outer dims as blocks.

    With hosts, ``hN`` before a rank marks the first rank of host N: in a left
    column at the start of a line, after ``|`` inside one. Rows too wide for 80
    columns break at host boundaries, else after a power-of-two number of ranks.
    """
    width = len(str(layout.world_size - 1))
    inner = layout.shape[-1]
    rows = layout.shape[-2] if layout.ndim >= 2 else 1
    host_size = dph if dph is not None else layout.world_size
    marked = host_size < layout.world_size  # more than one host: mark where each starts
    label_width = len(f"h{(layout.world_size - 1) // host_size}") + 1 if marked else 0
    lines: list[str] = []
    outer = itertools.product(*(range(s) for s in layout.shape[:-2]))
    for block, prefix in enumerate(outer):
        indent = "    "
        if prefix:
            lines.append(indent + ", ".join(f"{n}={c}" for n, c in zip(layout.dim_names, prefix)) + ":")
            indent += "  "
        room = WIDTH - len(indent) - label_width
        per_line = 1 << max(0, (room + 1) // (width + 1)).bit_length() - 1  # ranks on a line, a power of two
        for row in range(rows):
            first = (block * rows + row) * inner
            # units: (host label or "", ranks), split at host starts, none wider than a line
            units: list[tuple[str, list[int]]] = []
            for r in range(first, first + inner):
                starts_host = marked and r % host_size == 0
                if not units or starts_host or len(units[-1][1]) == per_line:
                    units.append((f"h{r // host_size}" if starts_host else "", []))
                units[-1][1].append(r)
            line = ""
            for label, ranks in units:
                cells = " ".join(str(r).rjust(width) for r in ranks)
                piece = f" | {label} {cells}" if label else f" {cells}"
                if line and len(line) + len(piece) <= WIDTH:
                    line += piece
                    continue
                if line:
                    lines.append(line)
                line = indent + label.ljust(label_width) + cells
            lines.append(line)
    return lines


def _rank_view(layout: MeshLayout, rank: int, dph: int | None) -> list[str]:
    coord = ", ".join(f"{n}={c}" for n, c in zip(layout.dim_names, layout.coordinate(rank)))
    host = "" if dph is None else f"; host {rank // dph}, local rank {rank % dph}"
    lines = [f"  rank {rank}: {coord}{host}"]
    for name in layout.names:
        members = layout.group_ranks(rank, name)
        lines.extend(_wrap(
            [f"{name} group", _fmt_ranks(members), f"(index {layout.index_in_group(rank, name)})"], "    ", "      "
        ))
    if layout.has("PP"):
        prev, nxt = layout.neighbor(rank, "PP", -1), layout.neighbor(rank, "PP", 1)
        before = "none (first stage)" if prev is None else f"rank {prev}"
        after = "none (last stage)" if nxt is None else f"rank {nxt}"
        lines.append(f"    pipeline: previous stage {before}, next stage {after}")
    return lines
