"""The step-time model: collective costs, device profiles, the breakdown ``vemesh plan --device-profile`` prints,
and ``vemesh calibrate`` writing a profile that loads back. Pure arithmetic, the fake world, and one calibration."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from vemesh.planning import PlanRequest, plan
from vemesh.planning.api import answer
from vemesh.planning.profiles import BUILT_IN, DeviceProfile, Link, load_profile
from vemesh.planning.step_time import collective_seconds, pipeline_bubbles, render

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "test" / "models"))
import llama_jobs  # noqa: E402
JOBS = "test/models/llama_jobs.py"
LINK = Link(latency_s=1e-5, bandwidth=1e9)


@pytest.mark.parametrize("op, n, want", [
    ("allreduce_", 4, 6 * 1e-5 + 2 * 3 / 4 * 1e6 / 1e9),  # ring: 2(n-1) steps, 2(n-1)/n of the buffer
    ("all_reduce", 2, 2 * 1e-5 + 1e6 / 1e9),
    ("_allgather_base_", 4, 3 * 1e-5 + 3 / 4 * 1e6 / 1e9),  # (n-1) steps, (n-1)/n of the gathered buffer
    ("reduce_scatter_tensor", 8, 7 * 1e-5 + 7 / 8 * 1e6 / 1e9),
    ("alltoall_base_", 4, 3 * 1e-5 + 3 / 4 * 1e6 / 1e9),
    ("broadcast_", 4, 1e-5 + 1e6 / 1e9),
    ("send", 2, 1e-5 + 1e6 / 1e9),
])
def test_a_collective_costs_its_ring_steps_and_its_bus_bytes(op, n, want) -> None:
    assert collective_seconds(op, 1e6, 1, n, LINK) == pytest.approx(want)
    assert collective_seconds(op, 1e6, 1, 1, LINK) == 0.0  # a group of one moves nothing
    assert collective_seconds(op, 1e6, 1, n, LINK, "gloo") == pytest.approx(want)  # a buffer of many values


def test_a_scalar_all_reduce_on_gloo_takes_the_steps_of_its_segments_that_hold_values() -> None:
    """gloo's ring cuts a buffer into at least 2n segments and sends only those that hold values: one fp32 value
    over 4 ranks is 1/8 of the ring's 6 latency steps, 8 values or more all of them; nccl runs every step."""
    assert collective_seconds("allreduce_[1]", 4, 1, 4, LINK, "gloo") == pytest.approx(6 / 8 * 1e-5 + 1.5 * 4 / 1e9)
    assert collective_seconds("all_reduce[2]", 16, 2, 4, LINK, "gloo") == pytest.approx(2 * 6 * 2 / 8 * 1e-5 + 1.5 * 16 / 1e9)
    assert collective_seconds("allreduce_[1]", 4, 1, 4, LINK) == pytest.approx(6 * 1e-5 + 1.5 * 4 / 1e9)  # nccl
    assert collective_seconds("allreduce_", 4, 1, 4, LINK, "gloo") == collective_seconds("allreduce_", 4, 1, 4, LINK)


def test_a_trace_keys_an_all_reduce_of_few_values_apart() -> None:
    """The counter keys an all-reduce of fewer values than twice its group's ranks with its count of values."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vemesh.planning.measure import CollectiveBytes

    dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
    try:
        counter = CollectiveBytes()
        counter.counting = True
        with counter:
            dist.all_reduce(torch.zeros(()))
            dist.all_reduce(torch.zeros(7))
            dist.all_reduce(torch.zeros(8))
            dist.all_reduce(torch.zeros(1000))
        by_op = counter.by_op[dist.group.WORLD.group_name]
        assert dict(by_op) == {"allreduce_[1]": [4, 1], "allreduce_[7]": [28, 1], "allreduce_": [32 + 4000, 2]}
    finally:
        dist.destroy_process_group()


def test_a_plan_for_gloo_holds_a_copy_of_a_reduce_scatters_input_through_it() -> None:
    """gloo's ``reduce_scatter_tensor`` copies its input into a buffer of its own for the call (a 1 MiB fp32
    reduce-scatter on 2 gloo ranks: torch's MemTracker sees 1 MiB more); the fake backend and nccl do not. Planned
    for ``--device-type cpu`` (gloo), the step's peak holds it through the call: FSDP2 under bf16 mixed precision, whose
    step peaks at its reduce-scatter, was 0.877 of its gloo run (HF Llama, width 64, 2 layers, DP 2: 1,058,332 bytes
    planned, 1,132,452 run; 1,132,444 with the copy)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vemesh.planning.measure import CollectiveBytes
    from vemesh.planning.step_tracker import StepTracker

    dist.init_process_group("fake", rank=0, world_size=2, store=FakeStore())
    try:
        held = {}
        for gloo in (False, True):
            x, out = torch.ones(1 << 18), torch.empty(1 << 17)  # 1 MiB in, 0.5 MiB out
            tracker, counter = StepTracker(module_hooks=False), CollectiveBytes(gloo=gloo)
            with tracker:
                tracker.track_external(x, out)
                tracker.in_step = True
                with counter:
                    dist.reduce_scatter_tensor(out, x)
                    dist.all_reduce(out)  # no copy of its own on either
            held[gloo] = tracker.step_peak
        assert held == {False: 0, True: 1 << 20}, held
    finally:
        dist.destroy_process_group()


