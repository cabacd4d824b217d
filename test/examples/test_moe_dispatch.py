"""The library's expert-parallel exchange (``vemesh.parallel.ExpertParallel`` on the GPT preset's grouped experts):
tokens reach the rank of their experts by an uneven all-to-all and come back, forward and backward, equal to one
process's MoE layer (4 gloo ranks; a CUDA variant where the ranks share one GPU)."""

from __future__ import annotations

import pytest
import torch

from launch import run_ranks
from moe_scenarios import compare, wrap_without_an_edp
from vemesh.parallel.experts import source_to_expert_order


def test_arrivals_regroup_by_expert():
    assert source_to_expert_order(torch.tensor([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert source_to_expert_order(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def _check(results, tol):
    for rank, res in enumerate(results):
        assert res["experts"] == ["experts.w1", "experts.w2", "experts.b1", "experts.b2"] and res["local_rows"] == 2
        assert res["out"] < tol and res["dx"] < tol and res["expert_grads"] < tol, (rank, res)


def test_dispatch_equals_one_process_on_4_gloo_ranks():
    _check(run_ranks(compare, 4), 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the ranks share it over gloo)")
def test_dispatch_on_cuda_equals_one_process():
    _check(run_ranks(compare, 2, "cuda"), 1e-5)


def test_ddp_refuses_experts_whose_gradients_have_nowhere_to_average():
    """ExpertParallel's experts average over EDP; on a mesh without one DDP raises on every rank instead of
    averaging them over the EP ranks (which hold other experts)."""
    for message in run_ranks(wrap_without_an_edp, 2):
        assert "the module holds experts sharded by ExpertParallel" in message, message
        assert "VESCALE_DEVICE_MESH has no EDP dim: build the mesh with ParallelDims(..., ep=N)" in message
