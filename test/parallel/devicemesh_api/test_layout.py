"""Layer 1: pure rank arithmetic, checked against numpy and by hypothesis properties."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from vemesh.layout import MeshLayout


def _names(n: int) -> tuple[str, ...]:
    return tuple(f"d{i}" for i in range(n))


shapes = st.lists(st.integers(1, 5), min_size=1, max_size=4).map(tuple)


@st.composite
def layout_and_dims(draw):
    shape = draw(shapes)
    layout = MeshLayout(shape, _names(len(shape)))
    dims = tuple(sorted(draw(st.sets(st.integers(0, len(shape) - 1)))))
    return layout, dims


def numpy_groups(shape: tuple[int, ...], dims: tuple[int, ...]) -> list[list[int]]:
    """Reference: move ``dims`` last on the arange grid; each row is a group."""
    grid = np.arange(math.prod(shape)).reshape(shape)
    k = len(dims)
    moved = np.moveaxis(grid, dims, tuple(range(len(shape) - k, len(shape))))
    return moved.reshape(-1, math.prod(shape[d] for d in dims)).tolist()


@given(shapes)
def test_coordinate_rank_bijection(shape):
    layout = MeshLayout(shape, _names(len(shape)))
    grid = np.arange(layout.world_size).reshape(shape)
    coords = [layout.coordinate(r) for r in range(layout.world_size)]
    assert len(set(coords)) == layout.world_size
    for r, c in enumerate(coords):
        assert layout.rank(c) == r
        assert grid[c] == r
        assert all(0 <= x < s for x, s in zip(c, shape))


@settings(deadline=None)  # a 5x3x5x5 example checks every rank of every group: slow under load
@given(layout_and_dims())
def test_groups_partition_world_and_match_numpy(case):
    layout, dims = case
    groups = layout.all_groups(dims)
    assert groups == numpy_groups(layout.shape, dims)
    flat = sorted(r for g in groups for r in g)
    assert flat == list(range(layout.world_size))
    assert all(len(g) == layout.group_size(dims) for g in groups)
    for i, g in enumerate(groups):
        assert layout.group_at(dims, i) == g
        for pos, r in enumerate(g):
            assert layout.group_ranks(r, dims) == g
            assert layout.group_index(r, dims) == i
            assert layout.index_in_group(r, dims) == pos
            assert layout.member(g[0], dims, pos) == r


@given(shapes, st.data())
def test_neighbor_symmetry(shape, data):
    layout = MeshLayout(shape, _names(len(shape)))
    dim = data.draw(st.integers(0, len(shape) - 1))
    offset = data.draw(st.integers(-6, 6))
    for r in range(layout.world_size):
        for wrap in (False, True):
            n = layout.neighbor(r, dim, offset, wrap)
            if n is None:
                assert not wrap
                c = layout.coordinate(r)[dim] + offset
                assert not 0 <= c < shape[dim]
                continue
            assert layout.neighbor(n, dim, -offset, wrap) == r
            # only the coordinate along `dim` changes
            a, b = layout.coordinate(r), layout.coordinate(n)
            assert [x for i, x in enumerate(a) if i != dim] == [x for i, x in enumerate(b) if i != dim]
            assert b[dim] == (a[dim] + offset) % shape[dim]


def test_empty_dims_is_the_group_of_one():
    layout = MeshLayout((2, 3), ("DP", "TP"))
    for r in range(6):
        assert layout.group_ranks(r, ()) == [r]
        assert layout.index_in_group(r, ()) == 0
        assert layout.member(r, (), 0) == r
    assert layout.group_size(()) == 1


def test_docstring_example_pp_dp_tp():
    layout = MeshLayout((2, 2, 2), ("PP", "DP", "TP"))
    assert layout.group_ranks(5, (2,)) == [4, 5]
    assert layout.group_ranks(5, (0,)) == [1, 5]
    assert layout.group_ranks(5, (1, 2)) == [4, 5, 6, 7]
    assert layout.neighbor(3, 0, 1) == 7
    assert layout.neighbor(7, 0, 1) is None
    assert layout.neighbor(7, 0, 1, wrap=True) == 3


def test_layout_is_hashable_and_immutable():
    a, b = MeshLayout((2, 4), ("DP", "TP")), MeshLayout((2, 4), ("DP", "TP"))
    assert a == b and hash(a) == hash(b)
    with pytest.raises(AttributeError):
        a.shape = (8,)  # type: ignore[misc]


@pytest.mark.parametrize(
    "shape, names, match",
    [
        ((), (), r"at least one dim"),
        ((2, 0), ("DP", "TP"), r"positive integers; got shape \(2, 0\)"),
        ((2, -1), ("DP", "TP"), r"positive integers; got shape \(2, -1\)"),
        ((2, 2), ("DP",), r"shape \(2, 2\) has 2 dims but dim_names \('DP',\) has 1"),
        ((2, 2), ("DP", "DP"), r"\['DP'\] repeat"),
    ],
)
def test_layout_rejects_bad_construction(shape, names, match):
    with pytest.raises(ValueError, match=match):
        MeshLayout(shape, names)


def test_layout_bad_queries_name_the_value_and_range():
    layout = MeshLayout((2, 4), ("DP", "TP"))
    with pytest.raises(ValueError, match=r"global rank 8 is out of range; valid: 0..7"):
        layout.coordinate(8)
    with pytest.raises(ValueError, match=r"global rank -1 is out of range"):
        layout.group_ranks(-1, (1,))
    with pytest.raises(ValueError, match=r"coordinate \(1,\) has 1 entries; .* needs 2"):
        layout.rank((1,))
    with pytest.raises(ValueError, match=r"TP=4 is out of range; valid: 0..3"):
        layout.rank((1, 4))
    with pytest.raises(ValueError, match=r"local rank 4 is out of range along TP \(size 4\); valid: 0..3"):
        layout.member(0, (1,), 4)
    with pytest.raises(KeyError, match=r"unknown dim name 'tp'.*did you mean 'TP'"):
        layout.dim_index("tp")
    with pytest.raises(ValueError, match=r"dim index 2 is out of range for a 2-D mesh; valid: 0..1, or -2..-1"):
        layout.dim_index(2)
    with pytest.raises(ValueError, match=r"dim index -3 is out of range for a 2-D mesh"):
        layout.dim_index(-3)
    assert layout.dim_index(-1) == 1 and layout.dim_index(-2) == 0
    with pytest.raises(ValueError, match=r"group index 4 is out of range; valid: 0..3"):
        layout.group_at((0,), 4)


def test_numpy_and_torch_integers_are_ranks_but_bools_are_not():
    import torch

    layout = MeshLayout((2, 4), ("DP", "TP"))
    assert layout.rank((np.int64(1), torch.tensor(2))) == 6
    assert layout.coordinate(np.int32(5)) == (1, 1)
    assert layout.member(np.int64(3), (1,), np.int16(2)) == 2
    with pytest.raises(TypeError, match=r"a global rank must be an integer .* got True of type bool"):
        layout.coordinate(True)
    with pytest.raises(TypeError, match=r"coordinate entry TP must be an integer .* got 2.0 of type float"):
        layout.rank((1, 2.0))
    with pytest.raises(ValueError, match=r"global rank 8 is out of range; valid: 0..7"):
        layout.coordinate(np.int64(8))


def test_groups_take_dims_in_any_order_as_megatron_lists_them():
    """Megatron's ``HyperCommGrid._gen_rank_enum(["tp", "cp"])`` on a (DP, CP, TP) = (2, 2, 2) grid lists
    ``[[0, 2, 1, 3], [4, 6, 5, 7]]``: members in the order the dims are given. The pure layout answers the same;
    a view keeps torch's rule (mesh order) and says so."""
    layout = MeshLayout((2, 2, 2), ("DP", "CP", "TP"))
    assert layout.all_groups(("TP", "CP")) == [[0, 2, 1, 3], [4, 6, 5, 7]]
    assert layout.all_groups(("CP", "TP")) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert layout.group_ranks(6, ("TP", "CP")) == [4, 6, 5, 7] and layout.index_in_group(6, ("TP", "CP")) == 1
    with pytest.raises(ValueError, match=r"a view, like torch's DeviceMesh, takes its dims in mesh order"):
        layout.resolve(("TP", "CP"))


@given(st.integers(1, 5000))
def test_divisors_are_every_size_that_cuts_n_evenly_ascending(n):
    from vemesh.layout.names import divisors

    assert divisors(n) == [d for d in range(1, n + 1) if n % d == 0]


def test_divisors_and_listed_name_bad_values_and_cut_long_lists():
    from vemesh.layout.names import divisors, listed

    with pytest.raises(ValueError, match="divisors of 0: only a positive integer has them"):
        divisors(0)
    assert listed(divisors(12)) == "1, 2, 3, 4, 6, 12"
    assert listed(divisors(720), 4) == "1, 2, 3, 4, ..."

