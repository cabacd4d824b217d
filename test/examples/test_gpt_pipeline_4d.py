"""The 4-D trainer: every torch 2.13 schedule, FSDP2 under the pipeline, and PP with CP, each exact against one
process (every logged loss and eval loss within 1e-4 over 6 steps, dropout 0); a checkpoint saved by FSDP2
under PP=2 resumes on DDP + ZeRO-1 without PP."""

from __future__ import annotations

import shutil

import pytest
from conftest import run_train
from test_gpt_pipeline import TINY, _same_curve

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    run = run_train(TINY + ["--mesh-shape", "1,1,1"], tmp_path_factory.mktemp("single"))
    assert run.returncode == 0, run.describe()
    return run


@pytest.mark.parametrize(
    ("nproc", "args"),
    [
        (2, ["--mesh-shape", "2,1,1", "--pp-schedule", "zbv"]),
        (2, ["--mesh-shape", "2,1,1", "--pp-schedule", "dualpipev"]),
        (2, ["--mesh-shape", "2,1,1", "--pp-schedule", "interleaved-zb"]),
        (8, ["--mesh-shape", "2,2,2", "--fsdp"]),  # PP,DP,TP with FSDP2 on each stage
        (8, ["--mesh-dims", "PP,DP,CP", "--mesh-shape", "2,2,2", "--fsdp"]),  # FSDP2 over DP x CP under the pipeline
    ],
    ids=["pp2-zbv", "pp2-dualpipev", "pp2-interleaved-zb", "pp2-dp2-tp2-fsdp", "pp2-dp2-cp2-fsdp"],
)
def test_4d_matches_single_process(single, tmp_path, nproc, args):
    run = run_train(TINY + args, tmp_path, nproc=nproc, timeout=400)
    _same_curve(run, single)
    if "zbv" in args or "dualpipev" in args:  # V-shaped: the last stage, and the loss, on PP rank 0
        assert "rank 0: PP rank 0 of 2: stage 0 (next stage on rank 1), stage 3 (next stage on rank -)" in run.stdout


def test_fsdp_under_pp_checkpoint_resumes_on_ddp_without_pp(single, tmp_path):
    ckpt = tmp_path / "ckpt"
    first = run_train(TINY + ["--mesh-shape", "2,2,1", "--fsdp", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "3"],
                      tmp_path, nproc=4)
    _same_curve(first, single)
    shutil.rmtree(ckpt / "step_000006")
    resumed = run_train(TINY + ["--mesh-shape", "2,2", "--checkpoint-dir", str(ckpt)], tmp_path, nproc=4)
    assert "step_000003 (saved on mesh [2, 2, 1]" in resumed.stdout, resumed.describe()
    _same_curve(resumed, single, first_step=4)
