"""Before a replica joins the live ones: is its id free, and can a step run with one more?

torchft's lighthouse lets any process into the quorum, so a second process started as replica 1 while
replica 1 is alive joins as a third participant, and every replica then fails on a count nobody planned
for. :func:`join_refusal` reads the lighthouse's ``/status`` page (the heartbeats it holds) before the
Manager is built, so such a replica is turned away at its own join, and the live ones never see it.
"""

from __future__ import annotations

import math
import re
import time
import urllib.request
from collections.abc import Callable

__all__ = ["LIVE_S", "join_refusal", "live_replicas"]

#: A replica id heartbeating more recently than this is alive (torchft's managers heartbeat every 100 ms).
LIVE_S = 1.0
_HEARTBEAT = re.compile(r"(\d+):[^:\s<]*:\s*seen\s+([0-9.eE+-]+)\s*(ns|µs|us|ms|s)\s+ago")
_UNIT = {"ns": 1e-9, "µs": 1e-6, "us": 1e-6, "ms": 1e-3, "s": 1.0}


def live_replicas(lighthouse: str, timeout: float) -> dict[int, float] | None:
    """Replica ids heartbeating at the lighthouse, with seconds since each was last seen (its ``/status`` page);
    None if the page cannot be read (the Manager's own connection then says what is wrong)."""
    try:
        with urllib.request.urlopen(lighthouse.rstrip("/") + "/status", timeout=timeout) as page:
            text = page.read().decode("utf-8", "replace")
    except (OSError, ValueError):
        return None
    seen: dict[int, float] = {}
    for rid, value, unit in _HEARTBEAT.findall(text):
        ago = float(value) * _UNIT[unit]
        seen[int(rid)] = min(ago, seen.get(int(rid), ago))
    return seen


def join_refusal(lighthouse: str, replica_id: int, admits: Callable[[int], str | None] | None,
                 timeout: float) -> str | None:
    """Why ``replica_id`` must not join the replicas at ``lighthouse``, or None: its id is live already (another
    process started with it), or ``admits`` refuses the count it would make. A dead process of the same id (a
    replica that is coming back) is not live: its heartbeat is looked at twice, 1.5 s apart."""
    seen = live_replicas(lighthouse, timeout)
    if seen is None:
        return None
    if seen.get(replica_id, math.inf) < LIVE_S:  # alive, or a process of this id that has just died: look again
        time.sleep(1.5 * LIVE_S)
        seen = live_replicas(lighthouse, timeout) or {}
        if seen.get(replica_id, math.inf) < LIVE_S:
            live = sorted(r for r, ago in seen.items() if ago < LIVE_S)
            return (
                f"replica {replica_id}: another process is already live as replica {replica_id} at the lighthouse "
                f"{lighthouse} (heartbeat {seen[replica_id]:.2f}s ago); live replica ids: {live}. Start this one with "
                f"a replica id no live replica has (such as {max(live) + 1}), or stop the other first"
            )
    live = {r for r, ago in seen.items() if ago < LIVE_S} | {replica_id}
    reason = admits(len(live)) if admits is not None else None
    if reason:
        return (
            f"replica {replica_id}: not joining, since {len(live)} replicas would take part ({sorted(live)}) and "
            f"{reason}; the live replicas go on without it"
        )
    return None
