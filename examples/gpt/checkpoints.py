"""The GPT example's checkpoints and metrics file: resume from the newest good checkpoint (on any mesh), save when
due or when torchrun asks the job to stop, keep the metrics rows of the steps a restart does not redo.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

from config import TrainConfig
from job import Job, Loop, print0
from vemesh import checkpoint


def resume(job: Job) -> int:
    """The optimizer steps already done: 0 for a fresh run, else the newest good checkpoint's (loaded)."""
    cfg = job.cfg
    if not cfg.checkpoint_dir:
        return 0
    checkpoint.acquire_lock(cfg.checkpoint_dir)  # one job per directory (a restart of this job takes its lock back)
    resumed = checkpoint.load_latest(cfg.checkpoint_dir, model=job.model, optimizer=job.optimizer)
    if resumed is None:
        print0(f"checkpoints: none in {cfg.checkpoint_dir} yet; starting at step 1")
        return 0
    if job.replicas is not None:  # torchft counts committed steps; a peer that is behind heals from this one
        from live_ft import resumed as replicas_resumed
        replicas_resumed(job, resumed[0])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's attempt, from 0
    print0(f"resumed from {checkpoint.checkpoint_path(cfg.checkpoint_dir, resumed[0])} (saved on mesh "
           f"{resumed[1].get('mesh')}, restart {restart}): continuing at step {resumed[0] + 1}")
    return resumed[0]


def open_metrics(job: Job, start_step: int):
    """Rank 0's metrics file: the rows of the steps before the checkpoint kept, the rest dropped."""
    cfg = job.cfg
    if not cfg.metrics_file or dist.get_rank() != 0:
        return None
    rows = []
    if start_step > 0 and os.path.exists(cfg.metrics_file):
        with open(cfg.metrics_file) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    kept = [r for r in rows if r.get("step", 0) <= start_step]
    if start_step > 0 and rows:  # a restart (torchrun's, or an elastic change of world): say what changed
        before = rows[-1]
        print0(f"reconfigured: mesh {before.get('mesh')} ({before.get('world_size')} processes) -> "
               f"{list(job.dims.mesh_shape)} ({dist.get_world_size()} processes); resumed step {start_step}; "
               f"steps redone: {len(rows) - len(kept)}")
    metrics = open(cfg.metrics_file, "w")
    metrics.writelines(json.dumps(r) + "\n" for r in kept)
    return metrics


def save_when_due(job: Job, loop: Loop, train_loss, stopping: bool) -> int | None:
    """Save every --checkpoint-every steps, after --checkpoint-interval-s, at the end, and when stopping."""
    cfg, step = job.cfg, loop.step
    due = cfg.checkpoint_dir and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0))
    if cfg.checkpoint_interval_s and not due and not stopping:  # rank 0's clock decides for everyone
        late = torch.tensor(float(time.monotonic() - loop.last_save >= cfg.checkpoint_interval_s))
        dist.broadcast(late, src=0)
        due = bool(late.item())
    if due or (stopping and cfg.checkpoint_dir):
        loop.last_save = time.monotonic()
        t_save = time.perf_counter()
        path = checkpoint.save(cfg.checkpoint_dir, model=job.model, optimizer=job.optimizer, step=step,
                               extra={"loss": train_loss, "mesh": list(job.dims.mesh_shape)},
                               keep_last=cfg.keep_checkpoints)
        print0(f"step {step:5d}/{cfg.steps} | saved {path} ({time.perf_counter() - t_save:.2f}s)")
    if stopping and step < cfg.steps:
        print0(f"step {step:5d}/{cfg.steps} | stopping: torchrun sent SIGTERM (a node joined, or the job is "
               f"being stopped); step {step} is saved, so a restart redoes nothing")
        if not loop.stop.received.is_set() and not loop.stop.wait(cfg.timeout_s):  # its agent had not asked it yet
            print(f"rank {dist.get_rank()}: other ranks were stopped by torchrun, but this one got no SIGTERM "
                  f"within --timeout-s {cfg.timeout_s:g}; exiting", file=sys.stderr, flush=True)
            return shutdown(cfg, 1, metrics=loop.metrics)
        return shutdown(cfg, 0, metrics=loop.metrics)
    return None


def shutdown(cfg: TrainConfig, code: int, *, metrics=None, release: bool = True) -> int:
    """Close the metrics file and give the checkpoint directory back; return ``code``."""
    if metrics:
        metrics.close()
    if cfg.checkpoint_dir and release:
        checkpoint.release_lock(cfg.checkpoint_dir)
    return code
