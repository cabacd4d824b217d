"""What hung, in mesh terms: the dim, the group's ranks and coordinates, who never came, where they are.

:func:`diagnose` reads a :class:`~vemesh.hangs.dumps.Job` (every rank's recorded collectives,
stacks and groups) and finds

* **stuck collectives**: a group's collective number that some member entered and has not
  finished; the members that never entered it are *missing*, and for each the report gives its
  last finished collective and the innermost frames of its stack in user code;
* **mismatches** (torch's "desync"): members that entered different ops, or different sizes,
  under the same collective number of the same group;
* **dead ranks**: a rank with no dump, and what ``faulthandler`` wrote if it was killed.

The first cause is put first: a missing rank that waits in no collective itself (it is in compute,
or went ahead) explains the groups that wait on it, and those are listed as held up by it.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from vemesh.hangs.dumps import Entry, Group, Job, load

__all__ = ["Diagnosis", "Stuck", "diagnose", "load", "user_frames"]

_SKIP = tuple(str(Path(p).resolve()) + os.sep for p in {sysconfig.get_paths()["stdlib"], sysconfig.get_paths()["purelib"],
                                                           sysconfig.get_paths()["platlib"]})
#: Ops whose inputs are the same size on every member (scatter, gather and all-to-all may differ, legitimately).
_SAME_SIZES = {"all-reduce", "allreduce", "broadcast", "all-gather", "allgather", "all-gather-into-tensor",
               "allgather-into-tensor-coalesced", "reduce-scatter", "reduce-scatter-tensor", "reduce", "barrier"}
_VEMESH = str(Path(__file__).resolve().parents[1]) + os.sep


def user_frames(stack: list[list[Any]], n: int = 3) -> list[list[Any]]:
    """The innermost ``n`` frames of ``stack`` (outermost first) outside torch, vemesh and the standard library."""
    mine = []
    for frame in stack:
        path = str(Path(frame[0]).resolve()) if not str(frame[0]).startswith("<") else str(frame[0])
        if path.startswith(_VEMESH) or path.startswith("<") or any(path.startswith(s) for s in _SKIP):
            continue
        mine.append(frame)
    return mine[-n:]


def _where(frame: list[Any]) -> str:
    path = frame[0]
    try:
        path = os.path.relpath(path)
    except ValueError:
        pass
    if path.startswith(".."):
        path = frame[0]
    code = f": {frame[3]}" if len(frame) > 3 and frame[3] else ""
    return f"{path}:{frame[1]} in {frame[2]}{code}"


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} B"


@dataclass
class Stuck:
    """One group's collective that some members entered and did not finish."""

    group: Group
    seq: int
    op: str
    entries: dict[int, Entry]  # the members that entered it
    missing: list[int]  # members that never entered it (their dumps show they did not)
    silent: list[int]  # members with no dump: unknown
    first_ns: int
    mismatch: bool = False
    went_past: dict[int, str] = field(default_factory=dict)  # missing rank -> how it is known to have skipped this one

    @property
    def root(self) -> bool:
        return bool(self.missing or self.silent or self.mismatch)


