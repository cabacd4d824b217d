"""Ring attention over the mesh's CP group equals one process's causal SDPA, forward and backward (gloo),
with and without torch's head-tail load balancing; and the private torch API it uses is where it was."""

from __future__ import annotations

import pytest
import torch

from cp_scenarios import compare

from launch import run_ranks
from vemesh.parallel.context import ring
from vemesh.parallel.context import check_sequence_split, check_torch_api, positions, shard_sequence


def test_torchs_private_ring_attention_api_is_where_vemesh_expects_it():
    api = check_torch_api()  # raises naming what moved if torch renamed any of it
    assert set(api) == set(ring._NAMES)


def test_a_moved_api_fails_loudly(monkeypatch):
    from torch.distributed.tensor.experimental._context_parallel import _attention

    monkeypatch.setattr(ring, "_API", {})
    monkeypatch.delattr(_attention, "_templated_ring_attention_backward")
    with pytest.raises(RuntimeError, match=r"moved the private ring-attention API .*_templated_ring_attention_backward"):
        check_torch_api()


def test_sharding_and_positions():
    x = torch.arange(16).view(1, 16)
    assert shard_sequence(x, 1, 2).tolist() == [list(range(8, 16))]
    assert shard_sequence(x, 0, 2, load_balance=True).tolist() == [[0, 1, 2, 3, 12, 13, 14, 15]]
    assert positions(8, 1, 2, load_balance=True).tolist() == [2, 3, 4, 5]
    with pytest.raises(ValueError, match="a sequence of 6 positions does not split into 4 equal chunks"):
        shard_sequence(torch.zeros(1, 6), 0, 2, load_balance=True)


@pytest.mark.parametrize("length, cp, balanced, message", [
    (10, 2, True, "a sequence of 10 positions does not split into 4 equal chunks (CP 2, head-tail load balancing: 2 per "
                  "rank); choose a sequence length that is a multiple of 4, or CP from 1, 5"),
    (9, 2, False, "a sequence of 9 positions does not split into 2 equal chunks (CP 2); choose a sequence length that "
                  "is a multiple of 2, or CP from 1, 3, 9"),
    (9, 2, True, "(CP 2, head-tail load balancing: 2 per rank); choose a sequence length that is a multiple of 4 (no "
                 "CP splits an odd length into head-tail chunks)"),
])
def test_one_rule_says_which_lengths_cp_cuts_and_the_cp_that_would(length, cp, balanced, message):
    with pytest.raises(ValueError) as e:
        check_sequence_split(length, cp, balanced)
    assert message in str(e.value)
    assert check_sequence_split(16, 4, True) == 8 and check_sequence_split(12, 4, False) == 4


def test_ring_attention_equals_one_process_on_4_gloo_ranks():
    """Causal and not (an encoder's attention), contiguous and head-tail cuts, both rotations."""
    results = run_ranks(compare, 4)
    assert {"cp4-alltoall-not-causal", "cp2-balanced-alltoall-not-causal"} <= set(results[0])
    for rank, res in enumerate(results):
        for key, err in res.items():
            if "positions" not in key:
                assert err < 1e-5, (rank, key, err)
        assert res["cp4-positions"] == list(range(8 * rank, 8 * rank + 8))
        assert sorted(p for r in results for p in r["cp4-positions-balanced"]) == list(range(32))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the ranks share it over gloo)")
def test_ring_attention_on_cuda_equals_one_process():
    """The CUDA branch: torch's ring flash attention in bf16, 4 gloo ranks sharing one GPU."""
    for rank, res in enumerate(run_ranks(compare, 4, "cuda")):
        for key, err in res.items():
            if "positions" not in key and "refused" not in key:
                assert err < 5e-2, (rank, key, err)
        assert "needs an nccl CP group" in res["allgather-refused"]
