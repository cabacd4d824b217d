"""The planning question is one value: :class:`~vemesh.planning.PlanRequest`, built by the CLI and taken by ``plan``."""

from __future__ import annotations

import argparse
import dataclasses
import subprocess
import sys

import pytest

from vemesh.cli import build_parser
from vemesh.planning import PlanRequest, plan


def _args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["plan", *argv])


@pytest.mark.parametrize("argv, python", [
    (["--world-size", "8", "--tp", "2"], dict(world_size=8, tp=2)),
    (["--world-size", "8", "--tp", "auto", "--dp", "2"], dict(world_size=8, tp="auto", dp=2)),
    (["--world-size", "16", "--model", "gpt:n_layer=2,n_embd=64,n_head=4", "--pp", "2", "--pp-schedule", "gpipe",
      "--device-memory", "8GiB", "--dp-mode", "fsdp", "--global-batch-size", "8"],
     dict(world_size=16, model="gpt:n_layer=2,n_embd=64,n_head=4", pp=2, pp_schedule="gpipe", device_memory="8GiB",
          dp_mode="fsdp", global_batch_size=8)),
    (["--world-size", "4", "--model", "module:m:make", "--parallelize", "m:par", "--step", "m:step",
      "--moe-load-factor", "1.5", "--ep", "2"],
     dict(world_size=4, model="module:m:make", parallelize="m:par", step="m:step", moe_load_factor="1.5", ep=2)),
])
def test_the_cli_builds_the_request_python_builds_from_the_same_values(argv, python) -> None:
    assert PlanRequest.from_args(_args(*argv)) == PlanRequest(**python)


def test_every_field_of_the_request_is_a_flag_of_vemesh_plan() -> None:
    given = vars(_args("--world-size", "1"))
    assert {f.name for f in dataclasses.fields(PlanRequest)} <= set(given)


@pytest.mark.parametrize("python, message", [
    (dict(world_size=8, device_memory="8GiB"), "argument --device-memory: describes a job; give the model too"),
    (dict(world_size=8, model="gpt:n_layer=2", step="m:step"), "--parallelize and --step trace your own model"),
    (dict(world_size=8, model="module:m:make", step="m:s", sequence_parallel=True),
     "--sequence-parallel is the GPT preset's"),
    (dict(world_size=8, model="gpt:n_layer=2", pp=2, trace_pp=True),
     r"--trace-pp is for a search \(--device-memory, none of --pp, --dp, --tp\)"),
    (dict(world_size=8, trace_pp=True), "argument --trace-pp: describes a job; give the model too"),
    (dict(world_size=8, model="gpt:n_layer=2", pp=2, jobs=2), r"--jobs is for a search \(--device-memory, none of"),
    (dict(world_size=8, model="gpt:n_layer=2", device_memory="8GiB", jobs=0),
     r"--jobs must be a positive integer \(the processes that plan a search's meshes at once\); got 0"),
    (dict(world_size=8, model="gpt:n_layer=2", device_memory="8GiB", jobs=True), "--jobs must be a positive integer"),
    (dict(world_size=8, model="gpt:n_layer=2", device_memory=0), r"device_memory 0: give bytes \(at least 1\) or a size"),
    (dict(world_size=8, model="gpt:n_layer=2", device_memory=-2**30), "device_memory -1073741824: give bytes"),
    (dict(world_size=8, model="module:m:make", step="m:s", gradient_sync="every"),
     r"--gradient-sync 'every': choose last \(the last micro-batch's backward averages the gradients: no_sync on the "
     r"others\) or each \(every micro-batch's does: torchtitan's loop\)"),
    (dict(world_size=8, model="module:m:make", step="m:s", loss="m:l", pp=2, gradient_sync="each"),
     "--gradient-sync each with --pp 2: torch's schedule runs the micro-batches and averages each stage's gradients"),
    (dict(world_size=8, model="llama3:8b", gradient_sync="last"),
     "--gradient-sync last: the Llama 3 preset runs torchtitan's loop, which averages the gradients on each "
     "micro-batch's backward; give --gradient-sync each or leave it out"),
    (dict(world_size=8, model="gpt:n_layer=2", pp=2, gradient_sync="each"),
     "--gradient-sync each with --pp 2: torch's schedule runs the micro-batches and averages each stage's gradients"),
    (dict(world_size=8, gradient_sync="each"), "argument --gradient-sync: describes a job; give the model too"),
])
def test_a_request_that_cannot_be_answered_says_why(python, message) -> None:
    with pytest.raises(ValueError, match=message):
        PlanRequest(**python)


