"""The GPT example with a mixture of experts and expert parallelism over ``mesh["EP"]``: every logged loss,
eval loss and gradient norm equals one process (same experts, no EP), and so does every expert's load,
with DDP + ZeRO-1 and with FSDP2; a checkpoint saved with EP = 4 under FSDP2 resumes with EP = 2 under DDP +
ZeRO-1 and on one process.

The gradient norm is compared as well as the loss: AdamW does not see a constant factor on a gradient,
so expert gradients averaged over the wrong group can leave the loss curve exact; the norm cannot hide it.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import run_train, shared_run

pytestmark = pytest.mark.slow

STEPS = 6
TOL = 1e-4


def tiny(experts: int, *extra: str) -> list[str]:
    return ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--seq-len", "32", "--global-batch-size", "8",
            "--steps", str(STEPS), "--warmup-steps", "2", "--lr", "3e-3", "--eval-every", "3", "--eval-batches", "2",
            "--sample-tokens", "8", "--log-every", "1", "--moe-experts", str(experts), *extra]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process with every expert: 4 experts top-2, and 8 experts top-2."""
    runs = {}
    for experts in (4, 8):
        run = shared_run(tiny(experts), tmp_path_factory)
        assert run.returncode == 0, run.describe()
        runs[experts] = run
    return runs


def assert_same_curve(run, ref, after: int = 0) -> None:
    assert run.returncode == 0, run.describe()
    mine = [r for r in run.records if r["step"] > after]
    assert [r["step"] for r in mine] == list(range(after + 1, STEPS + 1))
    for r in mine:
        want = ref.records[r["step"] - 1]
        assert abs(r["loss"] - want["loss"]) < TOL, (r["step"], r["loss"], want["loss"])
        assert abs(r["grad_norm"] - want["grad_norm"]) < TOL * want["grad_norm"], (r["step"], r["grad_norm"], want["grad_norm"])
        assert r["expert_load"] == want["expert_load"], r["step"]
        if "eval_loss" in want:
            assert abs(r["eval_loss"] - want["eval_loss"]) < TOL, (r["step"], r["eval_loss"], want["eval_loss"])
    assert any("eval_loss" in r for r in mine)


CASES = {
    "ep4-dp4": (4, ["--ep", "4", "--mesh-shape", "4,1"]),  # EDP = 1
    "ep2-tp2": (8, ["--ep", "2", "--mesh-shape", "2,2"]),  # expert TP = TP
    "ep2-dp2-cp2": (4, ["--ep", "2", "--mesh-dims", "DP,CP", "--mesh-shape", "2,2"]),  # EP folded over DP x CP, EDP = 2
    "ep2-dp4": (4, ["--ep", "2", "--mesh-shape", "4,1"]),  # EDP = 2 over DP alone
}


@pytest.mark.parametrize("fsdp", [False, True], ids=["ddp-zero1", "fsdp2"])
@pytest.mark.parametrize("case", ["ep2-tp2", "ep2-dp2-cp2"])
def test_expert_parallel_matches_one_process(single, tmp_path, case, fsdp):
    experts, args = CASES[case]
    run = run_train(tiny(experts, *args, *(["--fsdp"] if fsdp else [])), tmp_path, nproc=4)
    assert "expert parallel: EP=2" in run.stdout, run.describe()
    assert_same_curve(run, single[experts])


def test_checkpoint_from_ep4_fsdp2_resumes_with_ep2_and_one_process(single, tmp_path):
    """EP = 4 under FSDP2 (which shards the experts over a one-rank EDP group: set_gradient_divide_factor(DP)
    there) is exact and saves every expert once; from step 3 it resumes with EP = 2 (EDP = 2) under DDP + ZeRO-1,
    and on one process, exactly."""
    ckpt = tmp_path / "ckpt"
    experts, args = CASES["ep4-dp4"]
    first = run_train(tiny(experts, *args, "--fsdp", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"), tmp_path,
                      nproc=4)
    assert "rank 3: experts 3..3 of each MoE layer; EP group [0, 1, 2, 3] (EP rank 3), EDP group [3]" in first.stdout
    assert_same_curve(first, single[experts])
    for nproc, more in ((4, CASES["ep2-dp4"][1]), (None, [])):
        shutil.rmtree(ckpt / f"step_{STEPS:06d}", ignore_errors=True)  # resume from step 3
        run = run_train(tiny(experts, *more, "--checkpoint-dir", str(ckpt)), tmp_path, nproc=nproc)
        assert "step_000003 (saved on mesh [4, 1]" in run.stdout, run.describe()
        assert_same_curve(run, single[experts], after=3)
