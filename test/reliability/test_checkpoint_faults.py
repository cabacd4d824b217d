"""Checkpoint faults as they happen on real clusters, in one process: corruption, stale or linked
files, edited manifests, non-finite state, a full disk, pruning, and two jobs on one directory.

Each damaged checkpoint must be found before use: ``load_latest`` falls back to the previous good
one with a warning naming the file, and nothing good is ever deleted. ``FAULTS`` is counted in
docs/checkpoints.md.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from vemesh import checkpoint
from vemesh.checkpoint import CheckpointError, CheckpointLockedError, list_checkpoints
from vemesh.resilience.checkpoint.lock import LOCK

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


def make(seed: int = 0) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def train(model: nn.Module, opt: torch.optim.Optimizer, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 16)).square().mean().backward()
        opt.step()


@pytest.fixture
def run(tmp_path: Path) -> tuple[Path, dict[int, torch.Tensor]]:
    """Checkpoints at steps 2 and 4, and the first weight at each."""
    model, opt = make()
    root, weights = tmp_path / "ckpt", {}
    for step in (2, 4):
        train(model, opt, 2)
        checkpoint.save(root, model=model, optimizer=opt, step=step)
        weights[step] = model[0].weight.detach().clone()
    return root, weights


def shard(root: Path, step: int) -> Path:
    return next((root / f"step_{step:06d}").glob("*.distcp"))


def resume(root: Path) -> tuple[int, str, torch.Tensor]:
    """Load the latest good checkpoint into a fresh model: (step, warning text, first weight)."""
    model, opt = make(seed=1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        step, _ = checkpoint.load_latest(root, model=model, optimizer=opt)
    text = " ".join(str(w.message) for w in caught if "skipping damaged checkpoint" in str(w.message))
    return step, text, model[0].weight.detach()


def flip_bit(root: Path) -> None:
    f = shard(root, 4)
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10  # one bit inside the tensor data, same size
    f.write_bytes(bytes(data))


def zero_block(root: Path) -> None:
    f = shard(root, 4)
    with open(f, "r+b") as fh:
        fh.seek(f.stat().st_size // 2 - 2048)
        fh.write(bytes(4096))


def stale_copy(root: Path) -> None:  # a same-size shard from an older checkpoint of the same run
    shutil.copyfile(shard(root, 2), shard(root, 4))


def symlinked_shard(root: Path) -> None:
    f = shard(root, 4)
    f.unlink()
    f.symlink_to(shard(root, 2))


def truncate(root: Path) -> None:
    f = shard(root, 4)
    os.truncate(f, f.stat().st_size - 100)


def edit_hyperparameter(root: Path) -> None:
    path = root / "step_000004" / "vemesh.json"
    manifest = json.loads(path.read_text())
    manifest["optimizer"]["param_groups"][0]["lr"] = 1.0
    path.write_text(json.dumps(manifest))


def renamed_directory(root: Path) -> None:  # step_000004 now claims to be step 9
    (root / "step_000004").rename(root / "step_000009")


FAULTS = {  # fault -> (damage, piece of the warning)
    "bit-flip": (flip_bit, "does not match its checksum"),
    "zeroed-4KiB-block": (zero_block, "does not match its checksum"),
    "stale-shard-same-size": (stale_copy, "does not match its checksum"),
    "symlinked-shard": (symlinked_shard, "is a symbolic link"),
    "truncated-shard": (truncate, "(truncated or overwritten)"),
    "edited-hyperparameter": (edit_hyperparameter, "vemesh.json does not match its checksum (edited or damaged)"),
    "manifest-step-not-directory": (renamed_directory, "its vemesh.json is for step 4, but the directory is step 9"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_damage_is_found_and_the_previous_checkpoint_used(run, fault):
    root, weights = run
    damage, piece = FAULTS[fault]
    damage(root)
    step, warning, weight = resume(root)
    assert step == 2 and torch.equal(weight, weights[2])
    assert piece in warning, warning


def test_a_newer_symlinked_checkpoint_directory_is_refused(run):
    root, weights = run
    (root / "step_000009").symlink_to(root / "step_000002")
    step, warning, weight = resume(root)
    assert step == 4 and torch.equal(weight, weights[4])
    assert "step_000009' is a symbolic link to" in warning and "refused" in warning


def test_non_finite_state_is_never_saved(run):
    root, _ = run
    model, opt = make()
    with torch.no_grad():
        model[2].bias[1] = float("nan")
    with pytest.raises(CheckpointError, match=r"refusing to save step 6: 'model.2.bias' holds nan or inf"):
        checkpoint.save(root, model=model, optimizer=opt, step=6, keep_last=1)
    assert [(i.step, i.ok) for i in list_checkpoints(root)] == [(4, True), (2, True)]  # nothing lost, nothing pruned
    assert not list(root.glob(".step_*"))


def test_pruning_keeps_the_newest_good_checkpoints(run):
    root, weights = run
    truncate(root)  # step 4 is damaged
    model, opt = make()
    checkpoint.save(root, model=model, optimizer=opt, step=6, keep_last=2)
    assert [i.step for i in list_checkpoints(root)] == [6, 4, 2]  # 6 and 2 are the two good ones; 4 stays for a look
    checkpoint.save(root, model=model, optimizer=opt, step=8, keep_last=2)
    assert [(i.step, i.ok) for i in list_checkpoints(root)] == [(8, True), (6, True)]


def test_a_full_disk_leaves_no_partial_save(run, monkeypatch):
    root, _ = run
    from torch.distributed.checkpoint import FileSystemWriter

    def no_space(self, plan, planner):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(FileSystemWriter, "write_data", no_space)
    model, opt = make()
    with pytest.raises(CheckpointError, match="saving step 6 into .* failed: .*No space left on device"):
        checkpoint.save(root, model=model, optimizer=opt, step=6)
    monkeypatch.undo()
    assert sorted(p.name for p in root.iterdir()) == ["step_000002", "step_000004"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _write_lock(root: Path, **holder) -> None:
    root.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": 1, "started": "2026-11-21T00:00:00+00:00", "run_id": "job-a", "attempt": 0}
    (root / LOCK).write_text(json.dumps({**base, **holder}))


def test_a_second_job_is_refused_at_once_with_the_holder_named(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-b")
    _write_lock(tmp_path / "ckpt", pid=1)  # pid 1 is alive on every machine
    with pytest.raises(CheckpointLockedError) as err:
        checkpoint.acquire_lock(tmp_path / "ckpt")
    text = str(err.value)
    assert f"in use by another job (host '{socket.gethostname()}', pid 1, started 2026-11-21T00:00:00+00:00, torchrun run id job-a" in text
    assert f"remove '{tmp_path / 'ckpt' / LOCK}' if that job is gone" in text
    model, _ = make()
    with pytest.raises(CheckpointLockedError, match="another job holds its lock"):  # a save is refused too
        checkpoint.save(tmp_path / "ckpt", model=model, step=1)


def test_a_restarted_attempt_or_a_dead_holder_takes_the_lock_over(tmp_path, monkeypatch):
    root = tmp_path / "ckpt"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-a")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    _write_lock(root, pid=1)  # attempt 0 of this job, on this host or another
    assert checkpoint.acquire_lock(root)["attempt"] == 1
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job-c")
    _write_lock(root, pid=_dead_pid(), run_id="job-b")  # a crashed job on this host
    assert checkpoint.acquire_lock(root)["run_id"] == "job-c"
    checkpoint.release_lock(root)
    assert not (root / LOCK).exists()
    _write_lock(root, pid=1)
    checkpoint.release_lock(root)  # only the holder's lock is removed
    assert (root / LOCK).exists()
