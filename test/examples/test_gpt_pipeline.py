"""The GPT example on a pipelined mesh, on gloo ranks in torchrun's environment (``conftest.run_train``).

Exactness: with dropout off, the same seed and global batch, every step's loss on a pipelined
mesh equals the one-process loss (``--mesh-shape 1,1,1``) within 1e-4: torch's schedules
split each DP rank's batch into equal micro-batches and scale the summed gradients by
1/micro-batches, so the update is the one-process update. That holds for every torch 2.13
schedule (the zero-bubble ones with DDP + ZeRO-1), for FSDP2 under the pipeline, and for PP with CP. A
checkpoint saved by FSDP2 with PP=2 resumes on DDP + ZeRO-1 with PP=1 on another DP x TP, and
with PP=4, and continues the same curve.
"""

from __future__ import annotations

import shutil

import pytest
from conftest import run_train, shared_run

pytestmark = pytest.mark.slow

STEPS = 6
TINY = ["--n-layer", "4", "--n-head", "4", "--n-embd", "64", "--seq-len", "32", "--global-batch-size", "16",
        "--steps", str(STEPS), "--warmup-steps", "2", "--lr", "3e-3", "--eval-every", "3", "--eval-batches", "2",
        "--sample-tokens", "8", "--log-every", "1", "--dropout", "0"]
TOL = 1e-4


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The reference: one process, ``--mesh-shape 1,1,1``, same flags."""
    run = shared_run(TINY + ["--mesh-shape", "1,1,1"], tmp_path_factory)
    assert run.returncode == 0, run.describe()
    assert len(run.records) == STEPS
    return run


def _same_curve(run, single, first_step=1):
    assert run.returncode == 0, run.describe()
    steps = list(range(first_step, STEPS + 1))
    assert [r["step"] for r in run.records][-len(steps):] == steps
    ref = {r["step"]: r for r in single.records}
    diffs = [abs(r["loss"] - ref[r["step"]]["loss"]) for r in run.records if r["step"] >= first_step]
    assert max(diffs) < TOL, f"per-step |loss - single-process loss|: {diffs}"
    evals = [abs(r["eval_loss"] - ref[r["step"]]["eval_loss"]) for r in run.records if "eval_loss" in r]
    assert evals and max(evals) < TOL, evals
    # the gradient norm too (summed over the stages): AdamW hides a constant factor on a gradient, the norm does not
    norms = [abs(r["grad_norm"] / ref[r["step"]]["grad_norm"] - 1) for r in run.records if r["step"] >= first_step]
    assert max(norms) < TOL, f"per-step relative |grad norm - single-process grad norm|: {norms}"


@pytest.mark.parametrize(
    ("nproc", "mesh", "extra"),
    [
        (4, "2,2,1", ["--pp-schedule", "gpipe"]),
        (4, "2,1,2", ["--pp-schedule", "interleaved-1f1b"]),
        (4, "4,1,1", ["--microbatches", "8"]),
        (4, "2,2,1", ["--pp-schedule", "zbv"]),  # zero-bubble with DP=2: DDP averages after the weight passes
        (4, "2,2,1", ["--pp-schedule", "dualpipev"]),
        (4, "2,2,1", ["--pp-schedule", "interleaved-zb"]),
        (8, "2,2,2", ["--mesh-dims", "PP,DP,CP", "--fsdp"]),  # FSDP2 over DP x CP under the pipeline
        # CP's ring under activation checkpointing in a pipeline: torch's stage infers its shapes with a forward
        # that never goes backward, which context_parallel once took for a recompute owed outside the ring
        (4, "2,2", ["--mesh-dims", "PP,CP", "--activation-checkpointing"]),
        # compiled blocks under a zero-bubble schedule: its split backward keeps the graph, which torch's compiled
        # backward refused ("non-empty donated buffers") until the example turned that off
        (2, "2,1,1", ["--pp-schedule", "interleaved-zb", "--compile"]),
    ],
    ids=["pp2-dp2-gpipe", "pp2-tp2-interleaved-1f1b", "pp4-8-microbatches", "pp2-dp2-zbv", "pp2-dp2-dualpipev",
         "pp2-dp2-interleaved-zb", "pp2-dp2-cp2-fsdp", "pp2-cp2-checkpointed", "pp2-interleaved-zb-compiled"],
)
def test_pipeline_matches_single_process(single, tmp_path, nproc, mesh, extra):
    run = run_train(TINY + ["--mesh-shape", mesh, *extra], tmp_path, nproc=nproc, timeout=400)
    _same_curve(run, single)
    assert "sample after 6 steps:" in run.stdout
    assert (" compiled" in run.stdout) == ("--compile" in extra), run.stdout
    if "zbv" in extra or "dualpipev" in extra:  # V-shaped: the last stage, and the loss, on PP rank 0
        assert "rank 0: PP rank 0 of 2: stage 0 (next stage on rank 2), stage 3 (next stage on rank -)" in run.stdout


def test_3d_mesh_on_8_processes(single, tmp_path):
    """(PP, DP, TP) = (2, 2, 2), the default 1f1b schedule: docs/pipeline.md's 8-process command, with FSDP2 on each stage."""
    run = run_train(TINY + ["--mesh-shape", "2,2,2", "--fsdp"], tmp_path, nproc=8, timeout=400)
    _same_curve(run, single)
    out = run.stdout
    assert "mesh PP=2 x DP=2 x TP=2" in out
    assert "pipeline: 1f1b, 2 stages over PP=2 (blocks per stage [2, 2]), 4 micro-batches of 2 sequences per DP rank" in out
    # every rank's place, found through the mesh: rank 1 is stage 0 with its next stage on rank 5
    assert "rank 1: PP rank 0 of 2: stage 0 (next stage on rank 5); next PP rank's TP submesh [4, 5]" in out
    assert "rank 6: PP rank 1 of 2: stage 1 (next stage on rank -); next PP rank's TP submesh -" in out


def test_resume_across_pipeline_shapes(single, tmp_path):
    """Save with FSDP2 on (2,2,1) after 3 steps; resume with DDP + ZeRO-1 on (1,2,2) and on (4,1,1); steps 4
    onward match the uninterrupted run."""
    ckpt = tmp_path / "ckpt"
    first = run_train(TINY + ["--mesh-shape", "2,2,1", "--fsdp", "--steps", "6", "--fail-at-step", "4",
                              "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"], tmp_path, nproc=4)
    assert first.returncode != 0 and (ckpt / "step_000003").is_dir(), first.describe()
    ckpt4 = tmp_path / "ckpt4"
    shutil.copytree(ckpt, ckpt4)
    resumed = run_train(TINY + ["--mesh-shape", "1,2,2", "--checkpoint-dir", str(ckpt)], tmp_path, nproc=4)
    assert "resumed from" in resumed.stdout and "continuing at step 4" in resumed.stdout, resumed.describe()
    _same_curve(resumed, single, first_step=4)
    deeper = run_train(TINY + ["--mesh-shape", "4,1,1", "--checkpoint-dir", str(ckpt4)], tmp_path, nproc=4)
    assert "continuing at step 4" in deeper.stdout, deeper.describe()
    _same_curve(deeper, single, first_step=4)
