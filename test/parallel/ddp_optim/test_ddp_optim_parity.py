"""DDP and ZeRO-1 against a single process running the same torch optimizer on the global batch,
and the torch contract (schedulers, GradScaler, DCP, clipping, veScale's call forms).

One 4-rank gloo world (spawned once for the module) runs every scenario of
``ddp_optim_scenarios.worker`` on meshes (DP, TP) = (4, 1), (2, 2), (1, 4); each test below
checks that its scenario passed on every rank.
"""

from __future__ import annotations

import pytest
from ddp_optim_harness import Results
from ddp_optim_scenarios import CONFIGS, MESHES, worker
from torch_contract_scenarios import CONTRACT

from launch import run_ranks

WORLD_SIZE = 4

PARITY = [f"parity[{dp}x{tp}-{c.name}]" for dp, tp in MESHES for c in CONFIGS[(dp, tp)]]
OTHERS = ["bf16", "state_dict", "errors", "broadcast", "running_stats_as_torch", "freeze_mid_training", "vescale_mesh",
          "tp_batches_named"]


@pytest.fixture(scope="module")
def world() -> list[Results]:
    return run_ranks(worker, WORLD_SIZE, timeout=300, env={"OMP_NUM_THREADS": "1"})


def _assert_passed(world: list[Results], name: str) -> None:
    for rank, results in enumerate(world):
        assert name in results, f"rank {rank} did not run {name}"
        assert results[name] is None, f"rank {rank}, {name}:\n{results[name]}"


@pytest.mark.parametrize("name", PARITY)
@pytest.mark.slow
def test_parity_with_single_process_adamw(world: list[Results], name: str) -> None:
    _assert_passed(world, name)


@pytest.mark.parametrize("name", OTHERS)
def test_scenario(world: list[Results], name: str) -> None:
    _assert_passed(world, name)


@pytest.mark.parametrize("name", CONTRACT)
def test_torch_contract(world: list[Results], name: str) -> None:
    _assert_passed(world, name)
