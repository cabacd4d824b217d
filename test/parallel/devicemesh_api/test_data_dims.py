"""One rule for the data dims, and every consumer gives its answer (or its error).

:func:`vemesh.layout.data_dims.data_dims` decides which dims hold different parts of the batch and which
names gradients, the loss and FSDP2 use. Here every consumer is held to it:

* pure: ``ParallelDims`` (the example's loss average, ``vemesh plan``'s gradient bytes) asks the rule for every
  job of up to 32 ranks (test_parallel_dims.py holds its groups against numpy); ``vemesh show --derived --json``
  gives the same answer on a sample of those jobs;
* live on torch's fake backend, for a rank of each job up to 8 ranks (and a sample up to 16) and for meshes a user names by hand
  (standard names in any case, torchtitan's names, names outside the table): vemesh DDP's default group, the
  ZeRO-1 optimizer's group, the mesh ``vemesh.parallel.fully_shard`` hands to torch, and the same clear error
  where the rule refuses.
"""

from __future__ import annotations

import json
import math
from dataclasses import astuple

import numpy as np
import pytest
import torch
import torch.distributed as dist
from mesh_jobs import jobs
from torch import nn

import vemesh.parallel.fsdp as fsdp_module
from vemesh import VESCALE_DEVICE_MESH
from vemesh.cli import main as cli
from vemesh.ddp import DistributedDataParallel
from vemesh.layout.data_dims import DataDims, data_dims
from vemesh.layout.mesh_layout import MeshLayout
from vemesh.layout.parallel_dims import ParallelDims
from vemesh.optim import DistributedOptimizer
from vemesh.parallel import fully_shard

JOBS = jobs()


def _dims(job: tuple[int, ...]) -> ParallelDims:
    pp, r, s, cp, tp, ep = job
    return ParallelDims(pp * r * s * cp * tp, pp=pp, dp_replicate=r, dp_shard=s, cp=cp, tp=tp, ep=ep)


def _along_data(pp: int, r: int, s: int, cp: int, tp: int) -> list[list[int]]:
    """Every group of ranks with other rows or tokens and the same PP and TP coordinates, from the rank grid."""
    grid = np.arange(pp * r * s * cp * tp).reshape(pp, r, s, cp, tp)
    return sorted(np.moveaxis(grid, (1, 2, 3), (2, 3, 4)).reshape(-1, r * s * cp).tolist())


def test_parallel_dims_and_show_agree_with_the_rule(capsys) -> None:
    """``ParallelDims`` asks the rule (checked for all 3926 jobs against numpy in test_parallel_dims.py); here the
    CLI's ``show --derived --json`` gives the same answer, and the grad group is numpy's, on a sample of them."""
    assert len(JOBS) == 3926
    for job in JOBS[::23]:
        pp, r, s, cp, tp, ep = job
        dims = _dims(job)
        rule = data_dims(dims.layout())
        assert (dims.grad_dim, dims.fsdp_dims, dims.expert_dims) == (rule.grad, rule.fsdp, rule.expert), job
        if rule.grad is not None:
            assert sorted(dims.layout().all_groups(rule.grad)) == _along_data(pp, r, s, cp, tp), job
            assert rule.batch_size == r * s * cp
        names = ",".join(dims.mesh_dims)
        shape = ",".join(str(dims.degrees[n]) for n in dims.mesh_dims)
        assert cli(["show", "--shape", shape, "--names", names, "--derived", "--ep", str(ep),
                    "--dp-replicate", str(r), "--json"]) == 0
        shown = json.loads(capsys.readouterr().out)["data"]
        assert shown == {"batch": list(rule.batch), "grad": rule.grad, "fsdp": list(rule.fsdp),
                         "expert": list(rule.expert)}, job


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def _consumers(monkeypatch) -> dict[str, object]:
    """What each consumer picks on the live VESCALE_DEVICE_MESH of this rank: ranks, dim names, or the error."""
    out: dict[str, object] = {}
    try:
        ddp = DistributedDataParallel(_Net())
        out["ddp"] = dist.get_process_group_ranks(ddp.process_group)
        opt = DistributedOptimizer(torch.optim.AdamW, models=[ddp])
        out["zero1"] = dist.get_process_group_ranks(opt.models[0].data_parallel_group)
    except ValueError as e:
        out["ddp"] = out["zero1"] = f"ValueError: {e}"
    seen: list[object] = []
    monkeypatch.setattr(fsdp_module, "torch_fully_shard", lambda module, mesh, **kw: seen.append(mesh) or module)
    try:
        fully_shard(_Net())
        out["fsdp"] = tuple(seen[-1].mesh_dim_names)
    except ValueError as e:
        out["fsdp"] = f"ValueError: {e}"
    return out


def _want(layout: MeshLayout, rank: int) -> dict[str, object]:
    try:
        rule: DataDims | None = data_dims(layout)
    except ValueError as e:
        return {"ddp": f"ValueError: {e}", "zero1": f"ValueError: {e}", "fsdp": f"ValueError: {e}"}
    assert rule is not None
    want: dict[str, object] = {}
    if rule.grad is None:
        want["ddp"] = want["zero1"] = "has no data dim"
    else:
        want["ddp"] = want["zero1"] = layout.group_ranks(rank, rule.grad)
    want["fsdp"] = rule.fsdp if rule.batch else "no data-parallel ranks"
    return want


