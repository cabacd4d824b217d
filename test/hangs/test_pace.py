"""The job's pace (vemesh.hangs.pace), pure arithmetic: the warm-up, the p99, the floor and the cap, the heartbeat,
the busy share and the straggler's factor."""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vemesh.hangs.pace import (FLOOR_S, PACE_FACTOR, STRAGGLER_FACTOR, WARMUP_STEPS, Busy, Progress, parse_beat,
                               step_pace, straggler, straggler_line, threshold)
from vemesh.hangs.record import straggler_window


def marks(gaps: list[float]) -> list[tuple[int, int]]:
    t, out = 0, [(0, 0)]
    for i, g in enumerate(gaps, 1):
        t += int(g * 1e9)
        out.append((t, i))
    return out


def test_no_pace_during_the_warm_up_and_the_first_intervals_left_out() -> None:
    assert step_pace(marks([0.1] * (WARMUP_STEPS - 2))) is None  # 9 marks
    slow_start = marks([30.0, 20.0, 10.0] + [0.2] * 10)  # compilation and loads in the first steps
    assert step_pace(slow_start) == 0.2


def test_the_threshold_is_the_pace_times_its_factor_with_a_floor_and_the_conservative_cap() -> None:
    assert threshold(marks([0.1] * 5), 300.0) == (300.0, False)  # warm-up: conservative
    assert threshold(marks([0.1] * 20), 300.0) == (FLOOR_S, True)  # fast steps: the floor
    limit, paced = threshold(marks([2.0] * 20), 300.0)
    assert paced and abs(limit - PACE_FACTOR * 2.0) < 1e-6
    assert threshold(marks([100.0] * 20), 300.0) == (300.0, True)  # never above the conservative one


def test_a_straggler_slows_the_pace_with_it() -> None:
    """A rank 4x slower from step 12 on: the steps of the whole job take 4x as long, and so does the threshold."""
    limit, _ = threshold(marks([1.0] * 12 + [4.0] * 30), 600.0)
    assert limit == PACE_FACTOR * 4.0


def test_the_heartbeat_says_when_the_rank_last_moved_and_whether_it_is_paused() -> None:
    p = Progress()
    p.update(3, 10)
    moved = p.moved
    time.sleep(0.01)
    p.update(3, 10)  # no change: not a move
    assert p.moved == moved
    p.update(3, 11)
    assert p.moved > moved
    when, last, paused, busy = parse_beat(p.beat())
    assert not paused and last == p.moved and when >= last and busy is None
    with p.paused():
        assert parse_beat(p.beat())[2]
    assert not parse_beat(p.beat())[2] and p.moved >= last
    assert parse_beat(p.beat(0.25))[3] == 0.25
    assert parse_beat("12.5") == (12.5, 12.5, False, None)  # an older watch's bare time


def lockstep(compute: dict[int, float], comm: float, seconds: float, seed: int = 0) -> dict[int, float]:
    """Each rank's busy share, sampled as the watch samples it (jittered), in a job whose ranks compute
    ``compute[r]`` seconds per step and then meet in collectives of ``comm`` seconds: every step takes the slowest
    rank's compute plus the collective, and a rank waits from its compute's end to the step's end."""
    rng, step = random.Random(seed), max(compute.values()) + comm
    shares = {}
    for r, c in compute.items():
        busy, t = Busy(seconds), 0.0
        while t < seconds:
            busy.add((t % step) >= c, now=t)
            t += rng.uniform(0.5, 1.5) * 0.05
        shares[r] = busy.share()
    return shares


@pytest.mark.parametrize("factor", [1.5, 2.0, 4.0])
def test_a_straggler_is_named_with_its_factor(factor: float) -> None:
    """Rank 2 computes ``factor`` times as long as the others (0.1 s a step, collectives of 10 ms): it is the one
    named, its factor measured within 15% over a 60 s window."""
    shares = lockstep({0: 0.1, 1: 0.1, 2: 0.1 * factor, 3: 0.1}, comm=0.01, seconds=60)
    found = straggler(shares)
    assert found is not None and found[0] == 2, shares
    assert abs(found[1] / factor - 1) < 0.15, (found, factor)


def test_ranks_in_step_are_no_stragglers_and_a_job_that_only_waits_says_nothing() -> None:
    assert straggler(lockstep({r: 0.1 for r in range(8)}, comm=0.01, seconds=60)) is None
    assert straggler({0: 0.0, 1: 0.01, 2: 0.0}) is None  # nobody computes: no factor worth a word
    assert straggler({0: 0.9}) is None


@given(st.dictionaries(st.integers(0, 63), st.floats(0, 1), min_size=2, max_size=16))
def test_a_named_straggler_is_the_busiest_rank_and_at_least_the_factor(shares: dict[int, float]) -> None:
    found = straggler(shares)
    if found is not None:
        rank, factor, median = found
        assert shares[rank] == max(shares.values()) and factor >= STRAGGLER_FACTOR and median > 0


def test_a_busy_share_needs_enough_samples_and_forgets_the_old_ones() -> None:
    busy = Busy(10.0)
    for t in range(10):
        busy.add(False, now=t * 0.1)
    assert busy.share() is None  # too few samples to say
    busy = Busy(10.0)
    for t in range(100):
        busy.add(t >= 50, now=t * 0.1)  # busy for 5 s, then waiting for 5 s
    assert busy.share() == pytest.approx(0.5, abs=0.02)
    for t in range(100, 200):
        busy.add(True, now=t * 0.1)
    assert busy.share() == 0.0  # the busy stretch left the 10 s window


def test_the_straggler_line_and_its_window() -> None:
    line = straggler_line(2, "DP=1, TP=0", "; its groups: DP [0, 2], TP [2, 3]", 2.04, 0.98, 0.48, 60)
    assert line == ("vemesh: straggler: rank 2 (DP=1, TP=0) is 2.0x slower than the median rank over the last 60 s: "
                    "outside collectives 98% of the time, the median rank 48%; its groups: DP [0, 2], TP [2, 3]; not a "
                    "hang, the job goes on")
    assert straggler_window({}) == 60.0 and straggler_window({"VEMESH_STRAGGLER_WINDOW": "0"}) == 0
    with pytest.raises(ValueError, match="VEMESH_STRAGGLER_WINDOW='soon' is not a number of seconds"):
        straggler_window({"VEMESH_STRAGGLER_WINDOW": "soon"})
    with pytest.raises(ValueError, match="VEMESH_STRAGGLER_WINDOW=-1 must be 0"):
        straggler_window({"VEMESH_STRAGGLER_WINDOW": "-1"})
