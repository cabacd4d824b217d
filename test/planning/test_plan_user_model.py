"""``vemesh plan`` on the user's own model: the user's factory, parallelize function and step, traced on a fake world.

In process (torch's fake backend, fake tensors): the figures are what the user's code did (each wrapper's own
storage and collectives), the shortcut over identical blocks equals tracing them all, the Python API answers what
the CLI prints, and every bad input is one line naming it. Against real runs: ``bench/plan_accuracy.py`` (and the
slow test at the end); from a wheel: ``test/packaging/test_from_a_wheel.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from launch import launch_script, plan_here
from vemesh.cli import main
from vemesh.planning import pipeline_plan, plan, step_parts
from vemesh.planning.request import PlanRequest
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.pipeline_plan import predict_pipeline, trace_pipeline
from vemesh.planning.user_model import predict_user, trace_arguments, trace_user

REPO = Path(__file__).resolve().parents[2]
JOBS = str(REPO / "test" / "models" / "llama_jobs.py")
CASES = str(REPO / "test" / "planning" / "plan_user_cases.py")
MINE = REPO / "examples" / "my_model"
MESH = {"PP": 1, "DP": 2, "CP": 1, "TP": 2, "EP": 1}
DP4 = {"PP": 1, "DP": 4, "CP": 1, "TP": 1, "EP": 1}


def _line(text: str, after: str = "") -> int:
    """The line of ``plan_user_cases.py`` that holds ``text`` (the first past the line that holds ``after``): where
    the user's code failed."""
    lines = Path(CASES).read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if after in line)
    return next(i for i, line in enumerate(lines[start:], start + 1) if text in line)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    code = main(["plan", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _fns(factory: str, parallelize: str | None, step: str = f"{JOBS}:step") -> UserFunctions:
    return UserFunctions.of(factory, parallelize, step)


def test_identical_blocks_traced_by_difference_equal_tracing_every_block() -> None:
    """A model of 9 blocks traced with 3 and 4 and the rest added by difference, each part of the step on its own
    (vemesh.planning.step_parts), equals tracing all 9 under FSDP2. Its large vocabulary makes the step peak at the end
    of the backward with few blocks, and where every block's activations are held with 9: the whole step's peak by
    difference of 2 and 3 blocks said 0.91 of it."""
    fns = _fns(f"module:{CASES}:make_head_heavy", f"{JOBS}:parallelize_fsdp")
    whole = trace_user(fns, world_size=4, degrees=DP4, micro_batch_size=2, passes=1)  # all nine blocks
    short = predict_user(fns, world_size=4, degrees=DP4, global_batch_size=8, micro_batch_size=2, dtype="fp32",
                         dp_mode=None, load_factor=1.0)
    (cls,) = short.classes
    assert any("3 and 4 of them traced, the other 5 added by difference" in n for n in short.notes)
    assert abs(cls.peak - whole.peak) <= 1e-3 * whole.peak, (cls.peak, whole.peak)
    assert cls.sent == whole.sent
    assert short.dp_mode == "fsdp"


PIPELINE = {"PP": 2, "DP": 2, "CP": 1, "TP": 1, "EP": 1}


def _pipeline_fns(factory: str, schedule: str = "1f1b") -> UserFunctions:
    name = "parallelize_pp_1f1b" if schedule == "1f1b" else "parallelize_pp_interleaved"
    return UserFunctions.of(factory, f"{JOBS}:{name}", f"{JOBS}:step_pp", f"{JOBS}:loss_fn", schedule)


@pytest.mark.slow
def test_a_users_pipeline_is_planned_through_torchs_schedule_and_its_shortcuts_equal_the_whole_trace(monkeypatch) -> None:
    """The user's parallelize function returns torch PipelineStages; each PP rank is traced running torch's schedule.
    A model of 16 identical blocks is traced with 3 and 4 per stage, each part of each stage's action scaled on its own
    (step_parts.pipeline_parts), and 12 micro-batches (of a 2-block model) with 4 and 6, the rest added by
    difference: equal to tracing everything (but for ZeRO-1's padding to DP)."""
    hidden = 128 * 256 * 4  # a sequence's hidden state, fp32: sent forward by rank 0, its gradient back by rank 1
    monkeypatch.setattr(pipeline_plan, "WHOLE_UP_TO", 1)  # the micro-batches by difference, not one pipeline of all
    for factory, batch, mbs, says in ((f"module:{CASES}:make_sixteen", 16, 4, "3 and 4 per stage traced"),
                                      (f"module:{CASES}:make_two", 24, 1, "micro-batches: 4 and 6 traced")):
        fns = _pipeline_fns(factory)
        job = dict(world_size=4, degrees=PIPELINE, global_batch_size=batch, micro_batch_size=mbs, dtype="fp32",
                   dp_mode=None, load_factor=1.0)
        short = predict_pipeline(fns, **job)
        assert [c.name for c in short.classes] == ["PP rank 0", "PP rank 1"] and short.pp_schedule == "1f1b"
        assert any(says in n for n in short.notes), short.notes
        if "sixteen" in factory:  # a stage whose blocks are not found: every block traced (the fallback is the whole)
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(step_parts, "stage_blocks", lambda *args: [])
                fallback = predict_pipeline(fns, **job)
            assert any("but stage 0's module holds fewer than two Block blocks, at 'layers'" in n and "all 16 traced" in n
                       for n in fallback.notes), fallback.notes
            whole = {rank: cls for rank, cls in enumerate(fallback.classes)}
        else:
            whole = trace_pipeline(fns, trace_arguments(**job))
        for rank, cls in enumerate(short.classes):
            assert cls.peak == pytest.approx(whole[rank].peak, abs=64) and cls.sent == whole[rank].sent
            assert cls.sent["PP"] == batch // 2 * hidden  # every sequence of the DP rank's batch, once
    with pytest.raises(ValueError, match=r"returned stages \[0, 2\] of 4 on PP rank 0; --pp-schedule 1f1b over PP 2 "
                                         r"runs 2 stages and places \[0\] on this rank"):
        predict_pipeline(UserFunctions.of(f"module:{JOBS}:make_dense", f"{JOBS}:parallelize_pp_interleaved",
                                          f"{JOBS}:step_pp", f"{JOBS}:loss_fn", "1f1b"), **job)


def test_each_stage_action_is_a_phase_and_the_micro_batch_difference_drops_their_numbers() -> None:
    """pipeline_parts names each action of a stage by its place in the step, cut at the stage's blocks (``module.``
    of a wrapper found too, or under a name of the stage's own, by their class; none found raises, and the plan traces
    every block); between actions the phase is the step's; collapse_actions keeps each stage's kind and part at its
    highest."""
    import torch

    from vemesh.planning.step_tracker import StepTracker
    from vemesh.planning.step_parts import BlocksNotFound, collapse_actions, pipeline_parts

    class Stage:
        stage_index = 1

        def __init__(self) -> None:
            self.submod = torch.nn.Sequential()
            self.submod.add_module("module", torch.nn.Module())
            self.submod.module.layers = torch.nn.ModuleList(torch.nn.Linear(2, 2) for _ in range(3))
            self.seen: list[tuple[str, str]] = []

        def forward_one_chunk(self, x: torch.Tensor) -> torch.Tensor:
            self.seen.append((tracker.phase, tracker.part))
            for layer in self.submod.module.layers:
                x = layer(x)
                self.seen.append((tracker.phase, tracker.part))
            return x

        def backward_one_chunk(self, out: torch.Tensor) -> None:
            out.sum().backward()
            self.seen.append((tracker.phase, tracker.part))

    tracker, stage = StepTracker(module_hooks=False), Stage()
    tracker.phase = "step"
    cut = [("step#0 F1", ""), ("step#0 F1", " blocks"), ("step#0 F1", " blocks"), ("step#0 F1", " head"),
           ("step#1 B1", " tail")]
    with pipeline_parts(tracker, [stage], ("layers", torch.nn.Linear)):
        out = stage.forward_one_chunk(torch.ones(1, 2, requires_grad=True))
        assert (tracker.phase, tracker.part) == ("step", "")
        stage.backward_one_chunk(out)
    assert stage.seen == cut
    assert "forward_one_chunk" not in vars(stage)  # the stage's own methods again
    # a stage that holds the blocks under a name of its own, bare or each in a wrapper: found by their class, cut the
    # same
    for wrap in (lambda block: block, torch.nn.Sequential):
        stage, tracker.phase = Stage(), "step"
        stage.submod.module.layers = torch.nn.ModuleList(wrap(block) for block in stage.submod.module.layers)
        with pipeline_parts(tracker, [stage], ("h", torch.nn.Linear)):
            stage.backward_one_chunk(stage.forward_one_chunk(torch.ones(1, 2, requires_grad=True)))
        assert stage.seen == cut
    with pytest.raises(BlocksNotFound, match=r"stage 1's module holds fewer than two Bilinear blocks, at 'h' or under"):
        with pipeline_parts(tracker, [Stage()], ("h", torch.nn.Bilinear)):
            pass
    phases = {"step#0 F1 blocks": (5, {}), "step#2 F1 blocks": (7, {}), "step#1 B1": (6, {}), "optimizer": (3, {})}
    assert collapse_actions(phases) == {"step F1 blocks": (7, {}), "step B1": (6, {}), "optimizer": (3, {})}


def test_a_step_under_cuda_autocast_is_planned_in_its_low_precision_for_cuda() -> None:
    """A step in ``torch.autocast("cuda", dtype=torch.bfloat16)``, as CUDA training loops write it: the trace's fake
    CPU tensors made torch disable it, and the plan held fp32 activations where the run holds bf16 ones. For cuda it
    is now CPU autocast of the same dtype (the plan of the same step under ``autocast("cpu")``); for cpu, torch's
    own behaviour (disabled, the fp32 step's plan)."""
    job = dict(parallelize=f"{JOBS}:parallelize_ddp", world_size=2, global_batch_size=4)
    peak = {(s, d): plan(f"module:{JOBS}:make_dense", **job, step=f"{JOBS}:{s}", device_type=d)["classes"][0]["activations"]
            for s, d in (("step", "cuda"), ("step_amp", "cuda"), ("step_amp_cpu", "cuda"), ("step_amp", "cpu"))}
    assert peak["step_amp", "cuda"] == peak["step_amp_cpu", "cuda"] < peak["step", "cuda"], peak
    assert peak["step_amp", "cpu"] == peak["step", "cuda"], peak
    # and timed in it: the autocast step's matmuls at bf16's rate, its MFU of bf16's peak (the same FLOPs)
    from vemesh.planning.profiles import load_profile
    timed = {s: plan(f"module:{JOBS}:make_dense", **job, step=f"{JOBS}:{s}", device_profile="h100-sxm")
             for s in ("step", "step_amp")}
    flops = {s: d["mfu"] * d["step_time"] * load_profile("h100-sxm").flops(p)
             for (s, d), p in zip(timed.items(), ("fp32", "bf16"))}
    assert flops["step_amp"] == pytest.approx(flops["step"], rel=1e-9), flops


def test_what_the_function_did_is_counted(capsys) -> None:
    """FSDP2 + TP: each rank holds a quarter of the weights (DP 2 x TP 2); DDP + TP holds half, and ZeRO-1 a copy.
    The same FSDP2 function with each block compiled whole first (torchtitan's habit; dynamo failed on the trace's
    fake tensors) is traced eagerly: the same plan, and a note that says so."""
    docs = {}
    for name, parallelize in (("fsdp", "parallelize_fsdp"), ("ddp", "parallelize_ddp"),
                              ("compiled", "parallelize_fsdp_compiled")):
        code, out, err = _cli(capsys, "--model", f"module:{JOBS}:make_dense", "--parallelize", f"{JOBS}:{parallelize}",
                              "--step", f"{JOBS}:step", "--world-size", "4", "--tp", "2", "--global-batch-size", "4",
                              "--json")
        assert code == 0, err
        docs[name] = json.loads(out)
    from llama_jobs import make_dense

    full = 4 * sum(p.numel() for p in make_dense().parameters())
    fsdp, ddp = docs["fsdp"]["classes"][0], docs["ddp"]["classes"][0]
    assert docs["fsdp"]["dp_mode"] == "fsdp" and docs["ddp"]["dp_mode"] == "zero1"
    assert abs(fsdp["params"] - full / 4) < 0.01 * full and abs(fsdp["optimizer"] - 2 * full / 4) < 0.01 * full
    # under TP the DDP parameters are DTensor halves (the embeddings and the head replicated), and ZeRO-1 keeps a copy
    assert full / 2 < ddp["params"] < 2 * full
    assert set(fsdp["bytes_per_step"]) == {"DP", "TP"} and set(docs["fsdp"]["how"]) >= {"activations", "not seen"}
    # FSDP2's gradients are none at the peak (made by its reduce-scatters after it): the text says why the column is 0
    code, out, err = _cli(capsys, "--model", f"module:{JOBS}:make_dense", "--parallelize", f"{JOBS}:parallelize_fsdp",
                          "--step", f"{JOBS}:step", "--world-size", "4", "--tp", "2", "--global-batch-size", "4")
    assert fsdp["grads"] == 0 and "(FSDP2: each column is what the rank holds at its peak; grads are the sharded " \
        "gradients FSDP2's reduce-scatters make, none yet at the peak (zero_grad() freed the last step's); the " \
        "unsharded ones before them count in activations)" in out, out
    compiled = [n for n in docs["compiled"]["notes"] if "torch.compile" in n]
    assert docs["compiled"]["classes"] == docs["fsdp"]["classes"] and not any("torch.compile" in n for n in
                                                                              docs["fsdp"]["notes"])
    assert len(compiled) == 1 and "'layers.0'" in compiled[0] and "ran them eagerly" in compiled[0], compiled


def test_torchs_replicate_on_fsdp2s_engine_is_planned_with_whole_parameters_and_all_reduced_gradients() -> None:
    """torch's ``replicate`` of ``replicate_with_fsdp`` (FSDP2's engine, each parameter whole on every DP rank) is
    planned as it runs: the parameters and optimizer state of vemesh DDP's plan, every gradient all-reduced once, one
    call per unit (6 blocks and the root). A real run of a 4-block model over DP 2 (bench/plan_user_run.py) peaked at
    the plan's 15,253,076 bytes, DP bytes and calls equal. Its note no longer says it sharded the model."""
    job = dict(step=f"{JOBS}:step", world_size=4, global_batch_size=4)
    replicated = plan(f"module:{CASES}:make_six", parallelize=f"{CASES}:parallelize_replicate_with_fsdp", **job)
    ddp = plan(f"module:{CASES}:make_six", parallelize=f"{JOBS}:parallelize_ddp", dp_mode="ddp", **job)
    r, d = replicated["classes"][0], ddp["classes"][0]
    assert (r["params"], r["optimizer"]) == (d["params"], d["optimizer"]), (r, d)
    assert r["bytes_per_step"]["DP"] == d["grads"] and r["calls_per_step"]["DP"] == 7, r
    assert any(n.startswith("dp mode fsdp: the parallelize function applied FSDP2 (fully_shard; or torch's "
                            "replicate_with_fsdp") for n in replicated["notes"]), replicated["notes"]


def test_torchs_own_ddp_is_planned_running_its_reducer_with_its_buckets_counted_as_gradients() -> None:
    """torch's ``DistributedDataParallel`` in the user's function was refused (its C++ reducer cannot run on fake
    tensors as it is); now the reducer runs, with the planner's all-reduce hook and no bucket re-cut
    (:mod:`vemesh.planning.torch_ddp`); so does torch's composable ``replicate`` (refused too). Its buckets are a copy of the gradients, in the grads column: under torch's
    default ``.grad`` lives beside them, so with two micro-batches (the first's gradients held through the second's
    backward) it peaks above vemesh DDP (whose ``.grad`` are views of its buffer) by the gradients once more. Real runs over DP 2 (``bench/plan_accuracy.py``: llama-torch-ddp,
    llama-torch-ddp-view-accumulate, llama-torch-replicate-accumulate, llama-pp2-1f1b-torch-ddp) peaked at the plans' bytes (ratio 1.000), DP bytes
    equal; the plan's calls per step are the first step's cut (torch re-cuts its buckets after it)."""
    job = dict(world_size=2, global_batch_size=8, micro_batch_size=2)
    torch_ddp = plan(f"module:{JOBS}:make_dense", parallelize=f"{JOBS}:parallelize_torch_ddp", step=f"{JOBS}:step",
                     **job)
    ours = plan(f"module:{JOBS}:make_dense", parallelize=f"{JOBS}:parallelize_ddp", step=f"{JOBS}:step",
                dp_mode="ddp", **job)
    t, o = torch_ddp["classes"][0], ours["classes"][0]
    assert torch_ddp["dp_mode"] == "ddp"
    assert t["params"] == o["params"], (t, o)
    # every gradient all-reduced once (fp32: the parameters' bytes) and the buffers broadcast once a step: both skip
    # the broadcast in the forward after a no_sync one
    assert t["bytes_per_step"]["DP"] == t["params"] == o["bytes_per_step"]["DP"], (t, o)
    assert t["grads"] == 2 * o["grads"] > 0, (t, o)  # the buckets, and the first micro-batch's .grad beside them
    assert torch_ddp["peak"] - ours["peak"] == o["grads"], (torch_ddp["peak"], ours["peak"])
    assert any(n.startswith("dp mode ddp: the parallelize function wrapped torch's DistributedDataParallel")
               for n in torch_ddp["notes"]), torch_ddp["notes"]
    assert any(n.startswith("torch's DistributedDataParallel ran as it is, its C++ reducer") for n in
               torch_ddp["notes"]), torch_ddp["notes"]
    # torch's composable replicate (torchtitan's DDP) builds the same DDP at the first forward, over the parameters
    # alone (no buffers to broadcast), and accumulates by set_requires_gradient_sync(False), as FSDP2 does
    composable = plan(f"module:{JOBS}:make_dense", parallelize=f"{JOBS}:parallelize_torch_replicate",
                      step=f"{JOBS}:step", **job)
    c = composable["classes"][0]
    assert (composable["dp_mode"], composable["peak"]) == ("ddp", torch_ddp["peak"]), composable
    assert c["bytes_per_step"]["DP"] == o["grads"] and c["calls_per_step"]["DP"] == t["calls_per_step"]["DP"] - 1, (c, t)


def test_replicate_with_fsdp_is_said_to_all_reduce_whole_gradients_where_fully_shard_reduce_scatters(capsys) -> None:
    """The FSDP2 table's legend and the accumulation note say what FSDP2's engine did with the gradients: under torch's
    ``replicate_with_fsdp`` they are all-reduced whole, not reduce-scattered into shards (both said "the sharded
    gradients FSDP2's reduce-scatters make" of it); under ``fully_shard``, as before. Read from the trace's
    collectives on the data-parallel dim (TP's reduce-scatters under sequence parallelism are not the gradients')."""
    job = ("--step", f"{JOBS}:step", "--world-size", "4", "--global-batch-size", "8", "--micro-batch-size", "1")
    texts = {}
    for name, parallelize, sync in (("replicate", f"{CASES}:parallelize_replicate_with_fsdp", "last"),
                                    ("replicate-each", f"{CASES}:parallelize_replicate_with_fsdp", "each"),
                                    ("shard", f"{JOBS}:parallelize_fsdp", "last")):
        code, texts[name], err = _cli(capsys, "--model", f"module:{CASES}:make_six", "--parallelize", parallelize,
                                      *job, "--gradient-sync", sync)
        assert code == 0, err
    assert "grads are the whole gradients FSDP2's all-reduces make (torch's replicate_with_fsdp)" in texts["replicate"]
    assert "so every gradient is held whole and unreduced until it" in texts["replicate"]
    assert "micro-batches' backward all-reduces its gradients (--gradient-sync each)" in texts["replicate-each"]
    assert "grads are the sharded gradients FSDP2's reduce-scatters make" in texts["shard"]
    assert "so every unsharded gradient is held until it" in texts["shard"]
    assert not any("reduce-scatter" in t for t in (texts["replicate"], texts["replicate-each"])), texts


def test_fsdp2_accumulating_micro_batches_is_planned_with_the_sync_the_loop_runs() -> None:
    """Over 4 micro-batches, FSDP2 with its gradient sync off but on the last (the habit of no_sync, the default) holds
    every unsharded gradient until then; ``--gradient-sync each`` (torchtitan's loop) reduce-scatters each micro-batch
    and holds the sharded ones alone. Each plan says which it ran. Before, only the first was planned, and the Llama 3
    preset (torchtitan's loop) was planned so too: 214 GiB a rank for 405B on DP 64 x TP 8, where 22.5 is its own.
    The GPT preset plans either, as the example runs either."""
    job = dict(parallelize=f"{JOBS}:parallelize_fsdp", step=f"{JOBS}:step", world_size=4, dp=4, global_batch_size=16,
               micro_batch_size=1)
    last, each = (plan(f"module:{JOBS}:make_dense", **job, gradient_sync=g) for g in (None, "each"))
    assert (last["gradient_sync"], each["gradient_sync"]) == ("last", "each")
    assert each["peak"] < last["peak"], (each["peak"], last["peak"])
    assert each["classes"][0]["calls_per_step"]["DP"] > last["classes"][0]["calls_per_step"]["DP"]
    assert any("FSDP2's gradient sync off but on the last of the 4 micro-batches" in n and "--gradient-sync each" in n
               for n in last["notes"]), last["notes"]
    assert any("each of the 4 micro-batches' backward reduce-scatters" in n for n in each["notes"]), each["notes"]
    # the GPT preset runs the example's loop, which takes either (examples/gpt: --gradient-sync, refused until
    # 2026-12-07 as a flag of the Llama 3 preset and your own functions alone)
    gpt = dict(world_size=2, dp=2, global_batch_size=8, micro_batch_size=2, dp_mode="fsdp")
    last, each = (plan("gpt:n_layer=2,n_embd=64,n_head=4,vocab=256,seq_len=32", **gpt, gradient_sync=g)
                  for g in (None, "each"))
    assert (last["gradient_sync"], each["gradient_sync"], last["micro_batches"]) == ("last", "each", 2)
    assert each["peak"] < last["peak"], (each["peak"], last["peak"])
    assert each["classes"][0]["calls_per_step"]["DP"] > last["classes"][0]["calls_per_step"]["DP"]


@pytest.mark.slow
def test_the_python_api_answers_what_the_cli_prints(capsys, monkeypatch) -> None:
    monkeypatch.chdir(MINE)
    monkeypatch.syspath_prepend(str(MINE))
    import mymodel

    code, out, err = _cli(capsys, "--model", "module:mymodel:make", "--parallelize", "mymodel:parallelize",
                          "--step", "mymodel:step", "--world-size", "4", "--tp", "2", "--global-batch-size", "8", "--json")
    assert code == 0, err
    cli = json.loads(out)
    api = plan(mymodel.make, parallelize=mymodel.parallelize, step=mymodel.step, world_size=4, tp=2,
               global_batch_size=8)
    assert api["peak"] == cli["peak"] and api["classes"] == cli["classes"]
    assert api["model"] == "mymodel:make" and cli["model"] == "module:mymodel:make"
    search = plan("module:mymodel:make", parallelize="mymodel:parallelize", step="mymodel:step", world_size=4,
                  global_batch_size=8, device_memory="1GiB")
    tried = {f["degrees"]["TP"] for f in search["fits"]} | {r["degrees"]["TP"] for r in search["rejected"]}
    assert tried == {1, 2, 4} and search["fits"], search  # every TP of 4 ranks; the model runs at each
    assert all(f["peak"] <= 2**30 for f in search["fits"]) and all(r["reason"] for r in search["rejected"])


def test_a_plan_entry_torch_skips_is_said_and_planned_as_it_would_run(monkeypatch) -> None:
    """A TP plan entry that names no submodule (a plan written for another model's names): torch's parallelize_module
    warns and skips it, and the plan, which hides the user's warnings, said nothing. It is a note now, once (not
    once per block traced), with where torch looked."""
    monkeypatch.syspath_prepend(str(MINE))
    import mymodel
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    def stale(model, mesh):  # type: ignore[no-untyped-def]
        for block in model.blocks:
            parallelize_module(block, mesh["TP"], {"attn.q_proj": ColwiseParallel()})
        return mymodel.parallelize(model, mesh)

    with_stale = plan(mymodel.make, parallelize=stale, step=mymodel.step, world_size=4, tp=2, global_batch_size=4)
    said = [n for n in with_stale["notes"] if "parallelize_module skipped" in n]
    assert said == ["torch's parallelize_module skipped 1 plan entry whose name matches no submodule: 'attn.q_proj' in "
                    "Block (no child matches 'attn'). What it names stays unsharded, replicated on every TP rank (and "
                    "planned so: the figures are of the model as it would run); name each module as the model names "
                    "it (print(model) shows the names)"], with_stale["notes"]


@pytest.mark.slow
def test_stages_of_torchs_tracer_frontend_are_planned_as_the_same_stages_cut_by_hand() -> None:
    """torch's tracer frontend (``pipeline(model, mb_args, split_spec)``, then ``pipe.build_stage``) gives its own stage
    class, which the planner refused ("the planner runs PipelineStage stages"); ``vemesh check`` ran it, exact. Its
    stages know their shapes from the graph. Planned, each PP rank equals the same stages cut by hand into
    ``PipelineStage`` modules, every figure, and a note says that the stage's graph keeps every stage's parameters
    alive (a gloo run holds the other stage's parameters more than the hand-cut run, to the byte: BENCHMARKS.md)."""
    jobs = str(REPO / "test" / "models" / "tracer_pipe_jobs.py")
    common = dict(step=f"{jobs}:step", loss=f"{jobs}:loss_fn", world_size=2, pp=2, global_batch_size=4,
                  micro_batch_size=1, device_type="cpu")
    traced, by_hand = (plan(f"module:{jobs}:make", parallelize=f"{jobs}:{fn}", **common)
                       for fn in ("parallelize", "parallelize_by_hand"))
    assert traced["classes"] == by_hand["classes"], (traced["classes"], by_hand["classes"])
    assert any("torch's tracer frontend's (pipeline(...).build_stage)" in n for n in traced["notes"]), traced["notes"]
    assert not any("tracer frontend" in n for n in by_hand["notes"])


@pytest.mark.slow
def test_a_search_with_the_pipelines_loss_plans_pp_meshes_as_a_plan_of_each_does() -> None:
    """With ``--loss`` a search over the user's functions tries PP too (up to the blocks), each PP mesh traced through
    torch's schedule as ``--pp`` plans it: the same peak and bytes per PP rank. Without ``--loss``, no PP mesh."""
    # on cpu: on cuda torch's foreach AdamW refuses this function's TP mesh, whose norms stay plain tensors
    fns = dict(parallelize=f"{JOBS}:parallelize_any", step=f"{JOBS}:step_any", world_size=2, global_batch_size=4,
               device_memory="1GiB", device_type="cpu")
    search = plan(f"module:{JOBS}:make_dense", loss=f"{JOBS}:loss_fn", **fns)
    tried = {(f["degrees"]["PP"], f["degrees"]["TP"]) for f in (*search["fits"], *search["rejected"])}
    assert tried == {(1, 1), (1, 2), (2, 1)} and not search["rejected"], search["rejected"]
    (piped,) = [f for f in search["fits"] if f["degrees"]["PP"] == 2]
    one = plan(f"module:{JOBS}:make_dense", loss=f"{JOBS}:loss_fn", pp=2, dp=1, micro_batch_size=1,
               **{k: v for k, v in fns.items() if k != "device_memory"})
    assert len(one["classes"]) == 2  # a scalar's bytes apart at most: the order of the loss's allocation
    assert [c["peak"] for c in piped["classes"]] == pytest.approx([c["peak"] for c in one["classes"]], abs=64)
    assert [c["bytes_per_step"] for c in piped["classes"]] == [c["bytes_per_step"] for c in one["classes"]]
    flat = plan(f"module:{JOBS}:make_dense", **dict(fns, parallelize=f"{JOBS}:parallelize_ddp", step=f"{JOBS}:step"))
    assert {f["degrees"]["PP"] for f in (*flat["fits"], *flat["rejected"])} == {1}


def test_moe_load_factor_raises_the_busiest_ranks_peak_and_is_said(capsys) -> None:
    peaks = {}
    for factor in ("1", "1.5"):
        code, out, err = _cli(capsys, "--model", f"module:{JOBS}:make_moe", "--parallelize", f"{JOBS}:parallelize_ddp",
                              "--step", f"{JOBS}:step", "--world-size", "2", "--ep", "2", "--global-batch-size", "4",
                              "--moe-load-factor", factor)
        assert code == 0, err
        assert f"the busiest EP rank receives {factor} x the balanced share (--moe-load-factor" in out
        peaks[factor] = float(next(line for line in out.splitlines() if line.startswith("  every rank")).split()[-1])
    assert peaks["1.5"] > peaks["1"]


def test_fsdp_on_a_mesh_without_data_parallel_ranks_is_one_line_saying_so(capsys) -> None:
    """--dp-mode fsdp where DP x CP = 1 and the function wrapped nothing: one line that names the mesh's lack, not
    the function's (the Llama 3 preset, fsdp by default, wraps nothing at DP 1, as torchtitan does)."""
    code, out, err = _cli(capsys, "--model", f"module:{CASES}:make_six", "--parallelize", f"{CASES}:parallelize_nothing",
                          "--step", f"{JOBS}:step", "--world-size", "1", "--dp-mode", "fsdp", "--global-batch-size", "4")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "--dp-mode fsdp, but the mesh has no data-parallel ranks (DP x CP = 1) for FSDP2 to shard over" in err
    assert "plan this mesh with --dp-mode ddp" in err


def test_a_function_that_wraps_nothing_on_a_mesh_without_dp_is_planned_as_none_not_ddp(capsys) -> None:
    """At DP x CP = 1 a function may wrap nothing: the plan names no wrapper it did not see ("ddp" was said before,
    for a DDP the function never made), in the text, its note and the JSON."""
    args = ("--model", f"module:{CASES}:make_two", "--parallelize", f"{CASES}:parallelize_nothing", "--step",
            f"{JOBS}:step", "--world-size", "1", "--global-batch-size", "2")
    code, out, err = _cli(capsys, *args)
    assert code == 0, err
    assert ", fp32, none; global batch 2" in out
    assert "note: dp mode none: the parallelize function wrapped no data parallelism (the mesh has none)" in out
    code, out, err = _cli(capsys, *args, "--json")
    assert code == 0 and json.loads(out)["dp_mode"] == "none", err


def test_the_models_own_buffers_are_in_the_params_column_and_a_large_share_is_said(capsys) -> None:
    """A buffer of 2 MiB in each of 8 blocks (traced with 3 and 4, the rest by difference): the params column and the
    peak are 16 MiB more than the same model's without, and a note names the buffers' bytes and their largest kind.
    Without them no note is said (the buffers the model has, RoPE's cos and sin, are under a tenth of the column)."""
    def plan(factory: str) -> tuple[dict, str]:
        args = ("--model", f"module:{CASES}:{factory}", "--parallelize", f"{JOBS}:parallelize_ddp", "--step",
                f"{JOBS}:step", "--world-size", "2", "--global-batch-size", "2")
        code, out, err = _cli(capsys, *args)
        assert code == 0, err
        code, js, err = _cli(capsys, *args, "--json")
        return json.loads(js), out

    (plain, plain_out), (tables, out) = plan("make_eight"), plan("make_eight_with_tables")
    row, with_tables = plain["classes"][0], tables["classes"][0]
    assert with_tables["params"] - row["params"] == with_tables["peak"] - row["peak"] == 16 * 2**20, (row, with_tables)
    assert "note: the params column includes the model's own buffers, 16." in out, out
    assert "the largest: layers.*.table, 2.00 MiB each" in out, out
    assert "own buffers" not in plain_out, plain_out


def test_torchs_fully_shard_without_a_mesh_plans_as_vemeshs_on_the_dp_mesh(capsys) -> None:
    """torch's ``fully_shard(module)`` makes its own 1-D mesh over the world (``init_device_mesh``, which computes with
    its rank tensor): planned on DP 4 it gives the figures of vemesh's ``fully_shard`` on the DP mesh, its bytes on
    DP. Before, the plan refused it as a function that needs a tensor's values."""
    def plan(parallelize: str) -> dict:
        code, out, err = _cli(capsys, "--model", f"module:{CASES}:make_two", "--parallelize", parallelize, "--step",
                              f"{JOBS}:step", "--world-size", "4", "--global-batch-size", "4", "--json")
        assert code == 0, err
        return json.loads(out)

    torchs, vemeshs = plan(f"{CASES}:parallelize_torch_fsdp"), plan(f"{JOBS}:parallelize_fsdp")
    assert torchs["dp_mode"] == "fsdp" and torchs["classes"][0]["bytes_per_step"]["DP"] > 0, torchs
    assert (torchs["peak"], torchs["classes"]) == (vemeshs["peak"], vemeshs["classes"])


def test_a_users_file_imports_the_files_beside_it_from_any_directory(tmp_path, monkeypatch) -> None:
    """``--model module:other/dir/mine.py:make`` runs ``mine.py``, which imports ``helpers.py`` beside it: its
    directory goes first on ``sys.path``, as ``python other/dir/mine.py`` puts it. Before, the import failed unless
    vemesh ran from that directory."""
    from vemesh.planning.estimate import load_object

    folder = tmp_path / "other" / "dir"
    folder.mkdir(parents=True)
    (folder / "vemesh_sibling_helpers.py").write_text("WIDTH = 7\n")
    (folder / "vemesh_sibling_mine.py").write_text("from vemesh_sibling_helpers import WIDTH\n\n"
                                                   "def make():\n    return WIDTH\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "modules", dict(sys.modules))
    make = load_object("other/dir/vemesh_sibling_mine.py", "make", "--model")
    assert make() == 7


@pytest.mark.parametrize("args, says", [
    ((f"module:{CASES}:make_fails", f"{JOBS}:parallelize_ddp", f"{JOBS}:step"),
     "make_fails failed at {cases}:{make} in make_fails: RuntimeError: no checkpoint at /models/base"),
    ((f"module:{CASES}:make_not_a_module", f"{JOBS}:parallelize_ddp", f"{JOBS}:step"),
     "make_not_a_module returned a dict, not an nn.Module"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_fails", f"{JOBS}:step"),
     "parallelize_fails failed at {cases}:{parallelize} in parallelize_fails: KeyError: 'layers.9'"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_tp_then_torch_fsdp", f"{JOBS}:step", "--tp", "2"),
     "parallelize_tp_then_torch_fsdp failed at {cases}:{fsdp} in parallelize_tp_then_torch_fsdp: TypeError: Invariant "
     "encountered: value was None when it should not be; FSDP2's fully_shard was given a mesh without dim names for "
     "a parameter that TP already shards"),
    ((f"module:{CASES}:make_side_by_side_in_place", f"{CASES}:parallelize_side_by_side",
      f"{CASES}:step_side_by_side", "--tp", "2"),
     "RuntimeError: Output 0 of _ToTorchTensor is a view and is being modified inplace."),
    ((f"module:{CASES}:make_side_by_side_in_place", f"{CASES}:parallelize_side_by_side",
      f"{CASES}:step_side_by_side", "--tp", "2"),
     "; a TP style's output (DTensor.to_local(), a view made inside an autograd Function) is written in place by the "
     "model at that line (Falcon adds its attention's output into its MLP's with +=), which autograd refuses: have "
     "the module whose output is written return a copy, module.register_forward_hook(lambda module, args, out: "
     "out.clone())"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_fsdp_then_tp", f"{JOBS}:step", "--tp", "2"),
     "; a TP style met a parameter that is already a DTensor over another mesh (FSDP2's fully_shard, or another "
     "style, ran on it first): apply the TP plan first and then fully_shard, as torchtitan does"),
    ((f"module:{CASES}:make_six", f"{JOBS}:parallelize_fsdp", f"{CASES}:step_forward_only"),
     "step_forward_only computed no gradient (no parameter has one after it), but a plan is of a "
     "training step, its backward and its optimizer's state included: call loss.backward() in it"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_fsdp_blocks_only", f"{JOBS}:step"),
     "parallelize_fsdp_blocks_only sharded modules with FSDP2, but 3 trainable parameters (tok_embeddings.weight, "
     "norm.weight, output.weight) are under no FSDP2 unit: their gradients would never be averaged over the 4 "
     "data-parallel ranks (DP); call fully_shard on the root too"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_tp_on_the_whole_mesh", f"{JOBS}:step", "--tp", "2"),
     "Found placements length: 1, and device_mesh.ndim: 2; torch's TP styles split a module over one mesh dim, and "
     "parallelize_module was given the whole mesh: give it the TP dim, parallelize_module(module, mesh['TP'], plan)"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_offloaded", f"{JOBS}:step"),
     "parallelize_offloaded sharded the model with FSDP2's CPUOffloadPolicy, whose parameters, gradients and "
     "optimizer state live in host memory: the planner does not plan CPU offload"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_offloaded", f"{JOBS}:step", "--device-type", "cpu"),
     "AssertionError: NYI: aten._pin_memory.default; FSDP2's CPUOffloadPolicy pins the offloaded shards in host "
     "memory (pin_memory=True, its default), which needs an accelerator"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_offloaded_unpinned", f"{JOBS}:step"),
     "parallelize_offloaded_unpinned sharded the model with FSDP2's CPUOffloadPolicy, whose parameters, gradients "
     "and optimizer state live in host memory: the planner does not plan CPU offload"),
    ((f"module:{CASES}:make_flex", f"{CASES}:parallelize_mlp", f"{CASES}:step_flex"),
     "FlexAttention does not support backward on CPU. Please set the input requires_grad to False or use another "
     "device; vemesh check runs on this machine's CPU and vemesh plan traces on fake CPU tensors, where torch's "
     "FlexAttention has no backward: check and plan the model with SDPA attention"),
    ((f"module:{CASES}:make_mlp", f"{CASES}:parallelize_mlp", f"{CASES}:step_mlp_timed"),
     "Tried to instantiate dummy base class Event; vemesh plan and vemesh check run your functions on this machine's "
     "CPU: a device they name (device='cuda', .to('cuda'), .cuda(), model.to(device)) is the CPU there, but "
     "torch.cuda's own functions (torch.cuda.synchronize(), current_device(), set_device(), events, streams, memory "
     "statistics) need CUDA"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_torch_ddp", f"{JOBS}:step", "--dp-mode", "zero1"),
     "--dp-mode zero1 needs vemesh DDP, and --parallelize {cwd}/{cases}:parallelize_torch_ddp wrapped torch's "
     "DistributedDataParallel: give --dp-mode ddp"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_torch_ddp_unused", f"{JOBS}:step"),
     "parallelize_torch_ddp_unused built torch's DistributedDataParallel with find_unused_parameters=True, under which "
     "its reducer reads which parameters each rank used"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_torch_ddp_compressed", f"{JOBS}:step"),
     "parallelize_torch_ddp_compressed gave torch's DistributedDataParallel a comm hook: the planner runs torch's "
     "reducer with its plain all-reduce and would not count the hook's own work"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_fsdp1", f"{JOBS}:step"),
     "FSDP needs a non-CPU accelerator device, but no accelerator device is detected; torch's "
     "FullyShardedDataParallel (FSDP1) needs an accelerator, and your functions run on this machine's CPU here; vemesh "
     "plan and vemesh check take FSDP2"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_fsdp1_on_cpu", f"{JOBS}:step"),
     "parallelize_fsdp1_on_cpu wrapped torch's FullyShardedDataParallel (FSDP1), which the planner does not plan; "
     "vemesh plan and vemesh check take FSDP2, torch's successor to it"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_reshard_to_pairs", f"{JOBS}:step"),
     "in parallelize_reshard_to_pairs: ValueError: FSDP2's reshard_after_forward=2 reshards each unit over groups of "
     "2 of its 4 ranks after forward, groups that are no mesh dim: the planner does not plan it"),
    # a mesh dim the functions leave idle: each of its ranks would do what its peers do (a plan of another job)
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_torch_ddp", f"{JOBS}:step", "--tp", "2"),
     "the mesh has TP 2, but --parallelize {cwd}/{cases}:parallelize_torch_ddp sharded no parameter over TP and the "
     "step ran no collective on it: every TP rank would hold and compute the whole model, as its TP peers do; apply a "
     "TP plan"),
    ((f"module:{CASES}:make_six", f"{JOBS}:parallelize_fsdp", f"{CASES}:step_without_cp", "--cp", "2"),
     "ran no collective on CP: every CP rank would compute whole sequences, as its CP peers do; run the forward and "
     "backward inside vemesh.parallel.context_parallel(mesh['CP'], ...) (or torch's), or plan with --cp 1"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_returns_none", f"{JOBS}:step"),
     "parallelize_returns_none returned NoneType, not the model"),
    ((f"module:{CASES}:make_six", f"{CASES}:parallelize_nothing", f"{JOBS}:step"),
     "parallelize_nothing wrapped no data parallelism, but the mesh has 4 data-parallel ranks (DP)"),
    ((f"module:{CASES}:make_six", f"{JOBS}:parallelize_ddp", f"{CASES}:step_reads_loss"),
     "step_reads_loss needs a tensor's values at {cases}:{step} in step_reads_loss"),
    ((f"module:{CASES}:make_six", f"{JOBS}:parallelize_ddp", f"{CASES}:step_with_own_group"),
     "the step ran allreduce_ on a group of ranks [0, 1] that is none of the mesh's dims (DP)"),
    (("module:nosuchmodule:make", f"{JOBS}:parallelize_ddp", f"{JOBS}:step"),
     "no module named 'nosuchmodule' in the current directory {cwd}"),
    ((f"module:{CASES}:make_six", f"{CASES}:no_such_function", f"{JOBS}:step"),
     "has no 'no_such_function'; its callables are"),
    ((f"module:{CASES}:make_six", f"{JOBS}:parallelize_ddp", f"{CASES}:make_six"),
     "takes (), but is called as step(model, micro_batch_size): one forward and backward of a micro-batch"),
])
def test_each_bad_input_is_one_line_naming_it(capsys, args, says) -> None:
    """Each says what went wrong in the user's words: torch's FSDP2 over the whole world on a model that TP shards
    raised torch's own ``Invariant encountered: value was None``, and now also says what to write instead. FSDP2's CPU
    offload raised torch's "NYI: aten._pin_memory.default" from the trace (pinned; planned for the CPU it still does,
    and is said), or planned the host's shards as the device's memory: refused. FlexAttention, which has no backward on a CPU, names SDPA."""
    model, parallelize, step, *more = args
    code, out, err = _cli(capsys, "--model", model, "--parallelize", parallelize, "--step", step, "--world-size", "4",
                          "--global-batch-size", "4", *more)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("vemesh: error: "), err
    lines = dict(make=_line("raise RuntimeError"), parallelize=_line("raise KeyError"), step=_line("loss.item()"),
                 fsdp=_line("        fully_shard(block)", after="def parallelize_tp_then_torch_fsdp"))
    assert says.format(cases=os.path.relpath(CASES), cwd=os.getcwd(), **lines) in err, err


def test_activations_saved_on_the_cpu_leave_a_cuda_plans_device_memory(capsys) -> None:
    """``torch.autograd.graph.save_on_cpu`` moves what autograd saves to the host, and back for the backward. On the
    trace's fake CPU tensors it left them where they were (pinned: copied them beside, whose pinning the fake tensors
    refuse), and a CUDA plan counted them on the device. Now a plan for CUDA holds them off the device between the
    forward and the backward (8 layers: 1,310,728 bytes of activations at the peak, not 3,407,880); one for the CPU
    runs torch's own."""
    peaks = {}
    for step in ("step_mlp", "step_mlp_saved_on_cpu"):
        for device in ("cuda", "cpu"):
            code, out, err = _cli(capsys, "--model", f"module:{CASES}:make_mlp", "--parallelize", f"{CASES}:parallelize_mlp",
                                  "--step", f"{CASES}:{step}", "--world-size", "2", "--global-batch-size", "8",
                                  "--device-type", device, "--json")
            assert code == 0, err
            peaks[step, device] = json.loads(out)["classes"][0]["activations"]
    saved = 8 * 2 * (4 * 64 * 256 * 4)  # each layer's input and Tanh's output, 4 x 64 rows of 256 fp32 values
    assert peaks["step_mlp", "cpu"] == peaks["step_mlp", "cuda"], peaks
    # on the CPU torch's pinned save_on_cpu copies each saved tensor (nothing to pin): the trace runs it as it is
    assert peaks["step_mlp_saved_on_cpu", "cpu"] > peaks["step_mlp", "cpu"], peaks
    assert peaks["step_mlp", "cuda"] - peaks["step_mlp_saved_on_cpu", "cuda"] >= saved // 2, (peaks, saved)


def test_functions_written_for_cuda_are_planned_and_checked_on_this_cpu(capsys) -> None:
    """A GPU script's factory (``with torch.device("cuda"):``, ``.cuda()``), parallelize function (``model.to("cuda")``) and step (``device="cuda"``,
    ``.to("cuda")``, ``.pin_memory()``) failed here ("Torch not compiled with CUDA enabled"; in a plan, "found at
    least two devices, cpu and cuda:0", "Couldn't swap Linear.weight"). The device they name is this CPU: the plan is
    the one of the same functions written for the CPU, and vemesh check runs them, exact."""
    from vemesh.check import check

    plans = []
    for make, parallelize, step in (("make_mlp", "parallelize_mlp", "step_mlp_target"),
                                    ("make_mlp_cuda", "parallelize_mlp_to_cuda", "step_mlp_cuda")):
        code, out, err = _cli(capsys, "--model", f"module:{CASES}:{make}", "--parallelize", f"{CASES}:{parallelize}",
                              "--step", f"{CASES}:{step}", "--world-size", "2", "--global-batch-size", "8", "--json")
        assert code == 0, err
        doc = json.loads(out)
        plans.append((doc["peak"], doc["classes"][0]["bytes_per_step"]))
    assert plans[0] == plans[1], plans
    result = check(f"module:{CASES}:make_mlp_cuda", f"{CASES}:parallelize_mlp_to_cuda", f"{CASES}:step_mlp_cuda",
                   world_size=2)
    assert result.exact, result.render()


def test_the_copy_the_in_place_error_asks_for_plans(capsys) -> None:
    """What the error above says to write (the module whose output is written returns a copy) plans: Falcon's shape
    under torch's TP styles, said and then planned."""
    code, out, err = _cli(capsys, "--model", f"module:{CASES}:make_side_by_side_in_place", "--parallelize",
                          f"{CASES}:parallelize_side_by_side_copied", "--step", f"{CASES}:step_side_by_side",
                          "--world-size", "4", "--global-batch-size", "4", "--tp", "2")
    assert code == 0 and "peak" in out, err


def test_an_optimizer_step_that_fails_on_cuda_is_one_line_naming_why(capsys) -> None:
    """HF's Qwen3-MoE with its experts as DTensors over EP and the rest plain under vemesh DDP: on a GPU profile the
    plan steps torch's AdamW as torch runs it on cuda (foreach), which refuses the mix; said in one line, with the
    way out, where it was a traceback from inside torch. The way out is planned as the hint says (torch's loop,
    ``--optimizer-implementation for-loop``); fused AdamW refuses the mix as foreach does."""
    hf = str(REPO / "test" / "models" / "hf_jobs.py")
    args = ("--model", f"module:{hf}:make_qwen3_moe", "--parallelize", f"{hf}:parallelize_ddp", "--step", f"{hf}:step",
            "--world-size", "2", "--ep", "2", "--dp-mode", "ddp", "--global-batch-size", "8", "--device-profile",
            "h100-sxm")
    code, out, err = _cli(capsys, *args)
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert err.startswith(f"vemesh: error: AdamW (foreach, as torch runs it on cuda).step() failed on what "
                          f"--parallelize {hf}:parallelize_ddp returned: RuntimeError: aten._foreach_mul_"), err
    assert "its parameters mix DTensors and plain tensors" in err and "foreach=False" in err, err
    assert err.rstrip().endswith("and plan it so with --optimizer-implementation for-loop"), err
    code, out, err = _cli(capsys, *args, "--optimizer-implementation", "fused")
    assert code == 2 and err.startswith("vemesh: error: AdamW (fused, --optimizer-implementation).step() failed"), err
    assert "aten._fused_adamw_.default got mixed torch.Tensor and DTensor" in err, err
    code, out, err = _cli(capsys, *args, "--optimizer-implementation", "for-loop")
    assert code == 0 and "step time on h100-sxm" in out, err


def test_a_tp_degree_that_does_not_divide_the_kv_heads_is_said_with_the_degrees_that_do(capsys) -> None:
    """HF's Qwen3-MoE (2 KV heads of 32) under TP 4: the attention's view raises on a quarter of k_proj's 64
    features. The plan's one line says why after the user's error, as vemesh check does, so that a search rejects the
    mesh with its reason."""
    hf = str(REPO / "test" / "models" / "hf_jobs.py")
    code, out, err = _cli(capsys, "--model", f"module:{hf}:make_qwen3_moe", "--parallelize", f"{hf}:parallelize_tp",
                          "--step", f"{hf}:step", "--world-size", "4", "--tp", "4", "--global-batch-size", "4")
    assert code == 2 and out == "" and err.count("\n") == 1, err
    assert "is invalid for input of size" in err and err.rstrip().endswith(
        "; TP 4 does not divide model.layers.0.self_attn.k_proj's 2 heads (head_dim 32): each rank would hold 16 of "
        "its 64 features, part of a head. Choose TP from 1, 2, which divide the heads of every projection TP splits"), \
        err


def test_the_optimizer_implementation_changes_the_optimizers_ops_and_bytes_not_the_model(capsys) -> None:
    """torchtitan's three optimizer implementations on a GPU profile, on the same FSDP2 plan: the same peak; the loop
    over tensors and foreach move the same bytes (each of AdamW's ops reads and writes its tensors; foreach's were
    counted reading them only), and fused AdamW a third of them (it reads the parameter, its gradient and the two
    moments once, and writes three: 7 bytes of the loop's 21). A value that is none of them is one line naming the
    three."""
    times = {}
    for how in ("for-loop", "foreach", "fused"):
        answered = plan(f"module:{JOBS}:make_dense", parallelize=f"{JOBS}:parallelize_fsdp", step=f"{JOBS}:step",
                        world_size=4, global_batch_size=4, device_profile="h100-sxm", optimizer_implementation=how)
        times[how] = (answered["peak"], answered["time"]["optimizer"])
        assert answered["optimizer_implementation"] == how
    assert len({peak for peak, _ in times.values()}) == 1, times
    assert times["for-loop"][1] == pytest.approx(times["foreach"][1], rel=1e-4), times
    assert times["fused"][1] / times["foreach"][1] == pytest.approx(1 / 3, rel=0.01), times
    with pytest.raises(ValueError, match=r"^--optimizer-implementation 'fast': choose one of for-loop, foreach, fused "
                       r"\(or leave it out: as torch picks on the device\)$"):
        PlanRequest(model=f"module:{JOBS}:make_dense", world_size=4, optimizer_implementation="fast")


@pytest.mark.parametrize("extra, says", [
    (("--dp-mode", "fsdp"), "--dp-mode fsdp, but --parallelize"),
    (("--tp", "2", "--parallelize", ""), None),
    (("--pp", "2"), "with PP the planner runs torch's pipeline schedule, which computes the loss on the last stage: "
                    "give --loss MODULE:FUNCTION"),
    (("--moe-load-factor", "0.5"), "the MoE load factor must be a number >= 1"),
    (("--sequence-parallel",), "--sequence-parallel is the GPT preset's; with --parallelize your function decides it"),
])
def test_flags_that_contradict_the_users_functions_are_refused(capsys, extra, says) -> None:
    base = ["--model", f"module:{CASES}:make_six", "--parallelize", f"{JOBS}:parallelize_ddp", "--step", f"{JOBS}:step",
            "--world-size", "4", "--global-batch-size", "4"]
    if says is None:  # TP without a parallelize function: the planner does not invent a TP plan
        base = ["--model", f"module:{CASES}:make_six", "--step", f"{JOBS}:step", "--world-size", "4", "--tp", "2",
                "--global-batch-size", "4"]
        extra, says = (), "TP > 1 need your parallelize function (--parallelize MODULE:FUNCTION)"
    code, out, err = _cli(capsys, *base, *extra)
    assert code == 2 and says in err, err


def test_a_step_alone_gets_the_data_parallelism_dp_mode_names(capsys) -> None:
    for mode in ("ddp", "fsdp"):
        code, out, err = _cli(capsys, "--model", f"module:{CASES}:make_six", "--step", f"{JOBS}:step", "--world-size",
                              "2", "--global-batch-size", "4", "--dp-mode", mode, "--json")
        assert code == 0, err
        doc = json.loads(out)
        assert doc["dp_mode"] == mode and doc["classes"][0]["bytes_per_step"]["DP"] > 0


def test_a_forward_that_counts_its_blocks_is_traced_whole(capsys) -> None:
    code, out, err = _cli(capsys, "--model", f"module:{CASES}:make_eight", "--parallelize",
                          f"{CASES}:parallelize_counts_blocks", "--step", f"{JOBS}:step", "--world-size", "2",
                          "--global-batch-size", "4")
    assert code == 0, err
    assert "did not run with 3 of them (KeyError); all 8 traced" in out


@pytest.mark.slow
def test_the_plan_is_within_ten_percent_of_a_real_run(tmp_path) -> None:
    """DDP + ZeRO-1 + TP on 4 gloo ranks, CP 2 on 2, HF's Qwen3-MoE (its fused experts through grouped_mm, fp32)
    with EP 2 on 2, and torch's own DDP on 2: the same functions planned and run (3 steps, MemTracker), the MoE at
    balanced routing and at the run's own load factor."""
    sys.path.insert(0, str(REPO / "bench"))
    import plan_accuracy

    for name in ("llama-zero1-tp2", "llama-cp2", "hf-qwen3moe-ep2-ddp", "llama-torch-ddp"):  # ranks, plans from here
        for row in plan_accuracy.compare(name, launch_script, plan_here):
            assert abs(row["peak_ratio"] - 1) <= 0.10, row
            if "load_factor" in row:  # the busiest rank's bytes; at F = 1 they are the mean over the ranks, checked
                continue
            for dim, b in row["bytes"].items():
                assert b["measured"] and abs(b["predicted"] / b["measured"] - 1) <= 0.01, (name, dim, b)


@pytest.mark.slow
def test_pytorch_examples_llama2_as_shipped_is_planned_within_ten_percent_of_a_real_run() -> None:
    """pytorch/examples' Llama2, its model file unchanged from a checkout (PYTORCH_EXAMPLES), trunc_normal_ in its
    constructor and its attention on DTensors: TP + SP with FSDP2, and with vemesh DDP + ZeRO-1, on 4 gloo ranks."""
    sys.path.insert(0, str(REPO / "test" / "models"))
    import examples_llama2_jobs

    if examples_llama2_jobs.model_dir() is None:
        pytest.skip("pytorch/examples is a repository, not a package: git clone --depth 1 "
                    "https://github.com/pytorch/examples and set PYTORCH_EXAMPLES to it")
    sys.path.insert(0, str(REPO / "bench"))
    import plan_accuracy

    for name in ("examples-llama2-fsdp2-tp2", "examples-llama2-zero1-tp2"):
        for row in plan_accuracy.compare(name, launch_script, plan_here):
            assert abs(row["peak_ratio"] - 1) <= 0.10, row
            for dim, b in row["bytes"].items():
                assert b["measured"] and abs(b["predicted"] / b["measured"] - 1) <= 0.01, (name, dim, b)


# The 70B search over 1024 ranks (every TP tried; 8 KV heads refuse TP 16 and up; FSDP refuses DP 1) is the
# console block of docs/planning.md, which test/docs runs and compares line by line; its time: bench/plan_accuracy.py.


def test_a_factory_is_called_afresh_by_each_plan() -> None:
    """Within one plan every mesh copies one meta model of the factory's; the next plan calls the factory again (it
    may read a config that has changed since), so no answer is an earlier model's."""
    sys.path.insert(0, str(REPO / "test" / "models"))
    import llama
    import llama_jobs

    layers = {"n": 4}

    def make():
        return llama.make(**dict(llama_jobs.SMALL, n_layers=layers["n"]))

    job = dict(parallelize=llama_jobs.parallelize_ddp, step=llama_jobs.step, world_size=2, global_batch_size=2)
    first = plan(make, **job)
    layers["n"] = 5
    second = plan(make, **job)
    per_block = sum(p.numel() for p in llama.make(**dict(llama_jobs.SMALL, n_layers=1)).layers.parameters()) * 4
    assert second["classes"][0]["params"] - first["classes"][0]["params"] == per_block  # one fp32 block more


def test_frozen_parameters_that_no_op_returns_are_in_the_peak() -> None:
    """A fine-tune's frozen token embedding and norms: the factory builds them before the plan's tracker starts, and no
    op of the step returns them (an embedding is read by index, a norm's weight by a product), nor does the optimizer
    touch them, so torch's tracker never saw them: on one rank, where no DDP broadcasts them, the plan's peak left out
    the embedding and norms (533,504 bytes: the activations came out that far below zero). Now each class holds what it
    says it holds, and the frozen parameters count as the trained ones do (bench/plan_accuracy.py's llama-frozen-tp2:
    the plan within the run's bytes, where it was the norms' 9,216 bytes under)."""
    sys.path.insert(0, str(REPO / "test" / "models"))
    import llama_jobs

    frozen, trained = (plan(factory, parallelize=llama_jobs.parallelize_any, step=llama_jobs.step, world_size=1,
                            global_batch_size=2, dp_mode="ddp") for factory in (llama_jobs.make_dense_frozen,
                                                                                 llama_jobs.make_dense))
    for result in (frozen, trained):
        (every,) = result["classes"]
        assert every["activations"] >= 0 and result["peak"] >= every["params"] + every["grads"] + every["optimizer"]
    embedding = llama_jobs.SMALL["vocab_size"] * llama_jobs.SMALL["dim"] * 4
    assert frozen["classes"][0]["params"] == trained["classes"][0]["params"] >= embedding


def test_a_model_initialised_with_trunc_normal_is_planned_like_the_same_model_without() -> None:
    """The factory runs on the meta device, as torchtitan builds models: ``trunc_normal_`` in ``__init__`` (which needs
    values on fake tensors) is a no-op there, and the plan is the plan of the same model without that init."""
    sys.path.insert(0, str(REPO / "test" / "models"))
    import llama_jobs

    plans = [plan(factory, parallelize=llama_jobs.parallelize_fsdp, step=llama_jobs.step, world_size=4, tp=2,
                  global_batch_size=4)
             for factory in (llama_jobs.make_dense_trunc_normal, llama_jobs.make_dense)]
    assert plans[0]["peak"] == plans[1]["peak"] > 0
    assert plans[0]["classes"][0]["bytes_per_step"] == plans[1]["classes"][0]["bytes_per_step"]
    # the fake world is gone after the plan: no process group, and the global mesh uninitialized as it was
    from torch import distributed as dist

    from vemesh import VESCALE_DEVICE_MESH

    assert not dist.is_initialized() and not VESCALE_DEVICE_MESH.is_initialized()


def test_the_loops_end_of_a_step_is_counted_and_timed(capsys) -> None:
    """``--before-optimizer``: the user's clipping and loss all-reduce run between the last backward and the
    optimizer's step; torch's default group is ``world``, timed on the link a group of every rank crosses."""
    base = ["--model", f"module:{JOBS}:make_dense", "--parallelize", f"{JOBS}:parallelize_ddp", "--step",
            f"{JOBS}:step", "--world-size", "4", "--tp", "2", "--global-batch-size", "4", "--device-profile",
            "h100-sxm", "--json"]
    docs = []
    for extra in ([], ["--before-optimizer", f"{JOBS}:before_optimizer"]):
        code, out, err = _cli(capsys, *base, *extra)
        assert code == 0, err
        docs.append(json.loads(out))
    without, with_end = (d["classes"][0]["calls_per_step"] for d in docs)
    assert "world" not in without and with_end["world"] == 1  # the loss's all-reduce, over every rank
    assert with_end["TP"] > without["TP"]  # the norm of the TP-sharded gradients: over TP
    assert with_end["DP"] == without["DP"]  # DP ranks hold the same averaged gradients: no DP collective
    parts = docs[1]["time"]["communication"]
    assert parts["world"]["link"] == "host" and parts["world"]["seconds"] > 0
    assert docs[1]["step_time"] > docs[0]["step_time"]
    code, out, err = _cli(capsys, "--model", "gpt:n_layer=2,n_embd=64,n_head=4,vocab=256,seq_len=32", "--world-size",
                          "2", "--before-optimizer", f"{JOBS}:before_optimizer")
    assert code == 2 and "--before-optimizer is your loop's end of a step, for your own functions" in err, err
    code, out, err = _cli(capsys, *base, "--before-optimizer", f"{JOBS}:no_such_function")
    assert code == 2 and "has no 'no_such_function'" in err and err.count("\n") == 1, err


def test_hugging_faces_llama_is_planned_through_torchs_schedule_on_vemeshs_decoder_stages(capsys) -> None:
    """HF's ``LlamaForCausalLM`` as transformers ships it, cut by ``vemesh.parallel.DecoderStage`` in the user's
    parallelize function and run by torch's 1F1B over PP 2 x DP 2 x TP 2: each PP rank holds its stage's parameters
    (the embedding on the first, the norm and head on the last, half of the layers each, split over TP), and the
    stage's check against the whole model is not run on the planner's fake tensors, which hold no values."""
    import transformers  # noqa: F401  (the test extra)

    from vemesh.parallel import DecoderStage

    hf = str(REPO / "test" / "models" / "hf_jobs.py")
    code, out, err = _cli(capsys, "--model", f"module:{hf}:make_llama", "--parallelize", f"{hf}:parallelize_pp",
                          "--step", f"{hf}:step_pp", "--loss", f"{hf}:loss_fn", "--world-size", "8", "--pp", "2",
                          "--tp", "2", "--global-batch-size", "8", "--dp-mode", "ddp", "--device-type", "cpu",
                          "--json")
    assert code == 0, err
    import importlib.util
    spec = importlib.util.spec_from_file_location("hf_jobs_for_test", hf)
    jobs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(jobs)
    model = jobs.make_llama()
    classes = json.loads(out)["classes"]
    assert [c["name"] for c in classes] == ["PP rank 0", "PP rank 1"]
    for c, stage in zip(classes, (DecoderStage(model, s, 2) for s in range(2))):
        tp_split = sum(p.numel() for n, p in stage.named_parameters() if n.endswith("proj.weight")) // 2
        whole = sum(p.numel() for n, p in stage.named_parameters() if not n.endswith("proj.weight"))
        assert abs(c["params"] - 4 * (whole + tp_split)) <= 1024, (c["name"], c["params"], 4 * (whole + tp_split))
        assert c["activations"] > 0 and "PP" in c["bytes_per_step"] and "TP" in c["bytes_per_step"]


def test_where_transformers_takes_its_tracing_branch_on_the_plans_fake_tensors_the_plan_says_so(capsys) -> None:
    """HF's Llama without a cache (under its gradient checkpointing), given its position ids, asks whether they are
    traced before it reads them, and counts a fake tensor as traced: the plan builds the 4-D mask that a run of
    unpadded batches leaves to SDPA, and says so, naming the function. Called without positions or a mask, it makes its
    own (arange from 0, never packed): the plan answers as every run does, builds no mask, says nothing, and the
    function is not asked. With the cache on it reads nothing, and nothing is said."""
    import transformers  # noqa: F401  (the test extra)

    hf = str(REPO / "test" / "models" / "hf_jobs.py")
    said = {}
    cases = (("parallelize_hf_checkpointed", "step_positions"), ("parallelize_hf_checkpointed", "step"),
             ("parallelize_forgot_tp", "step"))
    for parallelize, step in cases:
        code, out, err = _cli(capsys, "--model", f"module:{hf}:make_llama", "--parallelize", f"{hf}:{parallelize}",
                              "--step", f"{hf}:{step}", "--world-size", "1", "--global-batch-size", "1",
                              "--device-type", "cpu", "--json")
        assert code == 0, err
        notes = json.loads(out)["notes"]
        said[parallelize, step] = [n for n in notes if n.startswith("transformers took")]
    (note,) = said["parallelize_hf_checkpointed", "step_positions"]
    assert "its tracing branch in find_packed_sequence_indices" in note and "the plan builds the 4-D mask" in note
    assert said["parallelize_hf_checkpointed", "step"] == said["parallelize_forgot_tp", "step"] == []
    assert not any("KV cache" in n for n in notes)  # the cache on without checkpointing costs nothing more
    assert not isinstance(sys.modules["transformers.utils.import_utils"].is_fake_tensor.__closure__, tuple)  # restored
    masks = sys.modules["transformers.masking_utils"]
    assert masks.find_packed_sequence_indices.__qualname__ == "find_packed_sequence_indices"  # restored too


def test_hfs_kv_cache_on_under_torchs_checkpoint_wrapper_is_said_with_the_bytes_it_held(capsys) -> None:
    """transformers' causal models keep their KV cache on in training unless told (only HF's own checkpointing turns
    it off). Under torch's ``checkpoint_wrapper`` on each layer the cache holds every layer's keys and values, which
    the checkpoint frees, and the recompute appends its own: the plan counts them (HF's Llama, 4 layers of width 256
    under TP 2 and FSDP2 on 4 gloo ranks: plan and run within 16 bytes both ways, the cache 16% of the peak;
    BENCHMARKS.md) and says how much the cache held at the forward's end. With ``use_cache=False`` the peak is lower
    and nothing is said."""
    import transformers  # noqa: F401  (the test extra)

    hf = str(REPO / "test" / "models" / "hf_jobs.py")
    planned = {}
    for step in ("step", "step_without_cache"):
        code, out, err = _cli(capsys, "--model", f"module:{hf}:make_llama", "--parallelize",
                              f"{hf}:parallelize_torch_checkpointed", "--step", f"{hf}:{step}", "--world-size", "1",
                              "--global-batch-size", "1", "--device-type", "cpu", "--json")
        assert code == 0, err
        planned[step] = json.loads(out)
    said = [n for n in planned["step"]["notes"] if "KV cache" in n]
    # 6 layers, each its keys and values: 4 KV heads of 32 features, 128 tokens, fp32
    assert said == [f"HF's KV cache was on in training (use_cache, which transformers' causal models default to) "
                    f"under torch's activation checkpointing: it held {6 * 2 * 4 * 32 * 128 * 4 / 2**20:.2f} MiB of "
                    "keys and values at the forward's end, which the checkpoint would have freed, and the recompute "
                    "appends its own; the figures count them as a run holds them. Call the model with use_cache=False "
                    "(HF's gradient_checkpointing_enable sets it) to free them"], planned["step"]["notes"]
    assert not any("KV cache" in n for n in planned["step_without_cache"]["notes"])
    assert planned["step_without_cache"]["peak"] < planned["step"]["peak"] - 6 * 2 * 4 * 32 * 128 * 4


def test_a_tp_collective_that_a_checkpoints_recompute_leaves_unread_is_said_as_the_leak_it_is(capsys) -> None:
    """HF's Cohere runs each block's attention and MLP side by side. Under TP and torch's non-reentrant checkpoint,
    the recompute stops at the last tensor the backward needs, after the attention's all-reduce was issued and
    before anything reads it: never waited on, it stays in torch's work registry, 2 MiB more every step (a run of
    these functions on 2 gloo ranks grows 2,097,152 bytes a step; BENCHMARKS.md). The plan says so, with the
    bytes; recomputing whole blocks (``early_stop=False``) leaks nothing, and nothing is said."""
    import transformers  # noqa: F401  (the test extra)

    hf = str(REPO / "test" / "models" / "hf_jobs.py")
    said = {}
    for parallelize in ("parallelize_tp_checkpointed", "parallelize_tp_checkpointed_whole"):
        code, out, err = _cli(capsys, "--model", f"module:{hf}:make_cohere", "--parallelize", f"{hf}:{parallelize}",
                              "--step", f"{hf}:step", "--world-size", "2", "--tp", "2", "--global-batch-size", "8",
                              "--dp-mode", "ddp", "--device-type", "cpu", "--json")
        assert code == 0, err
        notes = json.loads(out)["notes"]
        said[parallelize] = [n for n in notes if n.startswith("MEMORY LEAK")]
        assert not said[parallelize] or notes[0] == said[parallelize][0]  # first: the figures are of one step
    (leak,) = said["parallelize_tp_checkpointed"]
    assert leak.startswith("MEMORY LEAK: each step issues 2 collectives (2.00 MiB) that nothing waits on"), leak
    assert "early_stop=False" in leak
    assert said["parallelize_tp_checkpointed_whole"] == []
    # 8 blocks (3 and 4 traced, the rest by difference), 1 and 2 micro-batches: one a block and micro-batch, as a run
    # of these functions on 2 gloo ranks leaves in torch's work registry (8 and 16 a step), though the freed outputs'
    # ids are other tensors' later
    for batch, leaked in (("8", 8), ("16", 16)):
        code, out, err = _cli(capsys, "--model", f"module:{hf}:make_cohere_deep", "--parallelize",
                              f"{hf}:parallelize_tp_checkpointed", "--step", f"{hf}:step", "--world-size", "2", "--tp",
                              "2", "--global-batch-size", batch, "--micro-batch-size", "8", "--dp-mode", "ddp",
                              "--device-type", "cpu", "--json")
        assert code == 0, err
        first = json.loads(out)["notes"][0]
        assert first.startswith(f"MEMORY LEAK: each step issues {leaked} collectives ({leaked}.00 MiB)"), first


def test_hsdp_under_tp_is_planned_and_its_byte_columns_keep_their_names_apart(capsys) -> None:
    """A user's FSDP2 function on ``--dp-replicate 2`` (HSDP) beside TP 2: planned (vemesh's fully_shard once read
    a 2-D mesh's ranks through a fake tensor under the plan), and the bytes table's header keeps ``TP`` and
    ``dp_replicate`` (12 letters, the width of a column) apart: it printed ``TPdp_replicate``. Timed, each part of
    the step's bar starts in one column: ``dp_replicate exposed`` pushed its own 4 letters to the right."""
    code, out, err = _cli(capsys, "--model", f"module:{JOBS}:make_dense", "--parallelize", f"{JOBS}:parallelize_fsdp",
                          "--step", f"{JOBS}:step", "--world-size", "8", "--tp", "2", "--dp-replicate", "2",
                          "--global-batch-size", "8", "--device-profile", "h100-sxm")
    assert code == 0, err
    lines = out.splitlines()
    header = lines[lines.index(next(x for x in lines if x.startswith("bytes each rank's collectives"))) + 1]
    assert header.split() == ["TP", "dp_replicate", "dp_shard"], header
    bars = [x for x in lines if x.startswith("  ") and "|" in x]
    assert any(x.lstrip().startswith("dp_replicate exposed") for x in bars), out
    assert len({x.index("|") for x in bars}) == 1, "\n".join(bars)

