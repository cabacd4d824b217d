"""The job's pace (vemesh.hangs.pace), pure arithmetic: the warm-up, the p99, the floor and the cap, the heartbeat."""

from __future__ import annotations

import time

from vemesh.hangs.pace import FLOOR_S, PACE_FACTOR, WARMUP_STEPS, Progress, parse_beat, step_pace, threshold


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
    when, last, paused = parse_beat(p.beat())
    assert not paused and last == p.moved and when >= last
    with p.paused():
        assert parse_beat(p.beat())[2]
    assert not parse_beat(p.beat())[2] and p.moved >= last
    assert parse_beat("12.5") == (12.5, 12.5, False)  # an older watch's bare time
