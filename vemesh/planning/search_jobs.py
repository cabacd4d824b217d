"""The meshes a search plans: which it tries (:func:`variants` of the job on each, :func:`static_over` for those whose
weights alone cannot fit), and in how many processes at once (``vemesh plan --jobs N``).

Each mesh of a search is planned on its own (its traces, or its static bytes), so the meshes can be planned apart:
:func:`run` gives each of ``N`` worker processes the next mesh not yet planned, and returns the plans in the order of
the meshes, as one process would have made them. A worker keeps what it built for the meshes it planned before (the
model's template, its pipeline replays' records: :func:`~vemesh.planning.pipeline_plan.shared_records`), as one
process does for all of them; a plan's figures do not depend on which meshes were planned before it in the same
process, only its note of how many actions it replayed does (``test_a_search_in_two_processes_is_the_search_in_one``).

The workers start as :mod:`vemesh.local_ranks` starts ranks: forked from a server that imported torch once, where
the system has one, else spawned; each imports the planner once, and then plans mesh after mesh. The job travels to
them by pickle: the CLI's job names its functions (``MODULE:FUNCTION``), and the Python API's functions must be
importable by name.
"""

from __future__ import annotations

import contextlib
import logging
import logging.handlers
import multiprocessing
import pickle
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import replace
from typing import Any

from vemesh import local_ranks
from vemesh.planning.estimate import check_degrees, load_model, rank_static, stage_keys
from vemesh.planning.pipeline_plan import shared_records
from vemesh.planning.results import NOT_PLANNED, MeshFit, RankClass

__all__ = ["gib", "not_searched", "run", "static_over", "variants"]

#: what each worker imports before its first mesh (the planner, and through it torch), in the server where there is one
PRELOAD = ("vemesh.planning.fit",)

#: a worker's pipeline records, kept from its first mesh to its last (:func:`_worker`)
_KEPT = contextlib.ExitStack()


def run(fn: Callable[..., Any], tasks: list[tuple], jobs: int,
        cost: Callable[[tuple], Any] | None = None) -> list[Any]:
    """``[fn(*task) for task in tasks]``, in ``jobs`` processes at once when ``jobs > 1`` (see the module
    docstring). An exception of ``fn`` is raised here, as it would be in one process. ``cost``: a task's expected
    cost (any sortable); in processes, the costliest are handed out first (then in their order), so that a long task
    does not start last and run alone while the other processes wait (the longest-first rule of scheduling)."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"--jobs must be a positive integer (the processes that plan a search's meshes at once); "
                         f"got {jobs!r}")
    if jobs == 1 or len(tasks) < 2:
        return [fn(*task) for task in tasks]
    try:
        pickle.dumps((fn, tasks))
    except (pickle.PicklingError, AttributeError, TypeError) as e:
        raise ValueError(f"--jobs {jobs}: the job cannot travel to another process ({e}); give its functions as "
                         "MODULE:FUNCTION, or functions importable by name, or plan with --jobs 1") from None
    how = local_ranks.method()
    context = multiprocessing.get_context(how)
    if how == "forkserver":  # no effect once the server runs: it keeps what it imported
        context.set_forkserver_preload([*local_ranks.PRELOAD, *PRELOAD])
    log = logging.getLogger("vemesh.planning")
    lines = context.Queue()  # the workers' progress lines, told here through this process's own handlers
    relay = logging.handlers.QueueListener(lines, _Relay())
    relay.start()
    try:
        with ProcessPoolExecutor(max_workers=min(jobs, len(tasks)), mp_context=context, initializer=_worker,
                                 initargs=(log.getEffectiveLevel(), lines)) as pool:
            order = sorted(range(len(tasks)), key=lambda i: cost(tasks[i]), reverse=True) if cost else \
                range(len(tasks))
            futures = {i: pool.submit(fn, *tasks[i]) for i in order}
            return [futures[i].result() for i in range(len(tasks))]
    except BrokenProcessPool as e:  # not a mesh's own error (those are raised as they are, above)
        raise RuntimeError(
            f"--jobs {jobs}: a search's process ended abruptly: killed (out of memory?), or it ended while it started: "
            "each starts by importing your main script again (Python's multiprocessing), so a script that calls "
            "plan() at its top level must call it under `if __name__ == \"__main__\":` (or plan with jobs=1)") from e
    finally:
        relay.stop()


class _Relay(logging.Handler):
    """A worker's log record, handled here as if this process had logged it (its handlers, its stderr)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger(record.name).handle(record)