@dataclass
class Diagnosis:
    job: Job
    stuck: list[Stuck] = field(default_factory=list)  # the first cause first
    mismatches: list[Stuck] = field(default_factory=list)
    dead: list[int] = field(default_factory=list)

    # ------------------------------------------------------------------ text
    def _collective(self, s: Stuck) -> str:
        e = next(iter(s.entries.values()))
        step = self.job.ranks[e.rank].step_at(e.time_ns)
        at = f" at step {step}" if step is not None else ""
        data = f" ({_size(e.nbytes)}, {e.shape_text()})" if e.sizes else ""  # a barrier has no tensor
        return f"{s.group.dim} {s.op} #{s.seq}{data}{at}"

    def _group(self, g: Group) -> str:
        job = self.job
        fixed = ""
        if job.layout is not None and g.dim != "world":
            coords = [job.layout.coordinate(r) for r in g.ranks]
            same = {n: c for n, c in coords[0].items() if all(x[n] == c for x in coords)}
            fixed = " (" + ", ".join(f"{n}={c}" for n, c in same.items()) + ")" if same else ""
        return f"{g.dim} {g.ranks}{fixed}" if g.dim.startswith("group ") else f"the {g.dim} group {g.ranks}{fixed}"

    def _last_done(self, rank: int) -> str:
        done = [e for e in self.job.ranks[rank].entries if e.done and not e.p2p]
        if not done:
            return "none recorded"
        e = max(done, key=lambda x: x.time_ns)
        return f"{self.job.group_of(rank, e.pg).dim} {e.op} #{e.seq}"

    def _now(self, rank: int) -> list[str]:
        dump = self.job.ranks[rank]
        waiting = [e for e in dump.entries if not e.done and not e.p2p]
        lines = []
        if waiting:
            e = min(waiting, key=lambda x: x.time_ns)
            lines.append(f"it waits in {self.job.group_of(rank, e.pg).dim} {e.op} #{e.seq} itself")
        main = next((s for s in dump.stacks if s.get("main")), None)
        if dump.ended and not waiting:
            last = dump.steps[-1][1] if dump.steps else None
            lines.append("it ended its program" + (f" (the last step it marked: {last})" if last is not None else ""))
        elif dump.exception:
            lines.append("it raised: " + dump.exception.strip().splitlines()[-1][:300])
        elif main is not None:
            frames = user_frames(main["frames"])
            doing = "in a collective" if waiting else "not in any collective (in compute)"
            lines.append(f"it is {doing}, at " + (_where(frames[-1]) if frames else "(no frame in user code)"))
            lines += [f"    called from {_where(f)}" for f in reversed(frames[:-1])]
        return lines

    def _dead(self, rank: int) -> list[str]:
        """A rank with no dump: what killed it, where, and what its groups' live members entered last."""
        job, fatal = self.job, self.job.ranks[rank].fatal
        out = [f"DIED: rank {rank} ({job.coordinate_text(rank)}): " + (fatal.splitlines()[0] if fatal else
                                                                       "wrote no dump and no fatal-error file")]
        frames = _fatal_frames(fatal)
        if frames:
            out.append(f"  it was at {frames[0]}")
        if fatal and "Aborted" in fatal:
            out.append("  (gloo aborts a rank that receives more bytes than its own collective posted: the ranks of "
                       "one collective gave different sizes)")
        shown = set()
        for other in job.ranks.values():
            for g in other.groups.values():
                if rank not in g.ranks or g.dim == "world" or (g.name, tuple(g.ranks)) in shown:
                    continue
                shown.add((g.name, tuple(g.ranks)))
                for peer in g.ranks:
                    mine = [e for e in job.ranks[peer].entries if e.pg == g.name and not e.p2p]
                    if peer == rank or not mine:
                        continue
                    e = max(mine, key=lambda x: x.seq)
                    before = [x for x in mine if x.op == e.op and x.seq < e.seq]
                    changed = (f" (its {e.op} #{before[-1].seq} was {before[-1].shape_text()})"
                               if before and before[-1].sizes != e.sizes else "")
                    out.append(f"  in {self._group(g)}, rank {peer} last entered {g.dim} {e.op} #{e.seq} of "
                               f"{e.shape_text()}{changed}")
        return out

    def text(self) -> str:
        job, out = self.job, []
        source = "torch's own Flight Recorder dumps" if job.source == "torch" else "vemesh hang dumps"
        dumped = sum(1 for d in job.ranks.values() if d.dumped)
        out.append(f"{source}: {dumped} of {job.world_size} ranks" + (f"; mesh {dict(zip(job.layout.dim_names, job.layout.shape))}"
                                                                       if job.layout else ""))
        if job.older:
            out.append(f"(the directory also holds {job.older} dumps of an older run, left out)")
        for s in self.mismatches:
            out.append(f"MISMATCH in {self._group(s.group)} at its collective #{s.seq}: the ranks entered different ones")
            steps = {r: job.ranks[r].step_at(e.time_ns) for r, e in s.entries.items()}
            for r, e in sorted(s.entries.items()):
                at = f" at step {steps[r]}" if steps[r] is not None else ""
                out.append(f"  rank {r} ({job.coordinate_text(r)}): {e.op} of {e.shape_text()} ({_size(e.nbytes)}){at}")
            if None not in steps.values() and len(set(steps.values())) > 1:
                late = sorted(r for r, st in steps.items() if st == max(steps.values()))
                out.append(f"  rank(s) {late} reached #{s.seq} a step later: they skipped a {s.group.dim} collective "
                           f"of step {min(steps.values())} (or the others ran one more)")
        ended = sorted(r for r, d in job.ranks.items() if d.ended)
        if ended and len(ended) < job.world_size:  # a healthy run's ranks all end, each dumping at its exit
            last = {r: job.ranks[r].steps[-1][1] for r in ended if job.ranks[r].steps}
            out.append(f"ENDED: rank {', '.join(map(str, ended))} ended {'its' if len(ended) == 1 else 'their'} program "
                       "normally while the others still had collectives to run" + (
                           f" (the last step marked: {', '.join(f'{s} on rank {r}' for r, s in last.items())})"
                           if last else "") + ": a rank that runs fewer collectives than its peers ends first, and "
                       "they wait on it (gloo's peers fail as its connections close)")
        for r in self.dead:
            out += self._dead(r)
        for i, s in enumerate(self.stuck):
            if i == 1:
                out.append("held up by the above:")
            head = "HANG: " if i == 0 else "  "
            first = datetime.fromtimestamp(s.first_ns / 1e9).strftime("%H:%M:%S")
            out.append(f"{head}{self._collective(s)} is stuck in {self._group(s.group)}, since {first}")
            ind = "  " if i == 0 else "    "
            out.append(f"{ind}entered: " + ", ".join(f"rank {r}" for r in sorted(s.entries)))
            for r in s.missing + s.silent:
                out.append(f"{ind}never entered: rank {r} ({job.coordinate_text(r)})" + ("" if r in s.missing else
                                                                                          ", which wrote no dump"))
                if r in s.went_past:
                    out.append(f"{ind}  {s.went_past[r]}")
                if i == 0 and job.ranks[r].dumped:
                    out.append(f"{ind}  rank {r}'s last finished collective: {self._last_done(r)}")
                    out += [f"{ind}  {line}" for line in self._now(r)]
            if i >= 6 and len(self.stuck) > 8:
                out.append(f"  ... and {len(self.stuck) - i - 1} more")
                break
        if not (self.stuck or self.mismatches or self.dead):
            out.append("no collective is stuck and no rank is missing: every recorded collective finished on every member")
        return "\n".join(out)

    def as_dict(self) -> dict[str, Any]:
        job = self.job

        def stuck(s: Stuck) -> dict[str, Any]:
            e = next(iter(s.entries.values()))
            return {
                "dim": s.group.dim, "group": s.group.ranks, "process_group": s.group.name, "op": s.op, "seq": s.seq,
                "bytes": e.nbytes, "sizes": {r: x.sizes for r, x in s.entries.items()},
                "step": job.ranks[e.rank].step_at(e.time_ns), "entered": sorted(s.entries), "missing": s.missing,
                "no_dump": s.silent, "mismatch": s.mismatch,
                "coordinates": {r: job.layout.coordinate(r) for r in s.group.ranks} if job.layout else {},
                "missing_ranks": {r: {"last_finished": self._last_done(r), "now": self._now(r)}
                                  for r in s.missing if job.ranks[r].dumped},
            }

        return {"source": job.source, "world_size": job.world_size,
                "mesh": dict(zip(job.layout.dim_names, job.layout.shape)) if job.layout else None,
                "stuck": [stuck(s) for s in self.stuck], "mismatches": [stuck(s) for s in self.mismatches],
                "dead": {r: job.ranks[r].fatal.splitlines()[0] if job.ranks[r].fatal else "" for r in self.dead}}


