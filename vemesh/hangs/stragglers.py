"""Stragglers, the soft hang: per mesh dim, which rank enters the group's collectives last, and by how much.

From the recorder's entry times (``time_created_ns``: each host's wall clock, so comparable on one
host, and across hosts only as well as their clocks agree, about a millisecond under NTP). For each
collective that every member of its group recorded, the last member in is *behind* by its time
minus the median time of the others.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

from vemesh.hangs.dumps import Entry, Job

__all__ = ["DimStragglers", "stragglers", "stragglers_text"]


@dataclass
class DimStragglers:
    dim: str
    ops: list[str]
    collectives: int = 0
    last: dict[int, int] = field(default_factory=dict)  # rank -> how many it was last into
    behind_ms: dict[int, list[float]] = field(default_factory=dict)  # rank -> how far behind, when last
    seen: dict[int, int] = field(default_factory=dict)  # rank -> how many it took part in
    per_step: dict[int, dict[int, float]] = field(default_factory=dict)  # rank -> step -> most ms behind in it

    def worst(self) -> tuple[int, float, float] | None:
        """(rank, fraction of its collectives it was last into, median ms behind) of the rank that held its groups
        up longest in all: with marked steps, the sum over steps of the longest it held a group up in each (a rank
        slow in compute is late into the step's first collective only, and the rest follow in lockstep); without,
        the sum over the collectives it was last into. The median is over those steps, or those collectives. A rank
        late once by much (a slow start on a loaded host: 236 ms into the first DP all-reduce of a CI run) is not
        the straggler that is 50 ms late into every other one."""
        if not self.last:
            return None
        def held(r: int) -> float:
            steps = self.per_step.get(r)
            return sum(steps.values()) if steps else sum(self.behind_ms[r])

        rank = max(self.last, key=held)
        steps = self.per_step.get(rank, {})
        behind = statistics.median(steps.values()) if steps else statistics.median(self.behind_ms[rank])
        return rank, self.last[rank] / self.seen[rank], behind

    def line(self) -> str:
        worst = self.worst()
        if worst is None:
            return f"{self.dim}: no collective recorded by every member of its group"
        rank, share, behind = worst
        ops = "/".join(self.ops)
        per = (f"per step (median of {len(self.per_step[rank])} steps)" if self.per_step.get(rank) else
               "(median over the collectives it was last into)")
        return (f"{self.dim}: rank {rank} is last into {share:.0%} of its {self.dim} {ops}s ({self.last[rank]} of "
                f"{self.seen[rank]}), {behind:.0f} ms behind the others {per}")

    def as_dict(self) -> dict[str, Any]:
        worst = self.worst()
        return {"dim": self.dim, "ops": self.ops, "collectives": self.collectives,
                "rank": worst[0] if worst else None, "last_fraction": worst[1] if worst else None,
                "median_behind_ms": worst[2] if worst else None,
                "per_rank": {r: {"collectives": self.seen[r], "last": self.last.get(r, 0),
                                 "median_behind_ms": statistics.median(self.behind_ms[r]) if self.behind_ms.get(r) else 0.0}
                             for r in sorted(self.seen)}}


def stragglers(job: Job, since_ns: int = 0) -> list[DimStragglers]:
    """Per dim (in the order first seen), who is last into the collectives entered after ``since_ns``."""
    sets: dict[tuple[str, tuple[int, ...], int], dict[int, Entry]] = {}
    dims: dict[tuple[str, tuple[int, ...], int], str] = {}
    for dump in job.ranks.values():
        for e in dump.entries:
            if e.p2p or e.time_ns < since_ns:
                continue
            g = job.group_of(dump.rank, e.pg)
            key = (e.pg, tuple(g.ranks), e.seq)
            sets.setdefault(key, {})[dump.rank] = e
            dims[key] = g.dim
    full = {k: at for k, at in sets.items() if len(k[1]) > 1 and set(at) == set(k[1])}
    last_in = {k: max(e.time_ns for e in at.values()) for k, at in full.items()}
    before: dict[tuple[int, tuple[str, tuple[int, ...], int]], Any] = {}  # (rank, key) -> its previous key
    for rank in {r for at in full.values() for r in at}:
        mine = sorted((at[rank].time_ns, k) for k, at in full.items() if rank in at)
        for (_, prev), (_, key) in zip(mine, mine[1:]):
            before[(rank, key)] = prev
    out: dict[str, DimStragglers] = {}
    for key, at in full.items():
        ops = sorted({e.op for e in at.values()})
        d = out.setdefault(dims[key], DimStragglers(dims[key], []))
        d.ops = sorted(set(d.ops) | set(ops))
        d.collectives += 1
        for r in at:
            d.seen[r] = d.seen.get(r, 0) + 1
            d.behind_ms.setdefault(r, [])
        last = max(at, key=lambda r: at[r].time_ns)
        behind = (at[last].time_ns - statistics.median(e.time_ns for r, e in at.items() if r != last)) / 1e6
        prev = before.get((last, key))
        if prev is not None and (last_in[prev] - full[prev][last].time_ns) / 1e6 >= behind / 2:
            continue  # late because it waited in its previous collective for someone else: not its own lateness
        d.last[last] = d.last.get(last, 0) + 1
        d.behind_ms[last].append(behind)
        step = job.ranks[last].step_at(at[last].time_ns)
        if step is not None:
            steps = d.per_step.setdefault(last, {})
            steps[step] = max(steps.get(step, 0.0), behind)
    return list(out.values())


def stragglers_text(job: Job, since_ns: int = 0) -> str:
    found = stragglers(job, since_ns)
    hosts = {d.host for d in job.ranks.values() if d.host}
    head = (f"stragglers over {len(job.ranks)} ranks" + (f" on {len(hosts)} hosts (entry times compare only as well as "
                                                         "their clocks agree)" if len(hosts) > 1 else ""))
    return "\n".join([head] + ["  " + d.line() for d in found if d.dim != "world"] or ["  no collectives recorded"])