def test_plan_takes_a_request_or_its_fields_not_both() -> None:
    request = PlanRequest(world_size=4, model="gpt:n_layer=2,n_embd=64,n_head=4", tp=2, global_batch_size=4)
    assert plan(request) == plan("gpt:n_layer=2,n_embd=64,n_head=4", world_size=4, tp=2, global_batch_size=4)
    with pytest.raises(TypeError, match="takes no other arguments; got tp"):
        plan(request, tp=4)
    # the model by the flag's name too (it was "unknown argument 'model'; did you mean 'dp_mode'?")
    assert plan(model="gpt:n_layer=2,n_embd=64,n_head=4", world_size=4, tp=2, global_batch_size=4) == plan(request)
    with pytest.raises(TypeError, match=r"plan\(\) got the model twice: 'gpt:n_layer=2' and model='gpt:n_layer=4'"):
        plan("gpt:n_layer=2", model="gpt:n_layer=4", world_size=4)
    # an unknown keyword names the closest and the choices (Python's own said only "unexpected keyword argument")
    with pytest.raises(TypeError, match=r"plan\(\) got an unknown argument 'tpp'; did you mean 'tp'\? \(the arguments "
                                        r"are vemesh plan's flags: activation_checkpointing, .*world_size\)"):
        plan("gpt:n_layer=2,n_embd=64,n_head=4", world_size=4, tpp=2)


def test_building_a_request_imports_no_torch() -> None:
    code = ("import sys; from vemesh.planning import PlanRequest; "
            "PlanRequest(world_size=8, model='gpt:n_layer=2', device_memory='8GiB'); print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"


@pytest.mark.parametrize("dp_mode", ["ddp", "zero1"])
def test_a_memory_only_plan_builds_the_optimizer_of_the_device_type(dp_mode) -> None:
    """Without a profile, ``device_type`` says how the optimizer runs: on ``cuda`` (the default) torch's foreach AdamW,
    whose temporaries for every tensor at once a GPU profile's plan holds too; on ``cpu`` the loop over tensors, which
    holds one tensor's at a time. Before, every plan without a profile built the CPU's, and a cuda job's peak was low
    (this GPT under vemesh DDP: 117.9 MB planned where CUDA's AdamW holds 136.9)."""
    ask = dict(model="gpt:n_layer=2,n_embd=512,n_head=4,vocab=512,seq_len=32", world_size=2, tp=1, global_batch_size=2,
               dp_mode=dp_mode)
    cuda, cpu, gpu = (plan(PlanRequest(**ask, **kw))["peak"]
                      for kw in (dict(), dict(device_type="cpu"), dict(device_profile="h100-sxm")))
    assert cuda == gpu > cpu * 1.05, (cuda, gpu, cpu)


def test_a_pipelines_default_micro_batch_gives_torchs_schedule_enough_micro_batches() -> None:
    """With PP and no --micro-batch-size: 2 x PP micro-batches where they divide the DP rank's sequences, else the
    fewest of at least PP (1F1B refuses fewer than its stages). Before, 6 sequences over PP 4 were one micro-batch of
    6, and torch's "Number of microbatches (1) must be greater than or equal to the number of stages (4)" ended it."""
    from vemesh.planning.user_model import batch_split

    assert batch_split(16, 2, None, 2) == (8, 2)  # 4 = 2 x PP micro-batches of 2
    assert batch_split(12, 2, None, 4) == (6, 1)  # 8 does not divide 6: 6 micro-batches of 1
    assert batch_split(24, 1, None, 5) == (24, 4)  # 10 does not divide 24: 6 of 4, the fewest of at least 5
    assert batch_split(8, 2, None, 1) == (4, 4)  # no PP: the DP rank's batch
    out = plan(PlanRequest(model="gpt:n_layer=4,n_embd=16,n_head=2,vocab=64,seq_len=8", world_size=4, pp=4,
                           global_batch_size=6))
    assert (out["micro_batches"], out["micro_batch_size"]) == (6, 1), {k: out[k] for k in out if "micro" in k}


def test_a_search_rejects_a_pp_mesh_with_too_few_micro_batches_in_the_planners_words() -> None:
    """A search's PP meshes (``--trace-pp``) ask torch's schedule before any trace, as a ``--pp`` plan does, and a mesh
    it refuses is rejected naming the fix; before, the rejection was torch's own "Number of microbatches (2) must be
    ..."."""
    # one head, so TP 1 only: every PP mesh is one that torch's schedule refuses, and only DP 16 is traced
    out = plan(PlanRequest(model="gpt:n_layer=16,n_embd=16,n_head=1,vocab=64,seq_len=8", world_size=16,
                           device_memory="80GiB", global_batch_size=8, trace_pp=True))
    reasons = {r["degrees"]["PP"]: r["reason"] for r in out["rejected"] if r["degrees"]["PP"] > 1}
    assert reasons[4] == ("PP 4 under 1f1b: 2 micro-batches of 1 per DP rank (2 sequences), which torch's schedule "
                          "refuses (Number of microbatches (2) must be greater than or equal to the number of stages "
                          "(4).): give a --global-batch-size of more sequences per DP rank, or fewer PP ranks"), reasons
    assert set(reasons) == {2, 4, 8, 16}, reasons
