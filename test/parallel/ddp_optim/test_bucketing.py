"""Buffer layout, bucketing and shard arithmetic: pure functions, no process group."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vemesh.ddp.bucketing import Piece, contiguous_runs, plan_buckets, shard_pieces

numels_st = st.lists(st.integers(0, 50), min_size=1, max_size=20)


def test_docstring_example() -> None:
    layout = plan_buckets([5, 3, 6], bucket_size=8, pad_to=2)
    assert layout.param_ranges == ((0, 5), (5, 8), (8, 14))
    assert [(b.start, b.end, b.params) for b in layout.buckets] == [(0, 8, (0, 1)), (8, 14, (2,))]
    assert shard_pieces(layout, 0, 2) == [Piece(0, 0, 0, 4, 0), Piece(2, 1, 8, 11, 0)]
    assert shard_pieces(layout, 1, 2) == [Piece(0, 0, 4, 5, 4), Piece(1, 0, 5, 8, 0), Piece(2, 1, 11, 14, 3)]


def test_padding_when_bucket_does_not_split_evenly() -> None:
    layout = plan_buckets([7], bucket_size=100, pad_to=4)
    assert layout.numel == 8 and layout.buckets[0].shard(3, 4) == (6, 8)
    assert shard_pieces(layout, 3, 4) == [Piece(0, 0, 6, 7, 6)]  # the padding element belongs to nobody


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_bucket_size(bad: int) -> None:
    with pytest.raises(ValueError, match=str(bad)):
        plan_buckets([4], bucket_size=bad)


def test_bad_shard_request() -> None:
    bucket = plan_buckets([6], bucket_size=10, pad_to=3).buckets[0]
    with pytest.raises(ValueError, match="dp_rank=3"):
        bucket.shard(3, 3)
    with pytest.raises(ValueError, match="dp_size=4"):
        bucket.shard(0, 4)


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, bucket_size=st.integers(1, 80), dp=st.integers(1, 8))
def test_layout_properties(numels: list[int], bucket_size: int, dp: int) -> None:
    layout = plan_buckets(numels, bucket_size, pad_to=dp)
    # parameters are contiguous inside their bucket, in order, and each lies in exactly one bucket
    owner = layout.bucket_of_param()
    for i, (start, end) in enumerate(layout.param_ranges):
        assert end - start == numels[i]
        b = layout.buckets[owner[i]]
        assert b.start <= start <= end <= b.end
    # buckets tile the buffer, split evenly over DP, and exceed bucket_size by less than one param + padding
    assert layout.buckets[0].start == 0 and layout.buckets[-1].end == layout.numel
    for prev, nxt in zip(layout.buckets, layout.buckets[1:]):
        assert prev.end == nxt.start
    for b in layout.buckets:
        assert b.numel % dp == 0 and b.numel > 0
        data = sum(numels[i] for i in b.params)
        assert data < bucket_size + max(numels[i] for i in b.params) or data == 0
        assert b.numel - data < dp or data == 0
    assert sorted(i for b in layout.buckets for i in b.params) == list(range(len(numels)))


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, bucket_size=st.integers(1, 80), dp=st.integers(1, 8))
def test_shards_partition_every_parameter(numels: list[int], bucket_size: int, dp: int) -> None:
    layout = plan_buckets(numels, bucket_size, pad_to=dp)
    covered = [0] * layout.numel
    per_rank = []
    for r in range(dp):
        pieces = shard_pieces(layout, r, dp)
        per_rank.append(sum(p.end - p.start for p in pieces))
        for p in pieces:
            lo, hi = layout.buckets[p.bucket].shard(r, dp)
            assert lo <= p.start < p.end <= hi
            assert p.param_offset == p.start - layout.param_ranges[p.param][0]
            for e in range(p.start, p.end):
                covered[e] += 1
    in_param = [0] * layout.numel
    for start, end in layout.param_ranges:
        for e in range(start, end):
            in_param[e] = 1
    assert covered == in_param  # every parameter element on exactly one rank, padding on none
    assert max(per_rank) <= -(-sum(numels) // dp) + len(layout.buckets)  # ~1/DP each


@settings(max_examples=100, deadline=None)
@given(numels=numels_st, bucket_size=st.integers(1, 80), dp=st.integers(1, 4), data=st.data())
def test_runs_merge_neighbours(numels: list[int], bucket_size: int, dp: int, data: st.DataObject) -> None:
    layout = plan_buckets(numels, bucket_size, pad_to=dp)
    pieces = shard_pieces(layout, 0, dp)
    keys = data.draw(st.lists(st.sampled_from([None, 0, 1]), min_size=len(pieces), max_size=len(pieces)))
    runs = contiguous_runs(pieces, keys)
    assert sum(e - s for _, s, e in runs) == sum(p.end - p.start for p, k in zip(pieces, keys) if k is not None)
    for key, start, end in runs:  # a run lies in one bucket and holds one key
        inside = [k for p, k in zip(pieces, keys) if start <= p.start < end]
        assert set(inside) == {key}
        assert len({p.bucket for p in pieces if start <= p.start < end}) == 1
    assert len(contiguous_runs(pieces, [0] * len(pieces))) <= len(layout.buckets)