def _worker(level: int, lines: Any) -> None:
    """A worker's start: the planner's progress lines sent to the caller at its level (a worker's own stderr is the
    one its server started with, not the caller's now), and one
    :func:`~vemesh.planning.pipeline_plan.shared_records` for every mesh it plans."""
    log = logging.getLogger("vemesh.planning")
    log.handlers[:] = [logging.handlers.QueueHandler(lines)]
    log.propagate = False
    log.setLevel(level)
    _KEPT.enter_context(shared_records())


def variants(job: Any, choose: tuple[str, ...], per_dp: int) -> list[Any]:
    """The jobs a search tries on one mesh, in the order it prefers them: ``job`` alone, or with ``choose`` each
    micro-batch size from the DP rank's whole share down by halves to 1 (``micro-batch-size``), without activation
    checkpointing and then with it (``activation-checkpointing``)."""
    sizes = [job.micro_batch_size]
    if "micro-batch-size" in choose and per_dp:
        sizes, size = [], per_dp
        while size % 2 == 0:
            sizes.append(size)
            size //= 2
        sizes += [size] + ([1] if size != 1 else [])
    checkpointing = [job.activation_checkpointing]
    if "activation-checkpointing" in choose and job.activation_checkpointing in (False, "none"):
        checkpointing.append(True)
    return [replace(job, micro_batch_size=m, activation_checkpointing=ac) for ac in checkpointing for m in sizes]


def not_searched(job: Any, degrees: dict[str, int], dp_replicate: int) -> str | None:
    """Why a search does not plan the mesh of ``degrees``, in one line, or None: a DP that ``dp_replicate`` (HSDP's
    replicas) does not divide; without ``--trace-pp``, a preset's PP mesh, which only a trace through torch's schedule
    plans, as ``--pp N`` does (seconds to minutes a mesh). A user's own functions have their PP meshes traced: there
    is nothing else to plan them by."""
    pp, dp = degrees["PP"], degrees["DP"]
    if dp % dp_replicate:
        return (f"DP {dp} is not a multiple of --dp-replicate {dp_replicate}: HSDP splits DP into {dp_replicate} "
                f"replicas of DP / {dp_replicate} ranks")
    if pp == 1 or job.user or job.trace_pp:
        return None
    what = "the Llama 3 preset's PP meshes are" if job.llama3 else "the GPT preset's PP meshes are"
    return (f"{NOT_PLANNED}{what} traced through torch's schedule (seconds to minutes each); plan it "
            f"with --pp {pp}{f' --dp-replicate {dp_replicate}' if dp_replicate > 1 else ''}, or search with "
            "--trace-pp")


def static_over(job: Any, device_memory: int, *, dp: int, tp: int, cp: int, ep: int,
                degrees: dict[str, int]) -> MeshFit | None:
    """The GPT preset's mesh without PP as a rejection when its parameters, gradients and optimizer state alone
    (:func:`~vemesh.planning.estimate.rank_static`, equal to the byte to what the wrappers allocate) exceed the device
    memory, so that no trace is spent on it; else None."""
    model = load_model(job.model)
    try:
        check_degrees(model, dp=dp * cp, tp=tp, pp=1, ep=ep, dtype=job.dtype, dp_mode=job.mode)
    except ValueError:
        return None  # the trace says why, in its own words
    static = rank_static(model, stage_keys(model, 1)[0], "every rank", dp=dp * cp, tp=tp, ep=ep, dtype=job.dtype,
                         dp_mode=job.mode)
    if static.total <= device_memory:
        return None
    return MeshFit(degrees, [RankClass("every rank", static, 0, 0, {})], 0, 0, traced=False,
                   reason=f"static {gib(static.total)} > device memory {gib(device_memory)} (parameters, gradients "
                          "and optimizer state alone; not traced)")


def gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"
