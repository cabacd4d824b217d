"""The one rule for derived dims (``ParallelDims``) against an independent computation, for every job up to 32 ranks.

Every combination of PP, dp_replicate, dp_shard, CP, TP (product up to 32) and each EP that divides DP x CP:
the derived names and their groups are computed here with numpy from the rank grid ``(PP, dp_replicate,
dp_shard, CP, TP)``, as a reader would do it by hand, and compared with the pure layout (every group of every
name) and with the live mesh on torch's fake backend (every rank of the worlds up to 8, one rank of 8 larger ones
of each kind). ``vemesh plan`` and ``vemesh show --derived`` answer from the same object, and no other module derives a dim.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import astuple
from pathlib import Path

import numpy as np
import pytest
from mesh_jobs import jobs
import torch.distributed as dist

from vemesh import VeDeviceMesh
from vemesh.cli import main as cli
from vemesh.layout.data_dims import data_dims
from vemesh.layout.parallel_dims import ParallelDims
from vemesh.planning.mesh_plan import plan_mesh

REPO = Path(__file__).resolve().parents[3]


JOBS = jobs()


def expected(pp: int, r: int, s: int, cp: int, tp: int, ep: int) -> dict[str, np.ndarray]:
    """Every derived name's groups, by hand: the grid (PP, dp_replicate, dp_shard, CP, TP), one row per group, the
    groups ordered by the other axes and their members row-major over the name's axes."""
    grid = np.arange(pp * r * s * cp * tp).reshape(pp, r, s, cp, tp)

    def along(*axes: int) -> np.ndarray:
        moved = np.moveaxis(grid, axes, range(5 - len(axes), 5))
        return moved.reshape(-1, math.prod(grid.shape[a] for a in axes))

    out = {"PP": along(0), "DP": along(1, 2), "CP": along(3), "TP": along(4)}
    if r > 1:
        out |= {"dp_replicate": along(1), "dp_shard": along(2)}
        if cp > 1:
            out["dp_shard_cp"] = along(2, 3)
    if cp > 1:
        out["dp_cp"] = along(1, 2, 3)
    if ep > 1:
        data = along(1, 2, 3)  # every group of data ranks, as EP folds them: (EDP, EP) row-major, EP innermost
        out["EP"] = data.reshape(-1, ep)
        out["EDP"] = np.concatenate([d.reshape(-1, ep).T for d in data])
        if r == 1 and cp == 1:
            out["dp_ep"] = out["DP"]
    return out


def test_the_rule_covers_every_job_up_to_32_ranks() -> None:
    assert len(JOBS) == 3926


@pytest.mark.parametrize("world", range(1, 33))
def test_every_group_of_every_derived_name_in_the_pure_layout(world) -> None:
    for pp, r, s, cp, tp, ep in (j for j in JOBS if math.prod(j[:5]) == world):
        dims = ParallelDims(world, pp=pp, dp_replicate=r, dp_shard=s, cp=cp, tp=tp, ep=ep)
        layout, want = dims.layout(), expected(pp, r, s, cp, tp, ep)
        derived = set(layout.names) - set(layout.dim_names) - {"DP"}
        assert derived == set(want) - {"PP", "DP", "CP", "TP", "dp_replicate", "dp_shard"}, (pp, r, s, cp, tp, ep)
        for name in layout.names:  # the same groups, each with its members in the same order
            assert sorted(layout.all_groups(name)) == sorted(want[name].tolist()), (pp, r, s, cp, tp, ep, name)
        for standard, degree in dims.degrees.items():
            assert layout.group_size(standard, absent_ok=True) == degree
        dp = r * s
        assert dims.grad_dim == ("dp_cp" if dp > 1 and cp > 1 else "DP" if dp > 1 else "CP" if cp > 1
                                 else "DP" if "DP" in dims.mesh_dims else None)
        assert (dims.grad_dim, dims.fsdp_dims, dims.expert_dims) == astuple(data_dims(layout))[1:4]  # the one rule
        if dims.grad_dim:  # the gradient dim holds every rank with other rows or tokens, and nothing else
            assert sorted(layout.all_groups(dims.grad_dim)) == sorted(along_data(pp, r, s, cp, tp))


def along_data(pp: int, r: int, s: int, cp: int, tp: int) -> list[list[int]]:
    grid = np.arange(pp * r * s * cp * tp).reshape(pp, r, s, cp, tp)
    return np.moveaxis(grid, (1, 2, 3), (2, 3, 4)).reshape(-1, r * s * cp).tolist()


