"""Placement: the order of the mesh dims on the hosts, chosen from what each dim's collectives cost.

Pure arithmetic on made-up plans (a plan's bytes per dim do not depend on the order), and the groups that
``init_device_mesh`` builds for the chosen order on every rank of 1024, on torch's fake backend.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VESCALE_DEVICE_MESH as mesh
from vemesh.parallel import ParallelDims
from vemesh.planning.estimate import RankMemory
from vemesh.planning.mesh_plan import plan_mesh
from vemesh.planning.placement import place, render
from vemesh.layout.describe import link_of
from vemesh.planning.profiles import DeviceProfile, Link, load_profile
from vemesh.planning.results import MeshFit, RankClass
from vemesh.planning.step_time import step_time

MiB = 2**20


def _fit(degrees: dict[str, int], sent: dict[str, int], flops: int = 10**12) -> MeshFit:
    """A plan whose step sends ``sent`` bytes per dim (one all-reduce each) and computes ``flops``."""
    ops = {d: {"allreduce_": (b, 8)} for d, b in sent.items()}
    c = RankClass("every rank", RankMemory("every rank", 0, 0, 0, 0), 0, 0, dict(sent), flops, 10**9, 10**8, 1000, 0,
                  ops)
    return MeshFit(dict(degrees, EP=1), [c], 1, 1, dp_mode="ddp")


def test_the_dims_that_send_the_most_stay_inside_a_host() -> None:
    mesh16 = plan_mesh(16, dp=8, tp=2, devices_per_host=8)
    heavy_tp = _fit(mesh16.degrees, {"DP": 1 * MiB, "TP": 100 * MiB})
    best, base = place(heavy_tp, mesh16, 8)
    assert best.order == ("DP", "TP") and best.crossing == ("DP",) and best.cross_bytes == 1 * MiB
    assert base["torchtitan"].order == ("DP", "TP") and base["reverse"].order == ("TP", "DP")
    assert base["reverse"].cross_bytes == 100 * MiB
    heavy_dp = _fit(mesh16.degrees, {"DP": 100 * MiB, "TP": 1 * MiB})
    best, base = place(heavy_dp, mesh16, 8)
    assert best.order == ("TP", "DP") and best.crossing == ("TP",) and base["torchtitan"].cross_bytes == 100 * MiB
    assert best.mesh.init_call() == ('VESCALE_DEVICE_MESH.init_device_mesh("cuda", (2, 8), '
                                     'mesh_dim_names=("TP", "DP"))')
    assert not [w for w in best.mesh.warnings if w.kind in ("spans_hosts", "tp_not_innermost")]


def _timed(profile):
    """What ``vemesh plan`` times a placed mesh with: each dim's link class by the one rule (racks from the profile)."""
    def timed(f, m):
        sizes = {d: m.layout.group_size(d) for d in ("PP", "DP", "TP")}
        links = {d: link_of(m.layout, d, 8, profile.hosts_per_rack) for d in sizes}
        return step_time(f, profile, dtype="bf16", dp_mode="ddp", grad_dims=("DP",), sizes=sizes, links=links)
    return timed


def test_with_racks_the_dim_that_costs_most_across_racks_stays_inside_one() -> None:
    """32 ranks on hosts of 8, 2 hosts per rack: TP's and PP's 64 MiB per step are exposed, so TP stays inside a host
    and with racks PP inside a rack (the network link), DP crossing the racks; without racks PP and DP cross hosts
    alike and torchtitan's order stays. A profile with half of the racks' fields is one line."""
    flat = load_profile("h100-sxm")
    racked = flat.model_copy(update={"hosts_per_rack": 2, "rack": Link(latency_s=4e-5, bandwidth=5e9)})
    mesh32 = plan_mesh(32, pp=2, dp=2, tp=8, devices_per_host=8)
    fit = _fit(mesh32.degrees, {"PP": 64 * MiB, "DP": MiB, "TP": 64 * MiB})
    best, base = place(fit, mesh32, 8, _timed(racked))
    assert best.order == ("DP", "PP", "TP") and base["torchtitan"].order == ("PP", "DP", "TP")
    links = lambda p: {d: t.link for d, t in max(p.times, key=lambda t: t.total).dims.items()}  # noqa: E731
    assert links(best) == {"DP": "rack", "PP": "network", "TP": "host"}
    assert links(base["torchtitan"]) == {"DP": "network", "PP": "rack", "TP": "host"}
    assert best.step_time < base["torchtitan"].step_time
    assert place(fit, mesh32, 8, _timed(flat))[0].order == ("PP", "DP", "TP")
    with pytest.raises(ValueError, match="racks need both hosts_per_rack and rack"):
        DeviceProfile.model_validate(dict(flat.model_dump(), hosts_per_rack=2))