def test_a_grouped_mm_counts_the_flops_of_its_groups_matmuls_forward_and_backward() -> None:
    """torch's FlopCounterMode has no formula for ``_grouped_mm`` (a MoE's experts in one call): the planner's counts
    every group's matmul, in the forward (2-D x 3-D) and in the backward (3-D x 3-D for the input's gradient, 2-D x
    2-D with the groups along the contracted dim for the weight's), as the same matmuls one by one count."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from vemesh.planning.fusion import MemoryBoundBytes
    from vemesh.planning.measure import FLOP_FORMULAS

    counts = [5, 0, 7, 4]  # tokens per expert, one expert with none
    x = torch.randn(sum(counts), 16, requires_grad=True)
    w = torch.randn(len(counts), 16, 8, requires_grad=True)
    grad = torch.randn(sum(counts), 8)
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    with FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as grouped, MemoryBoundBytes() as moved:
        torch._grouped_mm(x, w, offs=offs).backward(grad)
    with FlopCounterMode(display=False) as one_by_one:
        torch.cat([part @ w[e] for e, part in enumerate(x.split(counts))]).backward(grad)
    assert grouped.get_total_flops() == one_by_one.get_total_flops() == 3 * 2 * 16 * 8 * sum(counts)
    assert moved.bytes == 0  # timed by its FLOPs, not also as a memory-bound op


def test_a_fp32_grouped_mm_is_traced_as_its_cpu_kernel_runs_it() -> None:
    """torch 2.13's meta kernel of ``_grouped_mm`` takes bf16 only, its CPU kernel fp32 too (HF's MoE experts call
    it in fp32): in a plan's fake mode, the output has the CPU kernel's shape and dtype, and the op is seen above."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils.flop_counter import FlopCounterMode

    from vemesh.planning.fake_world import cpu_kernel_shapes
    from vemesh.planning.measure import FLOP_FORMULAS

    x, w, offs = torch.randn(16, 32), torch.randn(4, 32, 8), torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    real = torch._grouped_mm(x, w, offs=offs)
    with FakeTensorMode(allow_non_fake_inputs=True):
        with pytest.raises(RuntimeError, match="BF16"):  # torch's own meta kernel: why the planner needs the mode
            torch._grouped_mm(x, w, offs=offs)
        with cpu_kernel_shapes(), FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS) as flops:
            fake = torch._grouped_mm(x, w, offs=offs)
    assert (fake.shape, fake.dtype) == (real.shape, real.dtype) == ((16, 8), torch.float32)
    assert flops.get_total_flops() == 2 * 16 * 32 * 8


def test_only_a_functional_collective_waits_the_profiles_functional_wait_on_top() -> None:
    """TP's all-reduces go through torch's functional collectives (DTensor's redistributions), DDP's through c10d:
    every call waits ``collective_wait_s``, and only the functional ones ``functional_wait_s`` on top."""
    from types import SimpleNamespace

    import torch

    from vemesh.planning.step_time import FUNCTIONAL, step_time

    assert all(hasattr(torch.ops._c10d_functional, name) for name in FUNCTIONAL)  # torch's names, as traced
    assert not any(hasattr(torch.ops.c10d, name) for name in FUNCTIONAL)  # and not c10d's
    profile = load_profile("h100-sxm").model_copy(update=dict(collective_wait_s=1e-3, functional_wait_s=2e-3))
    ranks = SimpleNamespace(name="every rank", flops=1, memory_bytes=0, optimizer_bytes=0, ops=0, dtensor_ops=0,
                            collectives={"TP": {"all_reduce": (0, 5)}, "DP": {"allreduce_": (0, 3)}})
    fit = SimpleNamespace(classes=[ranks], degrees={}, pp_schedule=None, micro_batches=1)
    (t,) = step_time(fit, profile, dtype="bf16", dp_mode="ddp", grad_dims=("DP",), sizes={"TP": 2, "DP": 2}, links={})
    assert t.dims["TP"].seconds == pytest.approx(5 * 3e-3)
    assert t.dims["DP"].seconds == pytest.approx(3 * 1e-3)


def test_the_built_in_profiles_cite_their_sources_and_say_they_are_not_measured() -> None:
    assert set(BUILT_IN) >= {"h100-sxm", "a100-sxm-80gb", "h200-sxm", "h100-hbm2e-500w"}
    for name in BUILT_IN:
        p = load_profile(name)
        assert not p.measured and p.sources and all("http" in s for s in p.sources) and p.assumptions
        assert p.host.bandwidth > p.network.bandwidth and p.flops("bf16") > p.flops("fp32")


def _profile(tmp_path: Path, change) -> str:
    data = json.loads((ROOT / "vemesh" / "planning" / "profiles" / "h100-sxm.json").read_text())
    change(data)
    path = tmp_path / "p.json"
    path.write_text(json.dumps(data))
    return str(path)


@pytest.mark.parametrize("change, message", [
    (lambda d: d.pop("network"), "field 'network' is missing"),
    (lambda d: d["host"].update(bandwidth=0), "host.bandwidth input should be greater than 0; got 0"),
    (lambda d: d.update(achievable=1.5), "achievable input should be less than or equal to 1; got 1.5"),
    (lambda d: d.update(speed=1), "speed extra inputs are not permitted"),
])
def test_a_bad_profile_file_is_one_line_naming_the_field(tmp_path, change, message) -> None:
    with pytest.raises(ValueError, match=message):
        load_profile(_profile(tmp_path, change))


def test_an_unknown_profile_names_the_built_in_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown device profile 'h800': give a built-in name \(a100-sxm-80gb, "
                                         r"h100-hbm2e-500w, h100-sxm, h200-sxm\) or a JSON file"):
        load_profile("h800")


def test_a_measured_kind_is_taken_at_the_nearest_group_size() -> None:
    p = load_profile("h100-sxm").model_copy(update={"collectives": {
        "all_reduce": {"2": Link(latency_s=1, bandwidth=2), "8": Link(latency_s=3, bandwidth=4)}}})
    assert p.link("host", "all_reduce", 2).latency_s == 1 and p.link("host", "all_reduce", 6).latency_s == 3
    assert p.link("host", "all_gather", 2) == p.host and p.link("network", "all_reduce", 2) == p.network


