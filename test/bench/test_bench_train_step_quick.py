"""The training-step benchmark must keep running: ``bench/train_step.py --quick`` as a user would run it.

Timings are not asserted (this machine is shared and noisy); only that the script exits 0 and
prints every table: the GPT path with its memory runs, and the MLP path (timing only, to stay fast).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from bench_run import run_bench

pytestmark = pytest.mark.slow  # a bench run end to end

TABLES = [
    "| contender | median ms |",
    "vemesh DDP / torch DDP",
    "ZeroRedundancyOptimizer",
    "vemesh grad sync",
    "FSDP2 ZeRO-3",
    "state bytes / rank",
    "reduce_scatter+all_gather / all_reduce",
]
CONTENDERS = ["vemesh_ddp", "torch_ddp", "vemesh_zero", "torch_zero", "fsdp2_zero3", "fsdp2_zero2"]


def _run(*args: str, json_out: Path | None = None) -> tuple[str, object]:
    stdout, results = run_bench("train_step.py", "--quick", *args, json_out=json_out)
    for line in TABLES:
        assert line in stdout, f"missing {line!r} in:\n{stdout}"
    return stdout, results


def test_train_step_quick_gpt(tmp_path: Path) -> None:
    stdout, results = _run(json_out=tmp_path / "train_step.json")
    assert "# model: GPT (examples/gpt)" in stdout
    assert "# memory (glibc)" in stdout and "peak RSS over baseline MiB" in stdout
    assert set(results["memory_glibc"]) == set(CONTENDERS)
    for name in CONTENDERS:
        assert results["state_bytes"][name] > 0
    # ZeRO shards the AdamW state over DP = 2: about half of plain AdamW's on each rank.
    for name in CONTENDERS[2:]:
        assert 0.45 < results["state_bytes"][name] / results["state_bytes"]["vemesh_ddp"] < 0.55


def test_train_step_quick_mlp() -> None:
    stdout, _ = _run("--model", "mlp", "--memory", "none")
    assert "# model: MLP" in stdout
    assert "# memory" not in stdout
