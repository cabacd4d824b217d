"""The example's expert-parallel dispatch (``examples/gpt/ep.py``): tokens reach the rank of their experts by
an uneven all-to-all and come back, forward and backward, equal to one process's MoE layer (4 gloo ranks;
a CUDA variant where the ranks share one GPU)."""

from __future__ import annotations

import pytest
import torch

from ep import source_to_expert_order
from launch import run_ranks
from moe_scenarios import compare, wrap_without_expert_groups


def test_arrivals_regroup_by_expert():
    assert source_to_expert_order(torch.tensor([[1, 2], [3, 0]])).tolist() == [0, 3, 4, 5, 1, 2]
    assert source_to_expert_order(torch.zeros(2, 2, dtype=torch.long)).tolist() == []


def _check(results, tol):
    for rank, res in enumerate(results):
        assert res["experts"] == [str(2 * rank), str(2 * rank + 1)]
        assert res["out"] < tol and res["dx"] < tol and res["expert_grads"] < tol, (rank, res)


def test_dispatch_equals_one_process_on_4_gloo_ranks():
    _check(run_ranks(compare, 4), 1e-5)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the ranks share it over gloo)")
def test_dispatch_on_cuda_equals_one_process():
    _check(run_ranks(compare, 2, "cuda"), 1e-5)


def test_ddp_refuses_experts_it_was_not_told_about():
    """Each EP rank's experts carry their own numbers: averaging them over DP (or broadcasting rank 0's) would
    train silently wrong, so DDP compares the parameter names across its group and raises on every rank."""
    for rank, message in enumerate(run_ranks(wrap_without_expert_groups, 2)):
        assert "the data-parallel parameters differ across the ranks [0, 1]" in message, message
        assert f"rank {rank} has moe.experts.{rank}.c_fc.weight (64, 16)" in message, message
        assert "go in expert_parameters, with expert_data_parallel" in message
