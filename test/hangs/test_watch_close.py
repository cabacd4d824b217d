"""The hang watch is one object: what ``start`` takes (a thread, hooks, SIGTERM's wakeup fd, a file) ``close`` gives back.

One process, a one-rank gloo group on an in-memory store: no other rank, nothing to hang on.
"""

from __future__ import annotations

import signal
import sys
import threading

import pytest
import torch.distributed as dist

from vemesh.hangs.process import Hangs


def test_close_gives_back_every_hook_thread_and_file(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        before = (sys.excepthook, threading.excepthook, signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1))
        signal.set_wakeup_fd(before[3])
        hangs = Hangs()
        hangs.mark_step(7)
        watch = hangs.start(tmp_path, 60.0, lambda: {"mesh": "one rank"})
        assert watch._thread.is_alive() and sys.excepthook is not before[0]
        assert (tmp_path / "rank-0.fatal.txt").exists()
        assert [s for _, s in hangs.steps] == [7]
        path = hangs.dump()
        assert path == tmp_path / "rank-0.json" and '"steps": [[' in path.read_text()
        hangs.close()
        after = (sys.excepthook, threading.excepthook, signal.getsignal(signal.SIGTERM), signal.set_wakeup_fd(-1))
        signal.set_wakeup_fd(after[3])
        assert after == before and watch.closed and not watch._thread.is_alive()
        assert not (tmp_path / "rank-0.fatal.txt").exists()  # faulthandler wrote nothing: the empty file is gone
        assert hangs.watch is None and hangs.dump() is None
        hangs.close()  # twice is fine
    finally:
        dist.destroy_process_group()


def test_an_exception_in_another_thread_goes_to_the_previous_hook_and_the_job_goes_on(tmp_path, monkeypatch) -> None:
    """Issue 50: a data-loader thread that raises dies as it would without the watch; only the training thread's
    exception ends the job (the watch's report and exit)."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    seen: list[str] = []
    monkeypatch.setattr(threading, "excepthook", lambda args: seen.append(f"{args.thread.name}: {args.exc_value}"))
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        hangs = Hangs()
        watch = hangs.start(tmp_path, 60.0, lambda: {"mesh": "one rank"})
        ended: list[str] = []
        monkeypatch.setattr(watch, "_end", lambda claim=None, dead=(): ended.append(claim))

        def prefetch() -> None:
            raise RuntimeError("the prefetch failed")

        worker = threading.Thread(target=prefetch, name="prefetch")
        worker.start()
        worker.join()
        assert seen == ["prefetch: the prefetch failed"] and ended == [] and watch._thread.is_alive()
        assert not watch.closed
        hangs.close()
    finally:
        dist.destroy_process_group()


def test_the_training_threads_error_while_the_watch_ends_the_job_prints_nothing(tmp_path, monkeypatch, capsys) -> None:
    """Once the watch is ending the job (a hang named, the report made or being made), the peers leave: a rank still
    in a collective with one of them gets gloo's "Connection closed by peer" on its training thread. Its traceback
    followed the report as if it were the cause (a Qwen2 job under TP and vemesh DDP, a rank asleep at step 3: two
    runs of two). That error is the job ending, not news: the hook waits for the watch to exit the process. An error
    before the watch ends the job is still the job's report."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        hangs = Hangs()
        watch = hangs.start(tmp_path, 60.0, lambda: {"mesh": "one rank"})
        error = RuntimeError("Connection closed by peer [127.0.0.1]:10653")
        assert watch._ending.acquire(blocking=False)  # as _end holds it, on the watch's thread
        hook = threading.Thread(target=watch._on_exception, args=(RuntimeError, error, None), daemon=True)
        hook.start()
        hook.join(timeout=1.0)
        assert hook.is_alive() and not hasattr(watch, "exception")  # waiting for the watch's exit, silent
        assert "Connection closed" not in capsys.readouterr().err
        watch._ending.release()
        ended: list[str | None] = []
        monkeypatch.setattr(watch, "_end", lambda claim=None, dead=(): ended.append(claim))
        watch._on_exception(RuntimeError, error, None)  # not ending yet: it is the cause, printed and reported
        assert ended == ["rank 0 raised RuntimeError: Connection closed by peer [127.0.0.1]:10653"], ended
        assert "Connection closed" in capsys.readouterr().err
        hangs.close()
    finally:
        dist.destroy_process_group()


class _Dumped(Exception):
    pass


def test_a_rank_claims_the_report_only_while_it_holds_its_ending(tmp_path, monkeypatch) -> None:
    """A rank aborted by gloo; its TP peer's training thread raised and claimed the report in the store, then took
    the ending lock. In between, its own watch thread saw the claim, took it for a peer's and the lock with it, and
    waited as a bystander for a report that never came: every rank was killed 30 s later, with no report (CI at stop
    102, test_a_wrong_sized_tp_all_reduce_is_named). The claim is made holding the lock, so that neither thread of a
    rank can see its own claim before that rank's ending is taken."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        hangs = Hangs()
        watch = hangs.start(tmp_path, 60.0, lambda: {"mesh": "one rank"})
        watch._stop.set()  # the watch's thread stops: it would take this test's claim as the job's end
        watch._thread.join()
        watch._stop.clear()  # for close(), which gives back the hooks
        held: list[bool] = []
        claim = watch._claim
        monkeypatch.setattr(watch, "_claim", lambda reason: held.append(watch._ending.locked()) or claim(reason))
        monkeypatch.setattr(watch, "dump", lambda: (_ for _ in ()).throw(_Dumped()))  # where _end would dump
        with pytest.raises(_Dumped):
            watch._on_exception(RuntimeError, RuntimeError("Connection reset by peer"), None)
        assert held == [True], held
        fired = watch.store.get(watch.keys + "fired").decode()
        assert fired == "0|rank 0 raised RuntimeError: Connection reset by peer", fired
        watch._ending.release()
        hangs.close()
    finally:
        dist.destroy_process_group()


def test_a_rank_that_answered_the_launchers_sigterm_is_alive_though_its_heartbeat_stopped(tmp_path, monkeypatch):
    """A rank that got torchrun's SIGTERM waits in its signal handler for the scan, and its heartbeat stops. When the
    reporter names the dead, that rank's stale beat must not make it dead (ci86 named a live rank with the killed
    one); a rank with a stale beat and no answer is dead, and a rank that answered but never dumped within the
    reporter's wait (``ending_alive=False``) is too."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        hangs = Hangs()
        watch = hangs.start(tmp_path, 60.0, lambda: {"mesh": "one rank"})
        stale = "1.0|1.0|0|-"  # a heartbeat from 1970
        for rank in (1, 2, 3):
            watch.store.set(watch.keys + f"beat/{rank}", stale)
        watch.store.set(watch.keys + "term/1", "1")
        watch.store.set(watch.keys + "ending/3", "1")
        assert [watch._silent(r) for r in (1, 2, 3)] == [False, True, False]
        assert [watch._silent(r, ending_alive=False) for r in (1, 2, 3)] == [True, True, True]
        watch.store.set(watch.keys + "dumped/1", "1")
        assert watch._silent(1, ending_alive=False) is None  # it dumped: accounted for
        hangs.close()
    finally:
        dist.destroy_process_group()