def _check(got: dict[str, object], want: dict[str, object], what: object) -> None:
    for key, value in want.items():
        if isinstance(value, str):  # an error: the same words on every consumer that refuses
            assert isinstance(got[key], str) and value in got[key], (what, key, got[key])
        else:
            assert got[key] == value, (what, key, got[key], value)


def test_every_consumer_on_a_rank_of_each_job_up_to_8_ranks_and_a_sample_to_16(fake_rank, monkeypatch) -> None:
    try:
        jobs = [j for j in JOBS if math.prod(j[:5]) <= 8] + [j for j in JOBS if 8 < math.prod(j[:5]) <= 16][::14]
        for i, job in enumerate(jobs):
            world = math.prod(job[:5])
            rank = (5 * i + 1) % world
            fake_rank(rank, world)
            dims = _dims(job).build("cpu", VESCALE_DEVICE_MESH)
            _check(_consumers(monkeypatch), _want(dims.layout, rank), job)
    finally:
        VESCALE_DEVICE_MESH.reset()


USER_MESHES = [  # (shape, names, flattens): as a user builds them with init_device_mesh and flatten
    ((2, 2), ("dp", "tp"), ()),
    ((2, 2), ("Dp", "Tp"), ()),
    ((2, 2, 2, 2), ("pp", "Dp", "cP", "tp"), ((("Dp", "cP"), "dp_cp"),)),
    ((2, 2, 2, 2), ("pp", "Dp", "cP", "tp"), ()),  # two data dims and no name over both: the error says flatten
    ((2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp"),  # torchtitan's names and flattens
     ((("dp_shard", "cp"), "dp_shard_cp"), (("dp_replicate", "dp_shard", "cp"), "dp_cp"))),
    ((2, 4), ("dp_replicate", "dp_shard"), ()),
    ((1, 4, 2), ("PP", "DP", "TP"), ()),
    ((4, 1, 2), ("PP", "DP", "TP"), ()),  # DP of size 1: no data ranks
    ((2, 4), ("PP", "TP"), ()),
    ((2, 4), ("data", "TP"), ()),  # names outside the table: pass the group explicitly
    ((2, 2, 2), ("DP", "EP", "TP"), ()),
    ((4, 2), ("fsdp", "tp"), ()),
    ((4, 2), ("my_dp", "tp"), ()),
    ((4, 1), ("model", "DP"), ()),  # an unknown name of size 1 holds nothing: DP alone decides
]


@pytest.mark.parametrize("shape, names, flattens", USER_MESHES, ids=lambda v: str(v))
def test_every_consumer_on_user_named_meshes(shape, names, flattens, fake_rank, monkeypatch) -> None:
    world = math.prod(shape)
    try:
        for rank in range(world):
            fake_rank(rank, world)
            VESCALE_DEVICE_MESH.init_device_mesh("cpu", shape, mesh_dim_names=names)
            for dims, name in flattens:
                VESCALE_DEVICE_MESH.flatten(dims, name)
            _check(_consumers(monkeypatch), _want(VESCALE_DEVICE_MESH.layout, rank), (names, rank))
    finally:
        VESCALE_DEVICE_MESH.reset()


def test_the_rule_by_hand() -> None:
    """What the docs promise, on small meshes (the numbers a reader can check)."""
    titan = MeshLayout((2, 2, 2, 2), ("dp_replicate", "dp_shard", "cp", "tp")).flatten(
        ("dp_shard", "cp"), "dp_shard_cp").flatten(("dp_replicate", "dp_shard", "cp"), "dp_cp")
    assert astuple(data_dims(titan)) == (("dp_replicate", "dp_shard", "cp"), "dp_cp", ("dp_replicate", "dp_shard_cp"),
                                          (), 8)
    assert data_dims(MeshLayout((2, 4), ("PP", "TP"))).grad is None
    assert data_dims(MeshLayout((2, 2), ("CP", "TP"))).grad == "CP"
    assert data_dims(MeshLayout((4, 1), ("DP", "CP"))).grad == "DP"
    hsdp = MeshLayout((4, 2), ("DP", "TP")).split("DP", ("dp_replicate", "dp_shard"), (2, 2))
    assert (data_dims(hsdp).grad, data_dims(hsdp).fsdp) == ("DP", ("dp_replicate", "dp_shard"))
    for names in (("data", "TP"), ("DP", "EP"), ("my_dp", "tp")):
        with pytest.raises(ValueError, match=rf"'{names[0] if names[0] != 'DP' else 'EP'}' \(size 2\).*Pass the data-parallel group"):
            data_dims(MeshLayout((2, 2), names))
    with pytest.raises(ValueError, match=r"flatten them first, VESCALE_DEVICE_MESH.flatten\(\('DP', 'CP'\), 'dp_cp'\)"):
        data_dims(MeshLayout((2, 2), ("DP", "CP")))