def _plan(*flags: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vemesh", "plan", "--model", f"module:{JOBS}:make_dense",
                           "--parallelize", f"{JOBS}:parallelize_ddp", "--step", f"{JOBS}:step", "--global-batch-size",
                           "16", *flags], cwd=ROOT, capture_output=True, text=True)


def test_plan_with_a_profile_gives_the_step_time_and_its_parts() -> None:
    """In-process (the answer ``vemesh plan`` prints, without a second interpreter): the JSON's parts and the text."""
    found = answer(PlanRequest(world_size=16, model=llama_jobs.make_dense, parallelize=llama_jobs.parallelize_ddp,
                               step=llama_jobs.step, tp=4, devices_per_host=4, global_batch_size=16,
                               device_profile="h100-sxm"))
    doc = found.document()
    t = doc["time"]
    exposed = sum(d["exposed"] for d in t["communication"].values())
    assert doc["step_time"] == pytest.approx(t["compute"] + t["optimizer"] + t["bubble"] + exposed)
    assert t["compute"] > 0 and t["optimizer"] > 0 and set(t["communication"]) == {"DP", "TP"}
    placed = doc["placement"]  # on hosts of 4: one of DP and TP (4 each) inside a host, the other across
    inside = "DP" if placed["order"] == ["TP", "DP"] else "TP"
    assert set(placed["crossing_hosts"]) == {"DP", "TP"} - {inside}
    assert t["communication"][inside]["link"] == "host" and t["communication"][placed["crossing_hosts"][0]]["link"] == "network"
    assert placed["step_time"] == doc["step_time"] <= placed["baselines"]["reverse"]["step_time"]
    assert t["communication"]["TP"]["hidden"] == 0 and t["communication"]["DP"]["hidden"] > 0
    assert doc["device_profile"]["measured"] is False and 0 < doc["mfu"] < 1
    text = render(list(found.times), found.profile)
    assert text.startswith("step time on h100-sxm (published specifications, NOT MEASURED here)")
    assert "  TP exposed " in text and "|#" in text and "host link;" in text and "|  matmuls in fp32\n" in text


@pytest.mark.parametrize("flags, message", [
    (["--world-size", "12", "--tp", "2", "--devices-per-host", "8", "--device-profile", "h100-sxm"],
     "--devices-per-host 8 does not divide the world size 12, so the mesh cannot be placed on whole hosts; choose "
     "one of 1, 2, 3, 4, 6, 12"),
    (["--world-size", "4", "--device-profile", "nope"], "unknown device profile 'nope'"),
    (["--world-size", "4", "--device-memory", "80GiB", "--rank-by", "time"],
     "--rank-by time needs --device-profile NAME|FILE"),
])
def test_bad_time_requests_are_one_line(flags, message) -> None:
    done = _plan(*flags)
    assert done.returncode == 2 and message in done.stderr and done.stderr.count("\n") == 1, done.stderr


def test_the_gpt_preset_is_traced_and_timed_with_its_pipeline_bubble() -> None:
    """The preset runs through the traced engine (its own parallelize and step; with PP torch's schedule on each PP
    rank), so every mesh is timed; a pipeline adds its bubble, from the schedule's own action list."""
    doc = answer(PlanRequest(world_size=4, model="gpt:n_layer=2,n_embd=64,n_head=4", tp=2, global_batch_size=8,
                             dp_mode="ddp", device_profile="h100-sxm")).document()
    # "world": the example's agreement on a finite step, over every rank (the preset's before_optimizer)
    assert doc["step_time"] > 0 and set(doc["time"]["communication"]) == {"DP", "TP", "world"}
    assert 0 < doc["mfu"] < 1 and doc["time"]["bubble"] == 0
    pp = answer(PlanRequest(world_size=4, model="gpt:n_layer=4,n_embd=64,n_head=4", pp=2, global_batch_size=8,
                            dp_mode="ddp", device_profile="h100-sxm")).document()
    assert pp["time"]["bubble"] > 0 and set(pp["time"]["communication"]) == {"DP", "PP", "world"}


@pytest.mark.parametrize("schedule, fraction", [("gpipe", 3 / 8), ("1f1b", 3 / 8), ("interleaved-1f1b", 3 / 16)])
def test_the_bubble_is_the_textbook_one_for_equal_stages(schedule, fraction) -> None:
    """torch's action list played with equal stages gives the known bubbles: (PP - 1) / m of the compute for GPipe and
    1F1B, (PP - 1) / (m v) with v stages per rank interleaved; the zero-bubble schedules less than 1F1B."""
    assert pipeline_bubbles(schedule, 4, 8, [1.0] * 4) == pytest.approx([fraction] * 4)
    assert max(pipeline_bubbles("interleaved-zb", 4, 8, [1.0] * 4)) < 3 / 16
    slow_last = pipeline_bubbles("1f1b", 4, 8, [1.0, 1.0, 1.0, 2.0])  # the slowest stage sets the pace
    assert slow_last[3] < slow_last[0]


def test_ranks_that_share_cores_fill_each_others_bubble() -> None:
    """More ranks than cores (the profile's ``shared_compute``): while some PP ranks wait, the others run faster, up
    to ``pp / active``. PP = 2 sharing by 2: one rank alone runs twice as fast, so the machine never idles and the
    bubble is gone; sharing by 1.5, it is between that and the textbook one; an uneven pipeline keeps some."""
    alone = pipeline_bubbles("1f1b", 2, 4, [1.0, 1.0])
    assert alone == pytest.approx([1 / 4, 1 / 4])  # (PP - 1) / m
    assert pipeline_bubbles("1f1b", 2, 4, [1.0, 1.0], shared=2.0) == pytest.approx([0.0, 0.0], abs=1e-9)
    between = pipeline_bubbles("1f1b", 2, 4, [1.0, 1.0], shared=1.5)
    assert 0 < between[0] < alone[0]
    uneven = pipeline_bubbles("1f1b", 4, 8, [1.0, 1.0, 1.0, 2.0], shared=2.0)
    assert 0 < uneven[0] < pipeline_bubbles("1f1b", 4, 8, [1.0, 1.0, 1.0, 2.0])[0]
    with pytest.raises(ValueError, match="shared_compute"):
        DeviceProfile.model_validate({**load_profile("h100-sxm").model_dump(), "shared_compute": 0.5})


