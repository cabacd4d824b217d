"""Checkpoint on one mesh, resume on another: the next losses match an uninterrupted run.

One 4-rank gloo run trains N steps on (DP, TP) = (2, 2), saves, trains M more (the
reference), then, in the same processes, re-initializes ``VESCALE_DEVICE_MESH`` on (4, 1) and
(1, 4), rebuilds model and optimizer, loads and trains the same M steps. A 2-rank run loads the
same checkpoint with ``-1`` in the mesh shape, and this process loads it with no mesh at all.
"""

from __future__ import annotations

import math
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ckpt_harness import ADAMW, VOCAB, build, global_batch, tiny_config, train_step
from ckpt_scenarios import M, N, four_ranks, two_ranks
from launch import run_ranks
from vemesh.models.gpt import GPT

from vemesh import VESCALE_DEVICE_MESH, checkpoint

TOL = 1e-4
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("ckpt")
    return root, run_ranks(four_ranks, 4, str(root), timeout=240)


@pytest.fixture(scope="module")
def two(saved, tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root, _ = saved
    return run_ranks(two_ranks, 2, str(root), str(tmp_path_factory.mktemp("work")), timeout=240)


def _ok(result: Any) -> Any:
    assert not (isinstance(result, dict) and "error" in result), result.get("error")
    return result


def _close(losses: list[float], reference: list[float]) -> None:
    assert len(losses) == len(reference) == M
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= TOL, (losses, reference)


@pytest.mark.parametrize("scenario, mesh", [("zero-4x1", (4, 1)), ("zero-1x4", (1, 4)), ("adamw-2x2", (2, 2))])
def test_resume_on_another_mesh_matches_the_uninterrupted_run(saved, scenario: str, mesh: tuple[int, int]) -> None:
    _, ranks = saved
    reference = ranks[0]["reference"]
    for results in ranks:
        _close(results["reference"], reference)  # every rank logged the same global loss
        r = _ok(results[scenario])
        assert (r["step"], r["extra"], r["mesh"]) == (N, {"tokens_seen": 123}, mesh)
        _close(r["losses"], reference)
        assert r["param_diff"] <= TOL


def test_the_optimizer_state_matters(saved) -> None:
    """Weights alone (fresh Adam moments) do not reproduce the run: the comparison above has teeth."""
    _, ranks = saved
    for results in ranks:
        r = _ok(results["weights-only-2x2"])
        assert abs(r["losses"][0] - results["reference"][0]) <= TOL  # same weights, same first loss
        assert max(abs(a - b) for a, b in zip(r["losses"], results["reference"])) > 100 * TOL


def test_resume_in_a_single_process_without_a_mesh(saved) -> None:
    """The (2, 2) ZeRO-1 checkpoint loads into the example's bare GPT and torch.optim.AdamW."""
    root, ranks = saved
    torch.manual_seed(5)
    model = GPT(tiny_config())
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch: "torch.distributed is disabled ... single process"
        step, extra = checkpoint.load(root, model=model, optimizer=optimizer)
    assert (step, extra) == (N, {"tokens_seen": 123})
    losses = []
    for s in range(step + 1, N + M + 1):
        x, y = global_batch(s)
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    _close(losses, ranks[0]["reference"])


def test_resume_in_a_single_process_on_a_1x1_mesh(saved) -> None:
    """Same, through vemesh on a one-rank world: DDP pass-through and ZeRO-1 with DP = 1."""
    root, ranks = saved
    import torch.distributed as dist

    assert not dist.is_initialized()
    try:
        ddp, opt = build((-1, 1), seed=5)  # init_device_mesh makes a one-rank group
        assert VESCALE_DEVICE_MESH.shape == (1, 1)
        step, _ = checkpoint.load(root, model=ddp, optimizer=opt)
        _close([train_step(ddp, opt, s) for s in range(step + 1, N + M + 1)], ranks[0]["reference"])
    finally:
        VESCALE_DEVICE_MESH.reset()
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize("scenario, mesh", [("minus-one-tp2", (1, 2)), ("minus-one-tp1", (2, 1))])
def test_minus_one_lets_dp_absorb_a_smaller_world(saved, two, scenario: str, mesh: tuple[int, int]) -> None:
    _, ranks = saved
    for results in two:
        r = _ok(results[scenario])
        assert r["mesh"] == mesh
        _close(r["losses"], ranks[0]["reference"])


def test_bf16_master_weights_and_state_round_trip_exactly_across_meshes(two) -> None:
    for results in two:
        r = _ok(results["bf16-masters"])
        assert r["keys"] and r["has_masters"] and r["state_diff"] == 0.0
        assert math.isfinite(r["loss"])


@pytest.mark.parametrize("how", ["truncate", "delete", "garble"])
def test_every_rank_falls_back_from_a_damaged_checkpoint(two, how: str) -> None:
    for rank, results in enumerate(two):
        r = _ok(results["damaged"])[how]
        assert r["step"] == 1 and r["param_diff"] == 0.0
        assert len(r["warnings"]) == (1 if rank == 0 else 0)  # rank 0 warns, once
        if rank == 0:
            assert {"truncate": "has", "delete": "is missing", "garble": "does not match its checksum"}[how] in r["warnings"][0]


def test_every_rank_gets_the_same_clear_error_for_another_model_shape(two) -> None:
    messages = [_ok(results["damaged"]) for results in two]
    expected = "parameter 'h.0.attn.q.weight' has shape (32, 32) in the checkpoint but (48, 48) in the model"
    for m in messages:
        assert m["mismatch-load"].startswith("IncompatibleCheckpointError") and expected in m["mismatch-load"]
        assert m["mismatch-latest"].startswith("IncompatibleCheckpointError") and expected in m["mismatch-latest"]
        assert m["missing"].startswith("CheckpointNotFoundError") and "no such directory" in m["missing"]
    assert len({m["mismatch-load"] for m in messages}) == 1