def test_with_a_profile_the_shortest_step_wins_and_ties_keep_torchtitans_order() -> None:
    profile = load_profile("h100-sxm")
    mesh64 = plan_mesh(64, pp=2, dp=4, tp=8, devices_per_host=8)
    fit = _fit(mesh64.degrees, {"PP": 4 * MiB, "DP": 64 * MiB, "TP": 64 * MiB})

    timed = _timed(profile)

    best, base = place(fit, mesh64, 8, timed)
    assert best.order == ("PP", "DP", "TP")  # TP's 64 MiB are exposed, DP's hide behind backward: TP inside
    assert best.step_time <= base["reverse"].step_time and best.step_time == base["torchtitan"].step_time
    text = render(best, base, 8)
    assert "chosen      PP, DP, TP" in text and "reverse     TP, DP, PP" in text and "step time" in text
    one_host = plan_mesh(8, dp=4, tp=2, devices_per_host=8)
    assert place(_fit(one_host.degrees, {"DP": MiB, "TP": MiB}), one_host, 8)[0].order == ("DP", "TP")


@pytest.fixture
def only_this_ranks_groups(monkeypatch):
    """torch's ``DeviceMesh`` calls ``new_group`` for every group of a dim on every rank (on a real backend it is
    collective) and keeps the one that holds the rank. One process playing 1024 ranks in turn would make a million
    groups (50 s) that no rank keeps: here ``new_group`` makes only the rank's own groups. torch still walks every
    group of each dim, checks that the rank is in exactly one, and keeps the group ``new_group`` made."""
    from torch.distributed import device_mesh

    made = device_mesh.new_group

    def new_group(ranks=None, *args, **kwargs):
        return made(ranks, *args, **kwargs) if ranks is None or dist.get_rank() in ranks else None

    monkeypatch.setattr(device_mesh, "new_group", new_group)


def test_every_rank_of_1024_builds_the_planned_groups_for_the_chosen_order(only_this_ranks_groups) -> None:
    """PP=4 x DP=8 x CP=4 x TP=8 on hosts of 8, CP the heaviest: the chosen order is not torchtitan's, and every
    group ``ParallelDims(..., mesh_dims=order).build`` makes on every rank (the dims and the ``dp_cp`` flatten) is the
    one the plan placed; and with EP = 4 split out of ``dp_cp`` as well."""
    for ep in (1, 4):
        planned = plan_mesh(1024, pp=4, dp=8, cp=4, tp=8, ep=ep, devices_per_host=8)
        fit = _fit(planned.degrees, {"PP": MiB, "DP": 8 * MiB, "CP": 512 * MiB, "TP": 64 * MiB, "dp_cp": 16 * MiB})
        best, base = place(fit, planned, 8)
        assert best.order != base["torchtitan"].order and best.order[-1] == "CP"
        assert best.cross_bytes < base["torchtitan"].cross_bytes < base["reverse"].cross_bytes
        layout = best.mesh.layout
        dims = ParallelDims(1024, pp=4, dp_shard=8, cp=4, tp=8, ep=ep, mesh_dims=best.order)
        mesh.reset()
        for rank in range(1024):
            dist.init_process_group("fake", rank=rank, world_size=1024, store=FakeStore())
            try:
                dims.build("cpu", mesh)
                for name in layout.names:
                    assert dist.get_process_group_ranks(mesh.get_group(name)) == layout.group_ranks(rank, name), \
                        (rank, name)
            finally:
                mesh.reset()
                dist.destroy_process_group()


@pytest.mark.parametrize("world, per_host, message", [
    (12, 8, "--devices-per-host 8 does not divide the world size 12, so the mesh cannot be placed on whole hosts; "
            "choose one of 1, 2, 3, 4, 6, 12"),
])
def test_hosts_that_do_not_divide_the_world_are_one_line(world, per_host, message) -> None:
    from vemesh.planning.api import PlanRequest, answer
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
    import llama_jobs

    for extra in ({"tp": 2}, {"device_memory": "80GiB"}):
        with pytest.raises(ValueError) as e:
            answer(PlanRequest(world_size=world, model=llama_jobs.make_dense, parallelize=llama_jobs.parallelize_ddp,
                               step=llama_jobs.step, global_batch_size=12, devices_per_host=per_host, **extra))
        assert str(e.value) == message