def _live(job: tuple[int, ...], ranks: list[int], fake_rank) -> None:
    pp, r, s, cp, tp, ep = job
    world = pp * r * s * cp * tp
    dims = ParallelDims(world, pp=pp, dp_replicate=r, dp_shard=s, cp=cp, tp=tp, ep=ep)
    want = expected(*job)
    for rank in ranks:
        fake_rank(rank, world)
        mesh = dims.build("cpu", VeDeviceMesh())
        for name, groups in want.items():
            if not mesh.layout.has(name):  # a standard dim of size 1, left out of the mesh
                assert groups.shape[1] == 1 and mesh.get_strategy_size(name) == 1, (job, name)
                continue
            mine = next(g for g in groups.tolist() if rank in g)
            assert dist.get_process_group_ranks(mesh.get_group(name)) == mine, (job, rank, name)
        if dims.fsdp_dims:
            view = mesh[dims.fsdp_dims]
            assert sorted(view.mesh.flatten().tolist()) == sorted(next(g for g in along_data(pp, r, s, cp, tp)
                                                                       if rank in g)), (job, rank)


def test_every_rank_of_the_live_mesh_for_worlds_up_to_8(fake_rank) -> None:
    for job in (j for j in JOBS if math.prod(j[:5]) <= 8):
        _live(job, list(range(math.prod(job[:5]))), fake_rank)


def larger_sample(per_kind: int = 8) -> list[tuple[int, ...]]:
    """Of the jobs over 8 ranks, ``per_kind`` of each kind (which of PP, dp_replicate, dp_shard, CP, TP and EP are
    more than 1), spread over the kind's sizes: all 59 kinds, 460 of the 3,698 jobs (the pure layout checks all)."""
    kinds: dict[tuple[bool, ...], list[tuple[int, ...]]] = {}
    for job in (j for j in JOBS if math.prod(j[:5]) > 8):
        kinds.setdefault(tuple(d > 1 for d in job), []).append(job)
    return [js[i * len(js) // per_kind] for js in kinds.values() for i in range(min(per_kind, len(js)))]


@pytest.mark.slow
def test_one_rank_of_the_live_mesh_for_each_kind_of_larger_world(fake_rank) -> None:
    sample = larger_sample()
    assert len(sample) == 460
    for i, job in enumerate(sample):
        _live(job, [(7 * i + 3) % math.prod(job[:5])], fake_rank)


def test_plan_and_show_answer_from_the_same_rule(capsys) -> None:
    for pp, r, s, cp, tp, ep in [(2, 2, 2, 2, 1, 4), (1, 1, 4, 2, 2, 2), (2, 1, 2, 1, 2, 2), (1, 2, 1, 2, 2, 1)]:
        world = pp * r * s * cp * tp
        dims = ParallelDims(world, pp=pp, dp_replicate=r, dp_shard=s, cp=cp, tp=tp, ep=ep)
        plan = plan_mesh(world, pp=pp, dp=r * s, cp=cp, tp=tp, ep=ep, dp_replicate=r)
        assert plan.layout == dims.layout() and list(plan.calls) == dims.calls()
        names = ",".join(dims.mesh_dims)
        shape = ",".join(str(dims.degrees[n]) for n in dims.mesh_dims)
        assert cli(["show", "--shape", shape, "--names", names, "--derived", "--ep", str(ep), "--dp-replicate", str(r),
                    "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)
        shown = {**doc["groups"], **{n: d["groups"] for n, d in doc.get("flattened", {}).items()}}
        assert set(shown) == set(dims.layout().names)
        for name, groups in shown.items():
            assert sorted(groups) == sorted(expected(pp, r, s, cp, tp, ep)[name].tolist()), name


def test_no_other_module_derives_a_dim() -> None:
    """The derived names are made in one place: no other flatten/split of dp_cp, dp_shard_cp or EDP x EP."""
    pattern = re.compile(r"""\.(flatten|split)\([^)]*["'](dp_cp|dp_shard_cp|dp_ep|EDP|dp_replicate)["']""")
    found = []
    for root in ("vemesh", "examples"):
        for path in (REPO / root).rglob("*.py"):
            if path.name == "parallel_dims.py":
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if pattern.search(line) and not line.strip().startswith(('f"', '"', "'", 'r"')):  # not a message
                    found.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not found, "\n".join(found)


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=2), "ParallelDims got 'dp', which names no degree; the valid keywords are world_size, pp, dp_replicate, "
                 "dp_shard, cp, tp, ep, mesh_dims; the DP degree is dp_shard (dp_replicate x dp_shard with HSDP): "
                 "pass dp_shard=2"),
    (dict(TP=2, etp=2), "ParallelDims got 'TP', 'etp', which name no degree; the valid keywords are world_size, pp, "
                        "dp_replicate, dp_shard, cp, tp, ep, mesh_dims"),
])
def test_a_keyword_that_names_no_degree_is_one_line_naming_it_and_the_valid_ones(kwargs, message) -> None:
    """``ParallelDims(8, dp=2)``, as ``vemesh plan --dp 2`` reads, is refused with where DP goes; a copy, a pickle and
    ``dataclasses.replace`` still build it."""
    import copy
    import pickle
    from dataclasses import replace

    with pytest.raises(TypeError) as e:
        ParallelDims(8, **kwargs)
    assert str(e.value) == message
    dims = ParallelDims(8, tp=2)
    assert pickle.loads(pickle.dumps(dims)) == copy.deepcopy(dims) == dims
    assert replace(dims, tp=4, dp_shard=2).tp == 4