def _fatal_frames(text: str) -> list[str]:
    """The innermost user frame of faulthandler's current-thread stack (``File "x.py", line 3 in f``)."""
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line.startswith('File "'):
            path, _, rest = line[6:].partition('", line ')
            lineno, _, func = rest.partition(" in ")
            if user_frames([[path, lineno, func]], 1):
                out.append(_where([path, lineno, func]))
        elif out and line == "":
            break
    return out[:1]


def _went_past(job: Job, s: Stuck, rank: int) -> str:
    """How ``rank`` is known to have skipped ``s``: it waits in a collective that, the step before, it entered
    only after as many collectives of ``s``'s group as it has entered now (so one of this step's is missing)."""
    dump = job.ranks[rank]
    waiting = [e for e in dump.entries if not e.done and not e.p2p]
    entered = next(iter(s.entries.values()))
    step = job.ranks[entered.rank].step_at(entered.time_ns)
    if not waiting or step is None or step < 2:
        return ""
    w = min(waiting, key=lambda e: e.time_ns)
    if dump.step_at(w.time_ns) != step:
        return ""
    at = {k: [e for e in dump.entries if dump.step_at(e.time_ns) == k and not e.p2p] for k in (step - 1, step)}
    nth = sum(1 for e in at[step] if e.pg == w.pg and e.op == w.op and e.time_ns < w.time_ns)  # w is the nth such
    prev_w = [i for i, e in enumerate(at[step - 1]) if e.pg == w.pg and e.op == w.op]
    if len(prev_w) <= nth:
        return ""
    before_then = sum(1 for e in at[step - 1][:prev_w[nth]] if e.pg == s.group.name)
    before_now = sum(1 for e in at[step] if e.pg == s.group.name and e.time_ns < w.time_ns)
    if before_now >= before_then:
        return ""
    dim = job.group_of(rank, w.pg).dim
    return (f"it waits in {dim} {w.op} #{w.seq}, which at step {step - 1} it entered after {before_then} "
            f"{s.group.dim} collectives; at step {step} it entered only {before_now} before it: it skipped one")


