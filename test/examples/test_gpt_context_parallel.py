"""The GPT example with context parallelism over ``mesh["CP"]``: every logged loss and eval loss equals one
process within 1e-4 (dropout off, same global batch), and a checkpoint saved on (DP=2, CP=2) resumes on
(DP=4) and on one process exactly. The contiguous (not load-balanced) ring is checked against one process
in test/parallel/context_parallel."""

from __future__ import annotations

import shutil

import pytest
from conftest import run_train, shared_run

pytestmark = pytest.mark.slow

STEPS = 6
TOL = 1e-4


def tiny(seq_len: int) -> list[str]:
    return ["--n-layer", "2", "--n-head", "4", "--n-embd", "64", "--seq-len", str(seq_len), "--global-batch-size", "8",
            "--steps", str(STEPS), "--warmup-steps", "2", "--lr", "3e-3", "--eval-every", "3", "--eval-batches", "2",
            "--sample-tokens", "8", "--log-every", "1"]


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """One process on the same flags, for sequences of 32 and of 256 tokens."""
    runs = {}
    for seq_len in (32, 256):
        run = shared_run(tiny(seq_len), tmp_path_factory)
        assert run.returncode == 0, run.describe()
        runs[seq_len] = run
    return runs


def assert_same_curve(run, ref, after: int = 0) -> None:
    assert run.returncode == 0, run.describe()
    mine = [r for r in run.records if r["step"] > after]
    assert [r["step"] for r in mine] == list(range(after + 1, STEPS + 1))
    diffs = [abs(r["loss"] - ref.records[r["step"] - 1]["loss"]) for r in mine]
    evals = [abs(r["eval_loss"] - ref.records[r["step"] - 1]["eval_loss"]) for r in mine if "eval_loss" in r]
    assert max(diffs) < TOL and evals and max(evals) < TOL, (diffs, evals)
    # the gradient norm too: AdamW hides a constant factor on a gradient, the norm does not
    norms = [abs(r["grad_norm"] / ref.records[r["step"] - 1]["grad_norm"] - 1) for r in mine]
    assert max(norms) < TOL, norms


@pytest.mark.parametrize(
    ("seq_len", "nproc", "args"),
    [
        # CP with DP and TP, ZeRO-1 over dp_cp; sequence parallelism cuts each CP rank's part again over TP
        (32, 8, ["--mesh-dims", "DP,CP,TP", "--mesh-shape", "2,2,2", "--sequence-parallel"]),
        (256, 4, ["--mesh-dims", "CP", "--mesh-shape", "4"]),  # CP alone, head-tail load balanced
        # compiled blocks: the ring runs eagerly, a graph break at each attention (dynamo crashed inside it before)
        (32, 2, ["--mesh-dims", "CP", "--mesh-shape", "2", "--compile"]),
    ],
    ids=["dp2-cp2-tp2-sp", "cp4-seq256", "cp2-compiled"],
)
def test_context_parallel_matches_one_process(single, tmp_path, seq_len, nproc, args):
    run = run_train(tiny(seq_len) + args, tmp_path, nproc=nproc)
    assert "context parallel: CP=" in run.stdout and "ring attention" in run.stdout, run.describe()
    assert ("sequence-parallel" in run.stdout) == ("--sequence-parallel" in args), run.describe()
    assert (" compiled" in run.stdout) == ("--compile" in args), run.describe()
    assert_same_curve(run, single[seq_len])


def test_checkpoint_from_dp2_cp2_resumes_on_dp4_and_one_process(single, tmp_path):
    """FSDP2 sharding over DP x CP, exact; its step-3 checkpoint resumes with DDP + ZeRO-1 on DP=4, and on one process."""
    ckpt = tmp_path / "ckpt"
    first = run_train(tiny(32) + ["--mesh-dims", "DP,CP", "--mesh-shape", "2,2", "--fsdp", "--checkpoint-dir", str(ckpt),
                                  "--checkpoint-every", "3"], tmp_path, nproc=4)
    assert_same_curve(first, single[32])
    for nproc, args in ((4, ["--mesh-shape", "4,1"]), (None, [])):
        shutil.rmtree(ckpt / f"step_{STEPS:06d}", ignore_errors=True)  # resume from step 3
        run = run_train(tiny(32) + args + ["--checkpoint-dir", str(ckpt)], tmp_path, nproc=nproc)
        assert "step_000003 (saved on mesh [2, 2]" in run.stdout, run.describe()
        assert_same_curve(run, single[32], after=3)