def test_a_calibrations_attention_backward_is_timed_apart_on_a_gpu_and_together_on_a_cpu(monkeypatch) -> None:
    """``attention_rates`` with ``apart`` (the default on a GPU) times the forward alone too and gives each shape's
    forward rate, then its backward's rate over the forward's, as the built-in GPU profiles hold them: a call pair
    timed 6 and 1 (forward and backward, then forward alone) is a forward of 2 products in 1 and a backward of 5
    in 5, a ratio of 0.5. Without ``apart`` (a CPU's default) one rate of the 7 products together, as before; and
    the real kernels on this CPU give ratios in (0, 1]."""
    import itertools

    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from vemesh.planning import device_rates

    cpu = torch.device("cpu")
    shapes = [(s, h) for s in device_rates.attention_grid(cpu)[0] for h in device_rates.attention_grid(cpu)[1]]
    dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
    try:
        measured = device_rates.attention_rates(cpu, lambda: None, 1, True, apart=True)
        times = itertools.cycle([6.0, 1.0])  # forward and backward, then the forward alone
        monkeypatch.setattr(device_rates, "median_seconds", lambda fn, reps, sync: next(times))
        apart = device_rates.attention_rates(cpu, lambda: None, 1, True, apart=True)
        times = itertools.cycle([7.0])
        together = device_rates.attention_rates(cpu, lambda: None, 1, True)
    finally:
        dist.destroy_process_group()
    n = len(shapes)
    assert len(measured) == len(apart) == 2 * n and all(0 < r <= 1 for r in measured[n:]), measured
    heads = [max(1, int(2**26 * min(1.0, h / 32)) // (7 * s * s * h)) for s, h in shapes]
    assert apart == pytest.approx([2 * s * s * h * k for (s, h), k in zip(shapes, heads)] + [0.5] * n)
    assert together == pytest.approx([s * s * h * k for (s, h), k in zip(shapes, heads)])  # 7 products in 7


def test_a_gpus_attention_calls_have_the_heads_of_a_step_at_long_sequences() -> None:
    """On a lent H200 one head of 8192 tokens (the fixed work of a call) ran at 0.15 of the matmul rate, where 32
    heads ran at 0.76: a GPU's calls have at least 32 heads, a CPU's keep the fixed work."""
    from vemesh.planning.device_rates import attention_heads

    assert [attention_heads("cuda", s, 128) for s in (512, 2048, 8192)] == [2**36 // (7 * 512 * 512 * 128), 32, 32]
    assert attention_heads("cpu", 1024, 128, quick=True) == 1 and attention_heads("cpu", 64, 4) == 2**27 // (7 * 64 * 64 * 4)


@pytest.mark.slow
def test_calibrate_writes_a_measured_profile_that_plan_reads(tmp_path) -> None:
    out = tmp_path / "profile-cpu-2.json"  # without --nproc and --output: 2 processes, the file named so, here
    done = subprocess.run([sys.executable, "-m", "vemesh", "calibrate", "--quick", "--repeat", "2"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("wrote profile-cpu-2.json: "), done.stdout
    p = load_profile(str(out))
    assert isinstance(p, DeviceProfile) and p.measured and p.devices_per_host == 2
    assert set(p.collectives) == {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast"}
    assert all(set(sizes) == {"2"} for sizes in p.collectives.values()) and 0 <= p.overlap <= 1
    assert p.flops("fp32") > 0 and p.memory_bandwidth > 0 and p.transcendental_bandwidth > 0 and p.op_overhead_s > 0
    assert p.shared_compute == max(1.0, 2 / (os.cpu_count() or 1))  # 2 ranks of 1 thread each
    # attention on its grid of shapes: a CPU's flash attention is far slower at head size 4 than at 64
    assert len(p.attention) == 12 and p.attention_fraction(1024, 4) < p.attention_fraction(1024, 64)
    assert "of the matmul rate over 12 shapes" in done.stdout, done.stdout
    assert "--repeat 2" in p.sources[0] and p.backend == "gloo"  # each figure the median of 2 rounds
    timed = answer(PlanRequest(world_size=2, model=llama_jobs.make_dense, parallelize=llama_jobs.parallelize_ddp,
                               step=llama_jobs.step, global_batch_size=4, device_profile=str(out)))
    assert timed.document()["step_time"] > 0 and timed.document()["device_profile"]["measured"] is True
    bad = subprocess.run([sys.executable, "-m", "vemesh", "calibrate", "--nproc", "1", "--output", str(out)],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "collectives need at least 2 processes" in bad.stderr
    bad = subprocess.run([sys.executable, "-m", "vemesh", "calibrate", "--nproc", "2", "--repeat", "0", "--output",
                          str(out)], capture_output=True, text=True)
    assert bad.returncode == 2 and "--repeat: invalid value '0': expected a positive integer" in bad.stderr


def test_a_calibrations_tp_figures_add_up_to_what_its_reference_tp_step_paid() -> None:
    """``vemesh calibrate`` times a reference TP step (an MLP on pairs under ``parallelize_module``) and keeps as the
    functional collective's own wait what the step time does not count apart, so that however the latency, the
    c10d wait and the DTensor op time moved in a calibration, one TP collective of the reference costs, in the
    step time's terms, what the reference paid; a reference cheaper than its parts gives 0, never less."""
    from vemesh.planning.calibrate import functional_wait
    from vemesh.planning.step_time import collective_seconds

    nbytes = 8 * 64 * 192 * 4  # the reference's activations: the GPT example's tokens and width, fp32
    for lat, wait, per_op in ((1.4e-3, 0.3e-3, 38e-6), (0.2e-3, 0.8e-3, 90e-6)):  # two calibrations' parts
        pair = Link(latency_s=lat, bandwidth=0.9e9)
        own = functional_wait(5e-3, 12, pair, wait, per_op, "gloo")
        total = collective_seconds("all_reduce", nbytes, 1, 2, pair, "gloo") + wait + own + 12 * per_op
        assert own > 0 and total == pytest.approx(5e-3)
    assert functional_wait(1e-3, 12, Link(latency_s=1e-3, bandwidth=1e9), 1e-3, 1e-4, "gloo") == 0.0


def test_on_a_gradient_dim_only_the_wrappers_collectives_hide_behind_compute() -> None:
    """With FSDP over CP alone (DP 1), FSDP2's gathers and CP's ring exchange share the dim: FSDP2's c10d ops hide
    behind compute, the ring's functional all-gathers stay on the critical path (they were hidden too, once)."""
    from vemesh.planning.estimate import RankMemory
    from vemesh.planning.results import MeshFit, RankClass
    from vemesh.planning.step_time import step_time

    fsdp = {"_allgather_base_": (8_000_000, 4), "_reduce_scatter_base_": (8_000_000, 4)}
    ring = {"all_gather_into_tensor": (2_000_000, 16)}
    profile = load_profile("h100-sxm")

    def cp(ops: dict, dp_mode: str = "fsdp"):
        fit = MeshFit({"PP": 1, "DP": 1, "CP": 4, "TP": 1, "EP": 1},
                      [RankClass("every rank", RankMemory("every rank", 1, 1, 1, 0), 1, 0, {"CP": 8},
                                 flops=10**15, collectives={"CP": ops})], 1, 1)
        (t,) = step_time(fit, profile, dtype="bf16", dp_mode=dp_mode, grad_dims=("CP",), sizes={"CP": 4},
                         links={"CP": "host"})
        return t.dims["CP"]

    alone, both = cp(ring), cp({**fsdp, **ring})
    assert cp(fsdp).exposed == 0 and cp(fsdp).hidden > 0  # the step's compute covers FSDP2's traffic
    assert alone.seconds > 0 and alone.exposed == pytest.approx(alone.seconds)
    assert both.exposed == pytest.approx(alone.seconds) and both.hidden == pytest.approx(cp(fsdp).hidden)
    assert cp({**ring, "allreduce_": (8_000_000, 1)}, "ddp").exposed == pytest.approx(alone.seconds)


def test_hsdps_replica_and_shard_dims_hide_behind_the_compute_they_share() -> None:
    """Under HSDP (``--dp-replicate``) FSDP2's collectives run on two dims, dp_shard (its gathers and reduce-scatters)
    and dp_replicate (its all-reduce of the shard). Both were timed exposed: the step's gradient dims named only the
    flattened data dim, so none hid (``llama3:8b,seq_len=1024`` on 16 ranks, HSDP 2 x CP 2 x TP 2: 693 ms a step, 429
    ms now). They hide behind one compute, not each behind its own copy of it."""
    from vemesh.planning.estimate import RankMemory
    from vemesh.planning.results import MeshFit, RankClass
    from vemesh.planning.step_time import step_time

    profile = load_profile("h100-sxm").model_copy(update={"overlap": 1.0})
    gathers = {"_allgather_base_": (4 * 10**9, 40), "_reduce_scatter_base_": (4 * 10**9, 40)}
    fit = MeshFit({"PP": 1, "DP": 4, "CP": 1, "TP": 1, "EP": 1},
                  [RankClass("every rank", RankMemory("every rank", 1, 1, 1, 0), 1, 0, {}, flops=28 * 10**12,
                             collectives={"dp_shard": gathers, "dp_replicate": {"allreduce_": (2 * 10**9, 40)}})], 1, 1)
    (t,) = step_time(fit, profile, dtype="bf16", dp_mode="fsdp", grad_dims=("dp_replicate", "dp_shard"),
                     sizes={"dp_shard": 2, "dp_replicate": 2}, links={"dp_shard": "host", "dp_replicate": "network"})
    shard, replica = t.dims["dp_shard"], t.dims["dp_replicate"]
    assert shard.hidden > 0 and replica.hidden > 0
    assert shard.hidden + replica.hidden == pytest.approx(min(t.compute, shard.seconds + replica.seconds))
    assert max(shard.seconds, replica.seconds) < t.compute < shard.seconds + replica.seconds  # each fits; both do not
    # and a plan names them: the user's FSDP2 over HSDP 2 x 2, each dim hidden in part, never more than the compute
    doc = plan(f"module:{JOBS}:make_dense", parallelize=f"{JOBS}:parallelize_fsdp", step=f"{JOBS}:step", world_size=4,
               dp_replicate=2, global_batch_size=4, device_profile="h100-sxm")
    parts = doc["time"]
    hidden = {d: c["hidden"] for d, c in parts["communication"].items()}
    assert hidden.keys() == {"dp_replicate", "dp_shard"} and all(h > 0 for h in hidden.values()), hidden
    assert sum(hidden.values()) <= parts["compute"] * (1 + 1e-9), (hidden, parts["compute"])


def test_zero1s_gather_is_timed_as_the_profiles_backend_runs_it() -> None:
    """A plan traces ZeRO-1's gather as one all-gather per buffer; on gloo vemesh broadcasts each rank's slice instead
    (all at once, then waits): a gloo profile times n broadcasts of a slice and one wait, an nccl one the all-gather.
    The gradient all-reduce, and a DDP mesh's collectives, are timed as before."""
    from vemesh.planning.estimate import RankMemory
    from vemesh.planning.results import MeshFit, RankClass
    from vemesh.planning.step_time import step_time

    ops = {"DP": {"_allgather_base_": (4_000_000, 1), "allreduce_": (4_000_000, 1)}}
    fit = MeshFit({"PP": 1, "DP": 4, "CP": 1, "TP": 1, "EP": 1},
                  [RankClass("every rank", RankMemory("every rank", 1, 1, 1, 0), 1, 0, {"DP": 8}, flops=1,
                             collectives=ops)], 1, 1)
    nccl = load_profile("h100-sxm").model_copy(update={"collective_wait_s": 1e-3})
    gloo = nccl.model_copy(update={"backend": "gloo"})

    def dp_seconds(profile, dp_mode):
        return step_time(fit, profile, dtype="fp32", dp_mode=dp_mode, grad_dims=("DP",), sizes={"DP": 4},
                         links={"DP": "host"})[0].dims["DP"].seconds

    reduce = collective_seconds("allreduce_", 4_000_000, 1, 4, nccl.host) + 1e-3
    assert dp_seconds(nccl, "zero1") == pytest.approx(
        reduce + collective_seconds("all_gather", 4_000_000, 1, 4, nccl.host) + 1e-3)
    assert dp_seconds(gloo, "zero1") == pytest.approx(
        reduce + 4 * nccl.host.latency_s + 4_000_000 / nccl.host.bandwidth + 1e-3)
    assert dp_seconds(gloo, "ddp") == dp_seconds(nccl, "ddp") == pytest.approx(
        reduce + collective_seconds("all_gather", 4_000_000, 1, 4, nccl.host) + 1e-3)
    assert load_profile("h100-sxm").backend == "nccl"


def test_a_plan_traced_without_timing_is_refused_not_timed_as_zero() -> None:
    from vemesh.planning.estimate import RankMemory
    from vemesh.planning.results import MeshFit, RankClass
    from vemesh.planning.step_time import step_time

    fit = MeshFit({"PP": 1, "DP": 2, "CP": 1, "TP": 1, "EP": 1},
                  [RankClass("every rank", RankMemory("every rank", 1, 1, 1, 0), 1, 0, {"DP": 8})], 1, 1)
    with pytest.raises(ValueError, match="every rank: the plan counted no FLOPs"):
        step_time(fit, load_profile("h100-sxm"), dtype="fp32", dp_mode="ddp", grad_dims=("DP",), sizes={"DP": 2},
                  links={"DP": "host"})


def test_a_search_by_time_times_its_pipeline_meshes_with_their_bubble() -> None:
    """A search with ``--trace-pp`` traces a PP mesh through torch's schedule and times it: each stage's FLOPs,
    memory-bound bytes and collectives by op, the optimizer's bytes, and the bubble of torch's action list; the
    ranking holds PP meshes beside the others, ordered by step time. Without the flag the preset's PP mesh is left
    out, named with the ``--pp`` that plans it."""
    flags = dict(world_size=2, model="gpt:n_layer=2,n_embd=64,n_head=4", global_batch_size=8, dp_mode="ddp",
                 device_memory="80GiB", device_profile="h100-sxm")
    doc = answer(PlanRequest(**flags, trace_pp=True)).document()
    assert [f["step_time"] for f in doc["fits"]] == sorted(f["step_time"] for f in doc["fits"])
    pipelines = [f for f in doc["fits"] if f["degrees"]["PP"] > 1]
    assert len(doc["fits"]) == 3 and {f["degrees"]["PP"] for f in pipelines} == {2} and not doc["rejected"]
    for f in pipelines:
        assert f["time"]["bubble"] > 0 and "PP" in f["time"]["communication"] and f["mfu"] > 0
    left = answer(PlanRequest(**flags)).document()
    assert [f["degrees"]["PP"] for f in left["fits"]] == [1, 1]
    assert [r["reason"] for r in left["rejected"]] == [
        "not planned in a search: the GPT preset's PP meshes are traced through torch's schedule (seconds to minutes "
        "each); plan it with --pp 2, or search with --trace-pp"]


SMALL_GPT = "gpt:n_layer=2,n_embd=64,n_head=4,seq_len=64"


@pytest.mark.parametrize("fields, message", [
    (dict(choose="mbs"), "--choose 'mbs' is not a choice; choose from micro-batch-size, activation-checkpointing"),
    (dict(choose="micro-batch-size", device_profile=None),
     "--choose picks what makes each mesh's step fastest in a search by time: give --device-memory and "
     "--device-profile, and none of --pp, --dp, --tp"),
    (dict(choose="micro-batch-size", tp=2), "--choose picks what makes each mesh's step fastest in a search by time"),
    (dict(choose="micro-batch-size", micro_batch_size=2),
     "--choose micro-batch-size and --micro-batch-size 2: fix it or let the search choose it, not both"),
    (dict(choose="activation-checkpointing", activation_checkpointing=True),
     "--choose activation-checkpointing is the GPT preset's choice, made without --activation-checkpointing"),
    (dict(choose="activation-checkpointing", model=llama_jobs.make_dense, step=llama_jobs.step),
     "with --parallelize your function decides it: plan one function with it and one without to compare"),
])
def test_a_bad_choice_is_one_line_naming_it(fields, message) -> None:
    request = dict(world_size=2, model=SMALL_GPT, device_memory="80GiB", device_profile="h100-sxm") | fields
    with pytest.raises(ValueError) as e:
        PlanRequest(**request)
    assert message in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_a_search_by_time_chooses_each_meshs_micro_batch_and_checkpointing() -> None:
    """``--choose``: without PP the largest micro-batch that fits, recomputing only where nothing fits without it;
    with PP the fastest of every micro-batch size that fits (checked against each variant timed on its own)."""
    from vemesh.planning.api import time_of
    from vemesh.planning.fit import Job, predict
    from vemesh.planning.mesh_plan import plan_mesh

    profile = load_profile("h100-sxm")
    job = Job(SMALL_GPT, 8, dp_mode="ddp", timed=True)
    tight = (predict(Job(SMALL_GPT, 8, dp_mode="ddp", micro_batch_size=1), dp=2).peak
             + predict(Job(SMALL_GPT, 8, dp_mode="ddp", micro_batch_size=1, activation_checkpointing=True), dp=2).peak) // 2
    for memory, batch, choose in (("80GiB", 8, "micro-batch-size"),
                                  (tight, 2, "micro-batch-size,activation-checkpointing")):
        doc = answer(PlanRequest(world_size=2, model=SMALL_GPT, global_batch_size=batch, dp_mode="ddp",
                                 device_memory=memory, device_profile="h100-sxm", choose=choose,
                                 trace_pp=True)).document()
        chosen = {tuple(f["degrees"][d] for d in ("PP", "DP", "TP")): f for f in doc["fits"]}
        if memory == "80GiB":  # every mesh fits whole: one pass of the DP rank's share, no recompute
            assert chosen[(1, 2, 1)]["micro_batch_size"] == 4 and chosen[(1, 1, 2)]["micro_batch_size"] == 8
            assert not any(f["activation_checkpointing"] for f in doc["fits"])  # not a choice here: off
            pipeline = chosen[(2, 1, 1)]
            mesh = plan_mesh(2, pp=2, dp=1, cp=1, tp=1, ep=1)
            alone = {}
            for m in (4, 2, 1):  # 8 would be one micro-batch for 2 stages, which torch's schedule refuses
                fit = predict(Job(SMALL_GPT, 8, dp_mode="ddp", micro_batch_size=m, timed=True), dp=1, pp=2)
                alone[m] = max(t.total for t in time_of(fit, mesh, profile, job))
            assert pipeline["step_time"] == pytest.approx(min(alone.values()))
            assert pipeline["micro_batch_size"] == min(alone, key=alone.get)
        else:  # DP = 2 fits only recomputing, at one sequence per micro-batch
            assert (chosen[(1, 2, 1)]["micro_batch_size"], chosen[(1, 2, 1)]["activation_checkpointing"]) == (1, True)
            assert chosen[(1, 2, 1)]["peak"] <= tight


@pytest.mark.slow  # 15 s alone: started with the other long runs (conftest.py)
def test_a_search_with_trace_pp_plans_each_pp_mesh_as_pp_n_does(capsys) -> None:
    """``--trace-pp``: a search plans its PP meshes through torch's schedule, the engine of ``--pp N`` (issue 51's
    one engine). Each PP mesh of a GPT search over 4 ranks (PP 2 x DP 2, PP 2 x TP 2, PP 4) has the peak and step
    time of its own plan, made after the caches are emptied by the command the search gives for it (``plan_alone``);
    without the flag the same search leaves each out, with that same command. (An analytic estimate stood there
    before: at this width, where the schedule's own ops weigh, its step was 0.56 of the trace's.) Each traced PP
    mesh is told on stderr as it goes. (That a plan asks a search's traces of the cache: test_llama3_speedups.py.)"""
    from vemesh.cli import main
    from vemesh.planning import fit

    gpt = ["--model", "gpt:n_layer=4,n_embd=64,n_head=4,vocab=256,seq_len=64", "--world-size", "4",
           "--global-batch-size", "8", "--device-profile", "h100-sxm", "--json"]
    searched, progress, rejected = {}, {}, {}
    for trace in (True, False):
        assert main(["plan", *gpt, "--device-memory", "8GiB", *(["--trace-pp"] if trace else [])]) == 0
        out, err = capsys.readouterr()
        searched[trace] = {tuple(f["degrees"].values()): f for f in json.loads(out)["fits"]}
        rejected[trace] = {tuple(f["degrees"].values()): f for f in json.loads(out)["rejected"]}
        progress[trace] = [line for line in err.splitlines() if line.startswith("vemesh: trac")]
    piped = {k: f for k, f in searched[True].items() if f["degrees"]["PP"] > 1}
    assert sorted(piped) == [(2, 1, 1, 2, 1), (2, 2, 1, 1, 1), (4, 1, 1, 1, 1)], list(searched[True])
    # a line on stderr as each PP mesh's trace starts and ends; none where the search leaves them out
    assert "vemesh: tracing PP=4 through torch's 1f1b schedule, 8 micro-batches" in progress[True], progress
    assert len(progress[True]) == 2 * len(piped) and progress[False] == [], progress
    for key, row in piped.items():
        # left out without the flag, with the command the traced search gives for it
        assert key not in searched[False] and rejected[False][key]["plan_alone"] == row["plan_alone"], key
        assert rejected[False][key]["reason"].endswith(f"plan it with --pp {key[0]}, or search with --trace-pp")
        command = shlex.split(row["plan_alone"])
        assert command[:2] == ["vemesh", "plan"] and "--trace-pp" not in command and "--pp" in command
        fit._traced_preset.cache_clear()
        assert main([*command[1:], "--json"]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert (row["peak"], row["step_time"]) == (alone["peak"], alone["step_time"]), key
        assert fit._traced_preset.cache_info().misses == 1


def test_each_matmuls_flops_are_timed_at_the_rate_of_the_dtype_it_ran_in() -> None:
    """A trace counts the matmuls' and attention's FLOPs by the dtype they ran in; a step's compute times each dtype's
    at its rate, and any FLOPs no dtype counted at the rate of the dtype most ran in (the job's ``--dtype`` where none
    was counted). Before, every FLOP ran at the
    ``--dtype`` rate: FSDP2's bf16 compute over fp32 parameters (``MixedPrecisionPolicy``) was timed at fp32's."""
    from vemesh.planning.estimate import RankMemory
    from vemesh.planning.results import MeshFit, RankClass
    from vemesh.planning.speedups import compute_dtype
    from vemesh.planning.step_time import step_time

    profile = load_profile("h100-sxm").model_copy(update={"op_overhead_s": 0.0, "dtensor_op_overhead_s": 0.0})
    bf16, fp32 = (profile.flops(d) * profile.achievable for d in ("bf16", "fp32"))

    def compute(flops: int, counts: dict[str, int]) -> float:
        fit = MeshFit({"PP": 1, "DP": 1, "CP": 1, "TP": 1, "EP": 1},
                      [RankClass("every rank", RankMemory("every rank", 1, 1, 1, 0), 1, 0, {}, flops=flops,
                                 counts=counts)], 1, 1)
        return step_time(fit, profile, dtype="fp32", dp_mode="ddp", grad_dims=("DP",), sizes={}, links={})[0].compute

    assert compute(10**15, {"flops_in@bfloat16": 10**15}) == pytest.approx(10**15 / bf16)
    assert compute(10**15, {"flops_in@bfloat16": 9 * 10**14, "flops_in@float32": 10**14}) == \
        pytest.approx(9 * 10**14 / bf16 + 10**14 / fp32)
    assert compute(10**15, {"flops_in@bfloat16": 6 * 10**14}) == pytest.approx(10**15 / bf16)
    assert compute(10**15, {}) == pytest.approx(10**15 / fp32)
    # fp32 matmuls that the code let run in TF32: at TF32's rate, or fp32's on a profile without one (a calibration's)
    assert compute(10**15, {"flops_in@tf32": 10**15}) == pytest.approx(10**15 / (494.5e12 * profile.achievable))
    no_tf32 = profile.model_copy(update={"matmul_flops": {"bf16": 989e12, "fp32": 67e12}})
    assert no_tf32.flops("tf32") == no_tf32.flops("fp32") == 67e12
    # fp16 (FSDP2's param_dtype=torch.float16, GradScaler's jobs): a GPU's bf16 rate where a profile has none; a CPU's
    # profile without one says so
    assert profile.flops("fp16") == no_tf32.flops("fp16") == 989e12
    with pytest.raises(ValueError, match="has no matmul throughput for fp16; it has bf16, fp32"):
        no_tf32.model_copy(update={"queued": False}).flops("fp16")
    assert compute_dtype({"flops_in@bfloat16": 9, "flops_in@float32": 1}, "fp32") == "bf16"
    assert compute_dtype({}, "fp32") == "fp32"


def test_fsdp2s_bf16_compute_over_fp32_parameters_is_timed_and_its_mfu_taken_at_bf16() -> None:
    """HF Llama under FSDP2 with torchtitan's ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)``, planned as a user
    writes it (``--dtype`` left fp32: the parameters are): every FLOP ran in bf16, the step's compute is the plan's
    without the policy, with its matmuls at bf16's rate, and the MFU is of bf16's peak. Before, the plan timed that
    step at fp32's rate: a 7B Qwen2 job under this policy at 12.6 s a step, 1.5 s at bf16's."""
    hf = "test/models/hf_jobs.py"

    def plan(parallelize: str) -> dict:
        return answer(PlanRequest(model=f"module:{hf}:make_llama", parallelize=f"{hf}:{parallelize}",
                                  step=f"{hf}:step", world_size=4, dp=2, tp=2, global_batch_size=4,
                                  device_profile="h100-sxm")).document()

    mixed, plain = plan("parallelize_fsdp_bf16"), plan("parallelize_fsdp")
    profile = load_profile("h100-sxm")
    # the same FLOPs (one model, one batch): MFU x step time x peak is the FLOPs, at each one's own peak
    flops = [d["mfu"] * d["step_time"] * profile.flops(p) for d, p in ((mixed, "bf16"), (plain, "fp32"))]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)
    assert mixed["time"]["compute"] < plain["time"]["compute"]
    assert (mixed["time"]["compute_dtype"], plain["time"]["compute_dtype"]) == ("bf16", "fp32")  # and said so


def test_fp32_matmuls_that_the_users_code_lets_run_in_tf32_are_timed_at_tf32s_rate() -> None:
    """A step whose code sets ``torch.backends.cuda.matmul.allow_tf32 = True`` (or ``fp32_precision = "tf32"``, or
    ``torch.set_float32_matmul_precision("high")``): on a GPU its fp32 matmuls run in TF32, 7.4 times fp32's rate on an
    H100. The trace reads the flag at each matmul; its FLOPs count as TF32's, and the MFU is of TF32's peak. Before,
    an fp32 job that allowed TF32 was timed at fp32's rate."""
    import torch

    def plan() -> dict:
        return answer(PlanRequest(model=llama_jobs.make_dense, parallelize=llama_jobs.parallelize_ddp,
                                  step=llama_jobs.step, world_size=2, global_batch_size=4,
                                  device_profile="h100-sxm")).document()

    plain = plan()
    before = torch.backends.cuda.matmul.fp32_precision
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    try:
        tf32 = plan()
    finally:
        torch.backends.cuda.matmul.fp32_precision = before
    profile = load_profile("h100-sxm")
    flops = [d["mfu"] * d["step_time"] * profile.flops(p) for d, p in ((tf32, "tf32"), (plain, "fp32"))]
    assert flops[0] == pytest.approx(flops[1], rel=1e-9)
    assert tf32["time"]["compute"] < plain["time"]["compute"]
