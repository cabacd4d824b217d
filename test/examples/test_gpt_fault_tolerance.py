"""The GPT example survives failures: torchrun restarts a crashed worker, the job resumes from
its last checkpoint and ends where an uninterrupted run ends; a damaged checkpoint is skipped
and a checkpoint of another model stops the run with a clear error."""

from __future__ import annotations

import os

import pytest
from conftest import run_train

from vemesh import VESCALE_DEVICE_MESH
from vemesh.checkpoint import list_checkpoints

pytestmark = pytest.mark.slow

TINY = ["--n-layer", "2", "--n-embd", "32", "--seq-len", "32", "--global-batch-size", "8", "--max-data-bytes", "200000",
        "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--log-every", "4"]
STEPS, EVERY, FAIL_AT = 12, 4, 10
TOL = 1e-4



def test_torchrun_restarts_a_crashed_worker_and_the_run_ends_as_if_uninterrupted(tmp_path) -> None:
    args = [*TINY, "--steps", str(STEPS), "--mesh-shape", "2,2"]
    reference = run_train([*TINY, "--steps", str(STEPS), "--mesh-shape", "1,1"], tmp_path)  # one process: its loss
    assert reference.returncode == 0, reference.describe()
    loss_at = {r["step"]: r["loss"] for r in reference.records}

    ckpt = tmp_path / "ckpt"
    run = run_train([*args, "--checkpoint-dir", str(ckpt), "--checkpoint-every", str(EVERY), "--fail-at-step", str(FAIL_AT)],
                    tmp_path, nproc=4, torchrun_args=["--max-restarts=1"])
    assert run.returncode == 0, run.describe()
    assert f"rank 3: --fail-at-step {FAIL_AT}: exiting to simulate a crashed worker" in run.stderr
    first = [r["step"] for r in run.records if r["restart"] == 0]
    second = [r["step"] for r in run.records if r["restart"] == 1]
    assert first == list(range(1, len(first) + 1)) and len(first) >= FAIL_AT - 2  # up to the crash
    resumed_at = second[0] - 1
    assert resumed_at == (FAIL_AT - 1) // EVERY * EVERY  # the last checkpoint before the crash
    assert f"resumed from {ckpt / f'step_{resumed_at:06d}'}" in run.stdout
    assert second == list(range(resumed_at + 1, STEPS + 1))
    assert (FAIL_AT - 1) - resumed_at <= EVERY  # steps of work lost
    for r in run.records:  # the steps run twice, and every later one, match the uninterrupted run
        assert abs(r["loss"] - loss_at[r["step"]]) <= TOL, (r, loss_at[r["step"]])
    assert abs(run.records[-1]["loss"] - reference.records[-1]["loss"]) <= TOL
    assert [(i.step, i.ok) for i in list_checkpoints(ckpt)] == [(12, True), (8, True), (4, True)]


def test_a_damaged_checkpoint_is_skipped_and_another_model_stops_cleanly(tmp_path, capsys) -> None:
    """Single process, train.main in this process: cheap, and nothing to hang."""
    from train import main

    ckpt = tmp_path / "ckpt"
    args = [*TINY, "--steps", "8", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "4"]
    try:
        assert main(args) == 0
        shard = ckpt / "step_000008" / "__0_0.distcp"
        os.truncate(shard, shard.stat().st_size // 2)
        capsys.readouterr()

        with pytest.warns(UserWarning, match=r"skipping damaged checkpoint: .*step_000008': file '__0_0.distcp' has \d+ bytes"):
            assert main(args) == 0
        out = capsys.readouterr().out
        assert f"resumed from {ckpt / 'step_000004'}" in out and "continuing at step 5" in out
        assert [(i.step, i.ok) for i in list_checkpoints(ckpt)] == [(8, True), (4, True)]  # step 8 saved again

        assert main([*args, "--n-embd", "48"]) == 1
        err = capsys.readouterr().err
        assert f"error: cannot resume: checkpoint '{ckpt / 'step_000008'}' does not fit the model and optimizer:" in err
        assert "parameter 'wte.weight' has shape (256, 32) in the checkpoint but (256, 48) in the model" in err
    finally:
        VESCALE_DEVICE_MESH.reset()
