"""torchtitan's own ``MoE`` module (``torchtitan==0.3.0``, the ``titan`` extra), unchanged, in a user's own loop on
4 gloo ranks against one process: its grouped experts spread by ``vemesh.parallel.ExpertParallel`` over EP = 2 folded
in DP = 4 with vemesh DDP, ZeRO-1 and FSDP2 on the dense part, and split over EP = 2 x TP = 2 by
``ExpertTensorParallel``; its router, shared experts and load-balancing bias alongside. And torchtitan's own
``Llama3Model`` (the SDPA attention it ships in place of flex attention, which has no backward on CPU) with TP by its
module names under FSDP2 and under vemesh DDP + ZeRO-1.

torchtitan's experts compute in bf16. With them in fp32 (its ``_grouped_mm`` seam, and its forward without the casts
to bf16 around the seam), every step's loss, every final parameter and each expert bias is within 1e-5 of one
process. With the casts (as shipped, or with the fp32 seam alone) the weights' gradients are rounded to bf16, and under
EP each data rank's share is rounded before the shares are summed: that difference is measured and bounded loosely
(measured: loss 4.8e-7, parameters 9.0e-5 after 3 AdamW steps of lr 1e-3).

torchtitan is not in the ``test`` extra (its MoE imports triton, close to 1 GB): these tests skip without it. To run
them: ``pip install -c constraints.txt -e ".[test,titan]" && python -m pytest test/parallel/library_models/test_torchtitan_models.py``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torchtitan", reason='torchtitan is the "titan" extra: pip install -c constraints.txt -e ".[test,titan]"')

import titan_scenarios as S  # noqa: E402
from launch import run_ranks  # noqa: E402

TOL = 1e-5
#: the experts' gradients rounded to bf16 per data rank: AdamW's steps move by that rounding, the loss barely
BF16_LOSS_TOL, BF16_PARAM_TOL = 1e-5, 1e-3

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def four() -> list[dict]:
    return run_ranks(S.worker, 4, S.CASES, timeout=400, env={"OMP_NUM_THREADS": "1"})


@pytest.mark.parametrize("name", [n for n, case in S.CASES.items() if case[1] == "fp32"])
def test_torchtitan_moe_on_four_ranks_matches_one_process(four, name) -> None:
    for rank, results in enumerate(four):
        o = results[name]
        assert "error" not in o, f"rank {rank}:\n{o.get('error')}"
        print(f"rank {rank}: {name}: loss {o['loss_diff']:.2e}, {o['worst']} {o['param_diff']:.2e}")
        assert o["loss_diff"] < TOL and o["param_diff"] < TOL, \
            f"rank {rank}: loss by {o['loss_diff']:.2e}, {o['worst']} by {o['param_diff']:.2e}"


@pytest.mark.parametrize("name", ["titan-moe-ep2-ddp-bf16", "titan-moe-ep2-ddp-fp32-seam"])
def test_torchtitan_moe_with_bf16_casts_differs_by_rounding_only(four, name) -> None:
    for rank, results in enumerate(four):
        o = results[name]
        assert "error" not in o, f"rank {rank}:\n{o.get('error')}"
        print(f"rank {rank}: {name} against one process: loss {o['loss_diff']:.2e}, "
              f"{o['worst']} {o['param_diff']:.2e}")
        assert o["loss_diff"] < BF16_LOSS_TOL and o["param_diff"] < BF16_PARAM_TOL, \
            f"rank {rank}: loss by {o['loss_diff']:.2e}, {o['worst']} by {o['param_diff']:.2e}"


def _every_case_exact(worker, cases: dict) -> None:
    """``cases`` run by ``worker`` on 4 gloo ranks: every step's loss and every parameter within TOL on every rank."""
    for rank, results in enumerate(run_ranks(worker, 4, cases, timeout=400,
                                             env={"OMP_NUM_THREADS": "1"})):
        for name, o in results.items():
            assert "error" not in o, f"rank {rank}: {name}:\n{o.get('error')}"
            print(f"rank {rank}: {name}: loss {o['loss_diff']:.2e}, {o['worst']} {o['param_diff']:.2e}")
            assert o["loss_diff"] < TOL and o["param_diff"] < TOL, \
                f"rank {rank}: {name}: loss by {o['loss_diff']:.2e}, {o['worst']} by {o['param_diff']:.2e}"


def test_torchtitan_llama3_with_tp_by_its_module_names_matches_one_process() -> None:
    """torchtitan's Llama3 (its debugmodel, ``trunc_normal_`` in its ``init_states``, the SDPA attention it ships):
    TP = 2 by its module names with FSDP2, and with vemesh DDP + ZeRO-1, over DP = 2."""
    _every_case_exact(S.llama3_worker, S.LLAMA3_CASES)


def test_torchtitan_qwen3_moe_whole_matches_one_process() -> None:
    """torchtitan's Qwen3 MoE model (its debugmodel_moe, 2 blocks of 8 experts, the SDPA attention it ships), whole:
    EP = 2 inside DP = 4 with FSDP2, and EP = 2 x TP = 2 (attention TP by its module names, expert TP on its grouped
    experts) with vemesh DDP + ZeRO-1, its load balancing as its trainer runs it, experts in fp32."""
    _every_case_exact(S.qwen3_worker, S.QWEN3_CASES)


@pytest.mark.slow
def test_torchtitan_llama3_under_cp_is_checked_exact_and_without_its_positions_cut_gets_its_own_keyword() -> None:
    """``vemesh check`` on torchtitan's Llama3 under DP 2 x CP 2 (FSDP2, vemesh's ``context_parallel``): exact with
    the positions cut and given as ``positions``; without, its RoPE module is the first that differs and the hint
    calls the model with ``positions=``, the keyword its forward takes."""
    from pathlib import Path

    from vemesh.check import check

    jobs = str(Path(__file__).resolve().parents[2] / "models" / "titan_jobs.py")
    right = check(f"module:{jobs}:make_llama3", f"{jobs}:parallelize_llama3_fsdp", f"{jobs}:step_llama3_cp",
                  world_size=4, cp=2)
    assert right.exact and right.outputs_not_comparable == 0, right.render()
    wrong = check(f"module:{jobs}:make_llama3", f"{jobs}:parallelize_llama3_fsdp",
                  f"{jobs}:step_llama3_cp_without_positions", world_size=4, cp=2)
    assert not wrong.exact and wrong.first_module["module"] == "layers.0.attention.rope", wrong.render()
    assert any("then model(x, positions=positions)" in h for h in wrong.hints), wrong.hints
