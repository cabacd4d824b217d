"""The example's ``TrainConfig.plan_command``: the ``vemesh plan`` command of a run plans the job that
``bench/plan_accuracy.py`` pairs with the run's flags (whose plans it measured against the runs), and a run that
runs out of memory prints it."""

from __future__ import annotations

import shlex
from dataclasses import replace
import sys

import pytest
import torch

from conftest import REPO
from config import TrainConfig
from vemesh.cli import build_parser
from vemesh.planning.api import mesh_of
from vemesh.planning.estimate import gpt_config
from vemesh.planning.request import PlanRequest

sys.path.insert(0, str(REPO / "bench"))
from plan_accuracy import CONFIGS, predicted  # noqa: E402


def _request(argv: list[str]) -> PlanRequest:
    return PlanRequest.from_args(build_parser().parse_args(["plan", *argv]))


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_plan_command_of_a_run_plans_the_job_the_accuracy_bench_pairs_with_it(name, monkeypatch) -> None:
    procs, example, plan = CONFIGS[name]
    monkeypatch.setenv("WORLD_SIZE", str(procs))
    command = TrainConfig.from_args([*example, "--device", "cpu"]).plan_command()
    assert command.startswith("vemesh plan --model gpt:")
    ours = _request(shlex.split(command)[2:])
    theirs = _request(predicted(procs, example, plan, plan=lambda args: args))
    # the same GPT (the MoE's defaults given or not) and the preset's wrapper, given or not (None is zero1: Job.mode)
    assert gpt_config(ours.model) == gpt_config(theirs.model), command
    assert replace(ours.job(), dp_mode=ours.job().mode, model=None) == \
        replace(theirs.job(), dp_mode=theirs.job().mode, model=None), command
    assert mesh_of(ours).degrees == mesh_of(theirs).degrees, command
    assert (ours.device_type, ours.dp_replicate) == (theirs.device_type, theirs.dp_replicate), command


def test_a_run_out_of_memory_prints_its_plan_command_on_one_line(monkeypatch, capsys) -> None:
    import train

    def run(cfg, dataset, meter=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.29 GiB")

    monkeypatch.setattr(train, "run", run)
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert train.main(["--device", "cpu", "--seq-len", "512", "--max-data-bytes", "100000"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: out of memory: CUDA out of memory. Tried to allocate 2.29 GiB. Plan this run before launching "
                   "it (each rank's peak, and with --device-memory whether it fits; a search without --dp and --tp finds "
                   "the meshes that do): vemesh plan --model gpt:n_layer=2,n_embd=192,n_head=4,vocab=256,seq_len=512 "
                   "--world-size 1 --dp 1 --global-batch-size 32 --dp-mode zero1 --dtype fp32 --device-type cpu"], err
