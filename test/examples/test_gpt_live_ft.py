"""Live fault tolerance with torchft: lose a replica and keep training in the same processes, bring it
back and heal it from the live one, and every logged loss stays the uninterrupted run's.

A torchft lighthouse and two replica groups, each the example on 2 ranks with TP=2 inside (4 workers), started as
``torchrun --nproc_per_node=2`` starts them (``ft_scenarios.replica``: torchrun's environment, from the test process's
forkserver). docs/fault-tolerance.md's commands run under torchrun itself in test/docs. The uninterrupted run is
the same global batch in one process (the example matches one process on any mesh; on 4 ranks the reference cost
five times the CPU).
"""

from __future__ import annotations

import sys
import time

import pytest

pytest.importorskip("torchft")

import ft_scenarios as S  # noqa: E402
from conftest import REPO, exclusive, run_train  # noqa: E402

sys.path.insert(0, str(REPO / "docs"))
import snippets  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _one_set_of_replicas_at_a_time(tmp_path_factory):
    """Replicas time their quorums (a lighthouse waits 1 to 3 s for a replica to join): two sets of them on two
    cores at once can starve one into a quorum of its own. The tests here run one after another."""
    with exclusive(tmp_path_factory, "live-replicas"):
        yield

STEPS, KILL_AT = 120, 8
#: replica 0 is still training when the returning one has started (12 s after the kill on idle cores, up to 60 s
#: under the suite's load): from its second step on, its rank 0 sleeps this long in every step, which costs no CPU
SLOW_MS = 300
TOL = 1e-4


