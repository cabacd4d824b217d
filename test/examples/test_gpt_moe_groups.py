"""The GPT example's expert layout, on every rank of 16 on torch's fake backend: the EP and EDP groups
that ``examples/gpt/ep.py`` folds out of the data-parallel ranks (the calls ``train.py`` makes) equal
Megatron-core's expert groups for the same sizes, and each EP rank holds Megatron's experts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from conftest import REPO
from moe import experts_of

from vemesh import MeshLayout, VeDeviceMesh
from vemesh.parallel import ParallelDims

sys.path.insert(0, str(Path(REPO, "test", "parallel", "devicemesh_api")))
from test_factorizations import megatron_groups  # noqa: E402  (the oracle, written out once)

# (mesh dims, mesh shape, EP): dense DP x CP x TP, experts folded over DP x CP with ETP = TP
CASES = [
    (("DP", "CP", "TP"), (4, 2, 2), 4),
    (("DP", "CP", "TP"), (4, 2, 2), 2),
    (("DP", "TP"), (8, 2), 2),
    (("DP", "TP"), (8, 2), 8),
    (("DP",), (16,), 4),
    (("DP", "CP"), (2, 8), 16),
]


@pytest.fixture
def fake_world():
    def become(rank: int, world: int) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())

    yield become
    if dist.is_initialized():
        dist.destroy_process_group()


@pytest.mark.parametrize(("names", "shape", "ep"), CASES, ids=[f"{'x'.join(map(str, s))}-ep{e}" for _, s, e in CASES])
def test_the_examples_expert_groups_are_megatrons_on_every_rank(fake_world, names, shape, ep):
    sizes = dict(zip(names, shape))
    tp, dp_cp = sizes.get("TP", 1), sizes.get("DP", 1) * sizes.get("CP", 1)
    megatron = {"tp": tp, "ep": ep, "dp": dp_cp // ep, "pp": 1}  # Megatron's expert order tp-ep-dp-pp
    expected = {name: megatron_groups(16, megatron, "tp-ep-dp-pp", token) for name, token in (("EP", "ep"), ("EDP", "dp"))}
    n_experts = 2 * ep
    for rank in range(16):
        fake_world(rank, 16)
        dims = ParallelDims.of(MeshLayout(shape, names), ep=ep)  # as train.py: the library's one rule
        mesh = dims.build("cpu", VeDeviceMesh())
        grad_dim = dims.grad_dim
        for name, groups in expected.items():
            mine = next(g for g in groups if rank in g)
            assert dist.get_process_group_ranks(mesh.get_group(name)) == mine, (rank, name)
            assert mesh.get_strategy_size(name) == len(mine) and mesh.lookup_rank(name) == mine.index(rank)
        # Megatron gives EP rank r the experts r * E/EP .. (r + 1) * E/EP - 1
        ep_rank = mesh.lookup_rank("EP")
        assert list(experts_of(ep_rank, ep, n_experts)) == [2 * ep_rank, 2 * ep_rank + 1]
        # the dense dims still answer as before the fold
        assert mesh.get_strategy_size(grad_dim) == dp_cp and mesh.get_strategy_size("TP") == tp
        mesh.reset()


def test_experts_cover_every_number_once():
    for ep in (1, 2, 4, 8):
        assert sorted(e for r in range(ep) for e in experts_of(r, ep, 8)) == list(range(8))
