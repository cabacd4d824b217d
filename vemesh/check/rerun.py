"""A parallel run that the machine broke, not the plan, run again once.

On a loaded machine a rank of the parallel run can end by a signal without writing a word: gloo aborts it when its
background thread loses a connection, or the kernel kills it. The other ranks then raise gloo's transport errors
("Connection reset by peer", "Connection closed by peer"), and a check that said DIFFERS would blame the plan.
:func:`run_once_more` runs the parallel run again, once, where that is all that went wrong, and says so in the
result (``reruns`` of :class:`~vemesh.check.result.CheckResult`). A plan that itself breaks gloo (a collective of
another size on each rank) breaks it again, and the check says that it did.
"""

from __future__ import annotations

import shutil
import signal
from pathlib import Path

from vemesh.check.run import Spec, errors, run_parallel

__all__ = ["TRANSPORT", "broken_by_the_machine", "run_once_more"]

#: what gloo's transport says when a connection to a rank that ended is lost
TRANSPORT = ("Connection reset by peer", "Connection closed by peer", "Connection refused", "Broken pipe")


def broken_by_the_machine(out: str, exits: dict[int, int | None]) -> str | None:
    """What broke the run whose files are in ``out`` (its ranks' exit codes: ``exits``), where it is to be run
    again, or None: a rank ended by a signal other than the check's own SIGTERM, writing neither its record nor its
    error, and every error the other ranks wrote is one of gloo's transport's (:data:`TRANSPORT`)."""
    gone = {r: -c for r, c in exits.items() if c is not None and c < 0 and c != -signal.SIGTERM
            and not Path(out, f"rank{r}.pt").exists() and not Path(out, f"error{r}.json").exists()}
    failed = [e["message"] for e in errors(out)]
    lost = sorted({t for m in failed for t in TRANSPORT if t in m})
    if not gone or not failed or not all(any(t in m for t in TRANSPORT) for m in failed):
        return None
    ended = ", ".join(f"rank {r} by {_signal_name(s)}" for r, s in sorted(gone.items()))
    return f"{ended} ended without a result or an error, and the others lost their gloo connections ({'; '.join(lost)})"


def run_once_more(spec: Spec, out: str) -> tuple[list[int], list[str]]:
    """:func:`~vemesh.check.run.run_parallel` of ``spec`` into ``out``, and again, once, where the machine may have
    broken the first (:func:`broken_by_the_machine`); the ranks the last run stopped, and what the check says of a
    run again (none: ``[]``)."""
    stopped, exits = run_parallel(spec, out)
    first = broken_by_the_machine(out, exits)
    if first is None:
        return stopped, []
    for path in Path(out).iterdir():  # a fresh store, and no record or error of the first run
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    stopped, exits = run_parallel(spec, out)
    if broken_by_the_machine(out, exits) is None:
        return stopped, [f"the parallel run was run again, once: in the first, {first}, as gloo's abort or the "
                         "kernel's kill on a loaded machine can make them"]
    return stopped, [f"the parallel run was run again, once, and ended the same way ({first}): not the machine's "
                     "doing, but the plan's or the step's"]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