def first_quorum(log, proc, timeout: float = 120) -> None:
    """Wait until the replica writing ``log`` has its first quorum (rank 0 prints it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if log.exists() and "fault tolerance: quorum change at step 1:" in log.read_text():
            return
        assert proc.poll() is None, log.read_text()[-3000:]
        time.sleep(0.05)
    raise AssertionError(f"no first quorum within {timeout:.0f}s: {log.read_text()[-3000:]}")


def test_lose_a_replica_keep_going_then_heal_it_from_the_live_one(tmp_path) -> None:
    args = [*S.TINY, "--steps", str(STEPS)]
    reference = run_train([*args, "--mesh-shape", "1,1"], tmp_path)
    assert reference.returncode == 0, reference.describe()
    ref = {r["step"]: r for r in reference.records}

    m0, m1, m1b = tmp_path / "r0.jsonl", tmp_path / "r1.jsonl", tmp_path / "r1b.jsonl"
    replica = [*args, "--mesh-shape", "1,2"]
    # a quorum waits up to 3 s for a heartbeating replica to join: on busy cores the returning replica must not
    # be given a quorum of its own while replica 0 is between steps (nor is a heartbeat late under load taken for a
    # lost replica: S.lighthouse's 5 s)
    with S.lighthouse(tmp_path, join_ms=3000) as address:
        ft = ["--ft-lighthouse", address]
        r0 = S.replica([*replica, *ft, "--ft-replica-id", "0", "--metrics-file", str(m0),
                         "--inject", f"slow:0:2:{SLOW_MS}"], tmp_path / "r0.log")
        r1 = r1b = None
        try:
            # replica 1 starts once replica 0 has its first quorum. Started together, either may be first on loaded
            # cores, and the other then joins a step later, healed from it: which one is chance, not the test's
            first_quorum(tmp_path / "r0.log", r0)
            r1 = S.replica([*replica, *ft, "--ft-replica-id", "1", "--metrics-file", str(m1)], tmp_path / "r1.log")
            joined = S.wait_for(m1, 1, 120, [r0, r1])[0]["step"]
            S.wait_for(m1, max(KILL_AT, joined + 2), 120, [r0, r1])
            S.kill(r1)  # both ranks at once, as a lost host
            killed_after = S.records(m1)[-1]["step"]
            # back while replica 0 trains alone, then healed from it: started once replica 0 has a step alone
            # (started at once, it can be back within the next quorum's join window, and replica 0 is never alone)
            S.wait_until(m0, lambda r: r["step"] > killed_after and r["participants"] == 1, "a step alone", 120, [r0])
            r1b = S.replica([*replica, *ft, "--ft-replica-id", "1", "--metrics-file", str(m1b)], tmp_path / "r1b.log")
            assert r0.wait(timeout=240) == 0, (tmp_path / "r0.log").read_text()[-3000:]
            assert r1b.wait(timeout=60) == 0, (tmp_path / "r1b.log").read_text()[-3000:]
        finally:
            for p in (r0, r1, r1b):
                if p is not None and p.poll() is None:
                    S.kill(p)
    log0, log1, log1b = ((tmp_path / f"{name}.log").read_text() for name in ("r0", "r1", "r1b"))
    rows0, rows1b = S.records(m0), S.records(m1b)

    # 0. the start: replica 0 trains alone from step 1; replica 1 joins at a later step, healed from it
    assert joined > 1
    assert all(r["participants"] == (1 if r["step"] < joined else 2) for r in rows0 if r["step"] <= killed_after)
    assert "quorum change at step 1: replicas [] -> [0] (1 taking part)" in log0, log0[-3000:]
    assert f"quorum change at step {joined}: replicas [0] -> [0, 1] (2 taking part)" in log0, log0[-3000:]
    assert f"quorum change at step {joined}: replicas [] -> [0, 1] (2 taking part); healed from replica 0" \
        in log1, log1[-3000:]

    # 1. lose one and keep going: replica 0's workers never restarted, no step is missing or logged twice
    assert [r["step"] for r in rows0] == list(range(1, STEPS + 1))
    assert {r["pid"] for r in rows0} == {rows0[0]["pid"]} and {r["restart"] for r in rows0} == {0}
    alone = [r["step"] for r in rows0 if r["participants"] == 1 and r["step"] > killed_after]
    assert alone and alone[0] in (killed_after + 1, killed_after + 2), (killed_after, alone[:3])
    assert f"quorum change at step {alone[0]}: replicas [0, 1] -> [0] (1 taking part)" in log0
    for r in rows0:  # before, during and after: the uninterrupted run's loss and gradient norm
        assert abs(r["loss"] - ref[r["step"]]["loss"]) <= TOL, (r["step"], r["loss"], ref[r["step"]]["loss"])
        assert abs(r["grad_norm"] - ref[r["step"]]["grad_norm"]) <= TOL * ref[r["step"]]["grad_norm"]

    # 2. come back and heal: replica 1 took its state from replica 0 over torchft's transport, not from disk
    first = rows1b[0]["step"]
    assert first > alone[0], (first, alone[:3])
    assert f"quorum change at step {first}: replicas [] -> [0, 1] (2 taking part); healed from replica 0" in log1b
    assert f"quorum change at step {first}: replicas [0] -> [0, 1] (2 taking part)" in log0
    assert [r["step"] for r in rows1b] == list(range(first, STEPS + 1))
    assert all(r["participants"] == 2 for r in rows1b)
    for r in rows1b:
        assert abs(r["loss"] - ref[r["step"]]["loss"]) <= TOL, (r["step"], r["loss"], ref[r["step"]]["loss"])
    assert rows0[-1]["loss"] == pytest.approx(rows1b[-1]["loss"], abs=TOL)

    # 3. what docs/fault-tolerance.md shows of replica 0's output is what it printed (steps and times aside)
    (shown,) = snippets.excerpts("test_gpt_live_ft")
    assert snippets.missing_from(shown, log0) == [], (snippets.missing_from(shown, log0), log0[-3000:])


def test_no_lighthouse_and_a_replica_that_never_comes_fail_within_the_timeout(tmp_path) -> None:
    """Nothing hangs: no lighthouse at the address, and a quorum that never reaches --ft-min-replicas."""
    args = [*S.TINY, "--steps", "3", "--mesh-shape", "1,1", "--ft-replica-id", "0", "--ft-timeout-s", "3"]
    t0 = time.monotonic()
    run = run_train([*args, "--ft-lighthouse", f"http://localhost:{S.free_port()}"], tmp_path, timeout=60)
    assert run.returncode == 1 and "error: replica 0: cannot join the replicas through the torchft lighthouse" \
        in run.stderr and "Traceback" not in run.stderr, run.describe()
    assert time.monotonic() - t0 < 40
    with S.lighthouse(tmp_path) as address:
        t0 = time.monotonic()
        run = run_train([*args, "--ft-lighthouse", address, "--ft-min-replicas", "2"], tmp_path, timeout=60)
    assert run.returncode == 1 and "error: replica 0: step 1 failed to commit too many times in a row" in run.stderr \
        and "1 replicas taking part, fewer than min_replicas=2" in run.stderr, run.describe()
    assert time.monotonic() - t0 < 40


def test_a_lighthouse_lost_mid_run_stops_the_replica_within_the_timeout(tmp_path) -> None:
    metrics = tmp_path / "m.jsonl"
    # a timeout a loaded machine's quorums and commits keep within (at 3 s, CI's replica once stopped before step 3)
    args = [*S.TINY, "--steps", "100000", "--mesh-shape", "1,1", "--ft-replica-id", "0", "--ft-timeout-s", "10",
            "--metrics-file", str(metrics)]
    with S.lighthouse(tmp_path) as address:
        proc = S.replica([*args, "--ft-lighthouse", address], tmp_path / "r0.log", nproc=1)
        try:
            S.wait_for(metrics, 3, 90, [proc])
        except AssertionError as e:
            S.kill(proc)
            raise AssertionError(f"{e}\n{(tmp_path / 'r0.log').read_text()[-3000:]}") from None
        except BaseException:
            S.kill(proc)
            raise
    t0 = time.monotonic()  # the lighthouse is gone
    try:
        code = proc.wait(timeout=60)
    finally:
        S.kill(proc)
    log = (tmp_path / "r0.log").read_text()
    assert code != 0 and "error: replica 0: the quorum of step" in log and "failed" in log, log[-3000:]
    assert "quorum timeout 10s" in log, log[-3000:]
    assert time.monotonic() - t0 < 45


def test_a_replica_that_cannot_take_part_is_turned_away_and_the_live_ones_go_on(tmp_path) -> None:
    """A second process started as live replica 1, and a third replica that the batch (8 rows, micro-batches of 4)
    cannot split over: each gets one line at its join and exits; replicas 0 and 1 never see them."""
    m0, m1 = tmp_path / "r0.jsonl", tmp_path / "r1.jsonl"
    replica = [*S.TINY, "--steps", "100000", "--log-every", "1000", "--mesh-shape", "1,1"]
    with S.lighthouse(tmp_path) as address:
        ft = ["--ft-lighthouse", address]
        r0 = S.replica([*replica, *ft, "--ft-replica-id", "0", "--metrics-file", str(m0)], tmp_path / "r0.log", nproc=1)
        r1 = None
        try:
            S.wait_for(m0, 1, 120, [r0])  # replica 0 first: it trains from step 1, replica 1 joins it
            r1 = S.replica([*replica, *ft, "--ft-replica-id", "1", "--metrics-file", str(m1)], tmp_path / "r1.log",
                           nproc=1)
            S.wait_for(m1, 3, 120, [r0, r1])
            joined = S.records(m0)[-1]["step"]  # from here on both train together
            twin = S.replica([*replica, *ft, "--ft-replica-id", "1"], tmp_path / "twin.log", nproc=1)
            third = S.replica([*replica, *ft, "--ft-replica-id", "2"], tmp_path / "third.log", nproc=1)
            assert twin.wait(timeout=120) != 0 and third.wait(timeout=120) != 0
            before = S.records(m0)[-1]["step"]
            S.wait_for(m0, before + 20, 60, [r0, r1])  # the live replicas go on, both of them
        finally:
            for p in (r0, r1, locals().get("twin"), locals().get("third")):
                if p is not None and p.poll() is None:
                    S.kill(p)
    twin_log, third_log = (tmp_path / "twin.log").read_text(), (tmp_path / "third.log").read_text()
    assert "error: replica 1: another process is already live as replica 1 at the lighthouse" in twin_log, twin_log[-3000:]
    assert "live replica ids: [0, 1]. Start this one with a replica id no live replica has (such as 2)" in twin_log
    assert ("error: replica 2: not joining, since 3 replicas would take part ([0, 1, 2]) and --global-batch-size 8 does "
            "not split over 3 replicas x DP 1 in micro-batches of 4; the live replicas go on without it") in third_log
    for log in (twin_log, third_log):
        assert "quorum change" not in log and "step     1/" not in log  # never trained
    rows0, rows1 = S.records(m0), S.records(m1)
    assert [r["step"] for r in rows0] == list(range(1, len(rows0) + 1))
    assert {r["participants"] for r in rows0 if r["step"] > joined} == {2}
    assert {r["participants"] for r in rows1 if r["step"] > joined} == {2}
    assert "not run, retried" not in (tmp_path / "r0.log").read_text()  # turned away before any quorum saw them