def diagnose(job: Job) -> Diagnosis:
    """Find the stuck collectives, the mismatches and the dead ranks of ``job``."""
    diag = Diagnosis(job)
    by_group: dict[tuple[str, tuple[int, ...]], dict[int, dict[int, Entry]]] = {}
    for dump in job.ranks.values():
        for e in dump.entries:
            if e.p2p:
                continue
            g = job.group_of(dump.rank, e.pg)
            by_group.setdefault((e.pg, tuple(g.ranks)), {}).setdefault(dump.rank, {})[e.seq] = e
    waiting_ranks = {d.rank for d in job.ranks.values() if any(not e.done and not e.p2p for e in d.entries)}
    for (pg, members), seen in by_group.items():
        group = job.group_of(next(iter(seen)), pg)
        for seq in sorted({s for per in seen.values() for s in per}):  # the first mismatch of the group: the cause
            at = {r: per[seq] for r, per in seen.items() if seq in per}
            steps = {r: job.ranks[r].step_at(e.time_ns) for r, e in at.items()}
            kinds = {(e.op, tuple(map(tuple, e.sizes)) if e.op in _SAME_SIZES else (), steps[r] if None not in steps.values()
                      else 0) for r, e in at.items()}
            if len(at) > 1 and len(kinds) > 1:
                diag.mismatches.append(Stuck(group, seq, "mismatch", at, [], [], min(e.time_ns for e in at.values()), True))
                break
        pending = [min(e.seq for e in per.values() if not e.done) for per in seen.values() if any(not e.done for e in per.values())]
        if not pending:
            continue
        seq = min(pending)
        at = {r: per[seq] for r, per in seen.items() if seq in per}
        missing = [r for r in members if r not in at and job.ranks[r].dumped and max(seen.get(r, {0: None}), default=0) < seq]
        silent = [r for r in members if r not in at and not job.ranks[r].dumped]
        op = next(iter(at.values())).op
        diag.stuck.append(Stuck(group, seq, op, at, missing, silent, min(e.time_ns for e in at.values())))
    for s in diag.stuck:
        for r in s.missing:
            why = _went_past(job, s, r)
            if why:
                s.went_past[r] = why
    # the first cause first: a rank that went past the collective (it skipped it), then a group waiting on a rank
    # that waits on nothing itself, then the earliest step, then the collective that rank would have entered next
    # (several groups can wait on it, their first entries a race of milliseconds apart), then the earliest time
    def step(s: Stuck) -> int:
        e = next(iter(s.entries.values()))
        found = job.ranks[e.rank].step_at(e.time_ns)
        return found if found is not None else 1 << 62

    def expected(s: Stuck) -> bool:  # the collective a missing rank would have entered next, by its own history
        return any(_next_of(job, r) == (s.group.name, s.op) for r in s.missing)

    diag.stuck.sort(key=lambda s: (not s.went_past, not any(r not in waiting_ranks for r in s.missing + s.silent),
                                   not s.root, step(s), not expected(s), s.first_ns))
    diag.dead = sorted(r for r, d in job.ranks.items() if not d.dumped and (d.fatal or job.source == "vemesh"))
    return diag


def _next_of(job: Job, rank: int) -> tuple[str, str] | None:
    """``(group, op)`` of the collective ``rank`` would have entered next, from its own record: what followed the
    longest earlier run of collectives equal to the run it ended with (the same point of an earlier step); None
    when no earlier run matches."""
    mine = [(e.pg, e.op) for e in sorted((e for e in job.ranks[rank].entries if not e.p2p), key=lambda e: e.time_ns)]
    for k in range(min(8, len(mine) - 1), 0, -1):
        tail = mine[-k:]
        for end in range(len(mine) - 2, k - 2, -1):  # the latest earlier run first
            if mine[end - k + 1:end + 1] == tail:
                return mine[end + 1]
    return None


def diagnose_dir(directory: str | Path, shape: tuple[int, ...] | None = None,
                 dim_names: tuple[str, ...] | None = None) -> Diagnosis:
    return diagnose(load(directory, shape, dim_names))
