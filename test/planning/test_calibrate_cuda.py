"""``vemesh calibrate --device cuda`` on one GPU (issue 51): matmul throughput per dtype (fp8 where the device has
it), memory bandwidth, the built-in links of that GPU; and ``vemesh plan`` reads the profile. Runs wherever a GPU is
lent (``-m cuda``); on a machine without one, only the refusals run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from vemesh.cli import main
from vemesh.planning.profiles import load_profile

ROOT = Path(__file__).resolve().parents[2]


def test_one_process_is_refused_on_cpu_with_the_gpu_way_named(capsys) -> None:
    assert main(["calibrate", "--nproc", "1", "--output", "x.json"]) == 2
    err = capsys.readouterr().err
    assert "collectives need at least 2 processes; choose 2 or more (one process measures one GPU: --device cuda " \
           "--nproc 1)" in err, err


def test_an_output_that_cannot_be_written_is_refused_before_measuring(tmp_path: Path, capsys) -> None:
    """Before, the ranks measured for a while and rank 0's ``open`` raised at the end: a traceback, exit 1, the
    figures lost. Now one line, exit 2, before any process starts."""
    missing = tmp_path / "no" / "x.json"
    assert main(["calibrate", "--nproc", "2", "--quick", "--output", str(missing)]) == 2
    assert f"--output {missing} is in {missing.parent}, which does not exist" in capsys.readouterr().err
    assert main(["calibrate", "--nproc", "2", "--quick", "--output", str(tmp_path)]) == 2
    assert f"--output {tmp_path} is a directory" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_the_bare_cuda_command_without_a_gpu_says_so_in_one_line(capsys) -> None:
    assert main(["calibrate", "--device", "cuda"]) == 2
    assert "--device cuda: this machine sees no GPU (torch.cuda.device_count() is 0); measure its CPU with --device " \
           "cpu, or calibrate where the job's GPUs are" in capsys.readouterr().err


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_calibrate_one_gpu_writes_a_profile_that_plan_reads(tmp_path: Path) -> None:
    """The issue's command as written, with ``--quick``: every GPU the machine sees (one where a GPU is lent), the
    profile named by the device and the processes, in the current directory."""
    n = torch.cuda.device_count()
    out = tmp_path / f"profile-cuda-{n}.json"
    done = subprocess.run([sys.executable, "-m", "vemesh", "calibrate", "--device", "cuda", "--quick"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"wrote {out.name}: "), done.stdout
    profile = load_profile(out)
    assert profile.measured and profile.matmul_flops["bf16"] > profile.matmul_flops["fp32"] > 0
    assert ("fp8" in profile.matmul_flops) == (torch.cuda.get_device_capability(0) >= (8, 9))
    # HBM reads and writes, under every GPU's 8 TB/s (a cycle that took the launches off read 29 TB/s on an H200)
    assert 1e11 < profile.memory_bandwidth < 8e12 and "published figures" in profile.assumptions[0]
    assert profile.queued and profile.op_overhead_s > 0
    # flash attention on its grid of shapes, as a fraction of the bf16 matmul rate (0.3 to 0.6 on an H100 at 8192)
    assert len(profile.attention) == 6 and 0.15 < profile.attention_fraction(8192, 128) <= 1
    # the backward apart, as the built-in profiles hold it (flash attention's: about 0.9 of its forward's rate)
    assert profile.attention_backward is not None and 0.5 < profile.attention_backward <= 1
    plan = subprocess.run([sys.executable, "-m", "vemesh", "plan", "--model", "gpt:n_layer=2,n_embd=256,n_head=4",
                           "--world-size", "1", "--dtype", "bf16", "--device-profile", str(out), "--json"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert plan.returncode == 0, plan.stderr
    assert json.loads(plan.stdout)["step_time"] > 0
