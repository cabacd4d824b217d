"""Buffer layout and bucketing (DDP) and ZeRO-1 shard arithmetic: pure functions, no process group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vemesh.parallel.ddp.bucketing import plan_buckets
from vemesh.parallel.optim.shards import Piece, contiguous_runs, shard_pieces, shard_range, shard_size

numels_st = st.lists(st.integers(0, 50), min_size=1, max_size=20)


def test_docstring_examples() -> None:
    layout = plan_buckets([5, 3, 6], bucket_size=8)
    assert layout.param_ranges == ((0, 5), (5, 8), (8, 14))
    assert [(b.start, b.end, b.params) for b in layout.buckets] == [(0, 8, (0, 1)), (8, 14, (2,))]
    assert shard_range(14, 0, 2) == (0, 7) and shard_range(14, 1, 2) == (7, 14)
    assert shard_pieces(layout.param_ranges, 0, 7) == [Piece(0, 0, 5), Piece(1, 5, 7)]
    assert shard_pieces(layout.param_ranges, 7, 14) == [Piece(1, 7, 8), Piece(2, 8, 14)]


def test_padding_belongs_to_nobody() -> None:
    assert shard_size(7, 4) == 2 and shard_range(7, 3, 4) == (6, 8)
    assert shard_pieces(((0, 7),), 6, 8) == [Piece(0, 6, 7)]


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_bucket_size(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        plan_buckets([4], bucket_size=bad)


def test_bad_shard_request() -> None:
    with pytest.raises(ValueError, match="dp_rank=3"):
        shard_range(6, 3, 3)
    with pytest.raises(ValueError, match="dp_size must be positive, got 0"):
        shard_size(6, 0)


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, bucket_size=st.integers(1, 80))
def test_layout_properties(numels: list[int], bucket_size: int) -> None:
    layout = plan_buckets(numels, bucket_size)
    # parameters are contiguous inside their bucket, in order, and each lies in exactly one bucket
    owner = layout.bucket_of_param()
    for i, (start, end) in enumerate(layout.param_ranges):
        assert end - start == numels[i]
        b = layout.buckets[owner[i]]
        assert b.start <= start <= end <= b.end
    # buckets tile the buffer and exceed bucket_size by less than one parameter
    assert layout.buckets[0].start == 0 and layout.buckets[-1].end == layout.numel
    for prev, nxt in zip(layout.buckets, layout.buckets[1:]):
        assert prev.end == nxt.start
    for b in layout.buckets:
        data = sum(numels[i] for i in b.params)
        assert b.numel == max(data, 1)
        assert data < bucket_size + max(numels[i] for i in b.params) or data == 0
    assert sorted(i for b in layout.buckets for i in b.params) == list(range(len(numels)))


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, bucket_size=st.integers(1, 80), dp=st.integers(1, 8))
def test_shards_partition_every_parameter(numels: list[int], bucket_size: int, dp: int) -> None:
    layout = plan_buckets(numels, bucket_size)
    covered = [0] * (shard_size(layout.numel, dp) * dp)
    per_rank = []
    for r in range(dp):
        lo, hi = shard_range(layout.numel, r, dp)
        pieces = shard_pieces(layout.param_ranges, lo, hi)
        per_rank.append(sum(p.end - p.start for p in pieces))
        for p in pieces:
            assert lo <= p.start < p.end <= hi
            start, end = layout.param_ranges[p.param]
            assert start <= p.start < p.end <= end
            for e in range(p.start, p.end):
                covered[e] += 1
    in_param = [0] * len(covered)
    for start, end in layout.param_ranges:
        for e in range(start, end):
            in_param[e] = 1
    assert covered == in_param  # every parameter element on exactly one rank, padding on none
    assert max(per_rank) <= shard_size(layout.numel, dp)  # ~1/DP each


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, dp=st.integers(1, 4), data=st.data())
def test_runs_merge_neighbours(numels: list[int], dp: int, data: st.DataObject) -> None:
    layout = plan_buckets(numels, 10)
    pieces = shard_pieces(layout.param_ranges, *shard_range(layout.numel, 0, dp))
    keys = data.draw(st.lists(st.sampled_from([None, 0, 1]), min_size=len(pieces), max_size=len(pieces)))
    runs = contiguous_runs(pieces, keys)
    assert sum(e - s for _, s, e in runs) == sum(p.end - p.start for p, k in zip(pieces, keys) if k is not None)
    for key, start, end in runs:  # a run is contiguous and holds one key
        inside = [k for p, k in zip(pieces, keys) if start <= p.start < end]
        assert set(inside) == {key}
    assert len(contiguous_runs(pieces, [0] * len(pieces))) <= 1 + sum(1 for b in layout.buckets if b.numel > sum(numels[i] for i in b.params))
