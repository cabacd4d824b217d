"""The GPT example under faults: a non-finite loss stops (or skips) the step on every rank, a
second job on the same checkpoint directory is refused, and a resumed run writes each step's
metrics row once. One process each (``train.main`` in this process where it cannot exit)."""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from vemesh.checkpoint import list_checkpoints
from vemesh.resilience.checkpoint.lock import LOCK

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "gpt"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

TINY = ["--n-layer", "1", "--n-embd", "32", "--n-head", "2", "--seq-len", "16", "--global-batch-size", "4",
        "--max-data-bytes", "100000", "--eval-every", "0", "--eval-batches", "1", "--sample-tokens", "0", "--log-every", "1"]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_non_finite_loss_stops_the_run_and_keeps_the_good_checkpoints(tmp_path, capsys):
    from train import main

    ckpt = tmp_path / "ckpt"
    code = main([*TINY, "--steps", "4", "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2", "--nan-at-step", "3"])
    err = capsys.readouterr().err
    assert code == 1
    assert "error: step 3: the loss or the gradient norm is nan or inf; stopping before the optimizer steps" in err
    assert [(i.step, i.ok) for i in list_checkpoints(ckpt)] == [(2, True)]
    assert not (ckpt / LOCK).exists()  # given back on the way out


def test_skip_nonfinite_skips_the_bad_step_and_goes_on(tmp_path, capsys):
    from train import main

    metrics = tmp_path / "m.jsonl"
    code = main([*TINY, "--steps", "4", "--nan-at-step", "2", "--skip-nonfinite", "1", "--metrics-file", str(metrics)])
    out = capsys.readouterr().out
    assert code == 0
    assert "step     2/4 | non-finite loss or gradient norm: step skipped (1 of --skip-nonfinite 1)" in out
    rows = _rows(metrics)
    assert [r["skipped"] for r in rows] == [False, True, False, False]
    assert all(isinstance(r["loss"], float) and math.isfinite(r["loss"]) for r in rows if not r["skipped"])


def test_a_second_job_on_the_same_checkpoint_directory_is_refused(tmp_path, capsys, monkeypatch):
    from train import main

    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    lock = {"host": socket.gethostname(), "pid": 1, "started": "2026-11-21T00:00:00+00:00", "run_id": "job-a", "attempt": 0}
    (ckpt / LOCK).write_text(json.dumps(lock))
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    assert main([*TINY, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 1
    err = capsys.readouterr().err
    assert f"error: cannot resume: checkpoint directory '{ckpt}' is in use by another job (host" in err
    assert "pid 1, started 2026-11-21T00:00:00+00:00, torchrun run id job-a" in err
    assert json.loads((ckpt / LOCK).read_text())["run_id"] == "job-a"  # still the first job's
    assert not list(ckpt.glob("step_*"))


@pytest.mark.slow
def test_a_resumed_run_writes_each_steps_metrics_once(tmp_path):
    """A crash at step 6 after a checkpoint at 4; the restart redoes 5 and 6 and writes them once."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "m.jsonl"
    args = [sys.executable, str(EXAMPLE / "train.py"), *TINY, "--steps", "6", "--checkpoint-dir", str(ckpt),
            "--checkpoint-every", "4", "--fail-at-step", "6", "--metrics-file", str(metrics)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    first = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert first.returncode == 13, first.stderr[-2000:]  # the fault injection's exit
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4, 5]
    assert (ckpt / LOCK).exists()  # left behind by the dead process
    second = subprocess.run(args, cwd=REPO, env=dict(env, TORCHELASTIC_RESTART_COUNT="1"), capture_output=True,
                            text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]  # the dead holder's lock was taken over
    assert "continuing at step 5" in second.stdout
    assert [r["step"] for r in _rows(metrics)] == [1, 2, 3, 4, 5, 6]


def test_gradient_accumulation_keeps_the_loss_curve(tmp_path):
    """``--micro-batch-size`` runs each DP rank's rows in several passes: the same losses as one pass."""
    from train import main

    curves = []
    for extra in ([], ["--micro-batch-size", "1"]):
        metrics = tmp_path / f"m{len(curves)}.jsonl"
        assert main([*TINY, "--steps", "4", "--metrics-file", str(metrics), *extra]) == 0
        curves.append([r["loss"] for r in _rows(metrics)])
    assert max(abs(a - b) for a, b in zip(*curves)) < 1e-5, curves


def test_checkpoint_interval_saves_by_the_clock(tmp_path):
    from train import main

    ckpt = tmp_path / "ckpt"
    assert main([*TINY, "--steps", "3", "--checkpoint-dir", str(ckpt), "--checkpoint-interval-s", "1e-6",
                 "--keep-checkpoints", "5"]) == 0
    assert [i.step for i in list_checkpoints(ckpt)] == [3, 2, 1]
