"""Live fault tolerance for the GPT example (``--ft-replica-id``): this job is one replica of a torchft quorum.

The loop calls :func:`step` at one point, in place of its plain step, when the job is a replica: the live
replicas split each global batch by their index, the loss and gradients average over the mesh's data dims and
then across the replicas (torchft's Manager, through ``vemesh.ft``), and a step that not every replica reduced
(or that a replica which must not take part joined) is retried with the next quorum, nothing applied.
"""
from __future__ import annotations

import logging
import os
import re
from typing import Any, Callable

import torch

from config import TrainConfig
from job import Job, Step, dp_mean, print0


def step(job: Job, loop: Any, compute: Callable, agree: Callable, skip_or_stop: Callable) -> Any:
    """One step as a replica: ``compute(job, loop, rows)`` gives the step's record (a :class:`job.Step`); ``agree`` sets
    its ``skipped``/``stopping`` on every rank; ``skip_or_stop`` counts a skip (an exit code, or None)."""
    cfg, replicas = job.cfg, job.replicas
    if replicas.refused is not None:  # a replica that must not take part joined:
        print0(f"step {replicas.step + 1:5d}/{cfg.steps} | not run, retried with the next quorum: {replicas.refused}")
        job.optimizer.step()  # the vote only, down: nothing commits, and the newcomer has left
        return Step(retry=True)
    loop.step, rows = replicas.step + 1, replica_rows(cfg, replicas, job.dp_rank, job.dp_size)
    if replicas.change is not None:
        print0(f"fault tolerance: {replicas.change}")
    if loop.step > cfg.steps:  # healed from a peer that had finished
        return Step(finished=True)
    done = compute(job, loop, rows)
    # the mean over the global batch: over the data dims here, then across the replicas
    done.loss = replicas.average_(torch.tensor(dp_mean(done.loss, job.dp_group)))
    done.mean_loss, done.extra = done.loss.item(), {"participants": rows[1] // job.dp_size}
    agree(job, loop, done)
    if replicas.errored() is not None:
        done.skipped = False  # a failed cross-replica reduce: the replicas' vote drops the step (below), not a skip
    if done.skipped:
        done.exit_code = skip_or_stop(job, loop, ", to be retried")
        if done.exit_code is not None:
            return done
        replicas.discard("non-finite loss or gradient norm")  # every replica saw the same values: all vote it down
    job.optimizer.step()  # with the replicas' vote: applied only if every replica reduced
    if not job.optimizer.committed:
        if not done.skipped:
            reason = str(replicas.errored() or "too few replicas").splitlines()[0]
            reason = re.sub(r"^\[[^\]]*\]\s*", "", reason).split(". ")[0]  # gloo's: drop the source path
            print0(f"step {loop.step:5d}/{cfg.steps} | not committed, retried with the next quorum: {reason}")
        done.retry = True
    return done


def resumed(job: Job, step: int) -> None:
    """torchft counts committed steps: after a checkpoint load, a peer that is behind heals from this one."""
    job.replicas.manager.load_state_dict({"step": step, "batches_committed": 0})


def join_replicas(cfg: TrainConfig, grad_dim: str, dp_size: int):
    """Join the live replicas through torchft (this job is one of them) as the mesh's ``dp_replicate`` dim."""
    from vemesh.ft import start_replicas

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and vote at INFO
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)  # and warn that gloo has no flight recorder
    replicas = start_replicas(cfg.ft_replica_id, lighthouse=cfg.ft_lighthouse, min_replicas=cfg.ft_min_replicas,
                              device_type=cfg.device, timeout=cfg.ft_timeout_s, admits=batch_split(cfg, dp_size))
    print0(f"fault tolerance: replica {cfg.ft_replica_id} of a torchft quorum (lighthouse "
           f"{cfg.ft_lighthouse or os.environ['TORCHFT_LIGHTHOUSE']}, at least {cfg.ft_min_replicas} per step); "
           f"gradients average over {grad_dim}, then across the live replicas (dp_replicate); the replicas split "
           f"each global batch of {cfg.global_batch_size} by their index")
    return replicas


def batch_split(cfg: TrainConfig, dp_size: int):
    """Given a number of live replicas: None if the global batch splits over them, else why not."""
    def admits(n: int) -> str | None:
        blocks, rows = n * dp_size, cfg.global_batch_size // (n * dp_size)
        if cfg.global_batch_size % blocks or (cfg.micro_batch_size and rows % cfg.micro_batch_size):
            return (f"--global-batch-size {cfg.global_batch_size} does not split over {n} replicas x DP {dp_size}"
                    + (f" in micro-batches of {cfg.micro_batch_size}" if cfg.micro_batch_size else ""))
        return None
    return admits


def replica_rows(cfg: TrainConfig, replicas, dp_rank: int, dp_size: int) -> tuple[int, int, int]:
    """``(row block, blocks, passes)``: this rank's share of the global batch among the replicas of this step."""
    n = replicas.size()  # replicas taking part now (a count the batch splits over: others are refused at their join)
    index = replicas.index()
    blocks = n * dp_size
    rows = cfg.global_batch_size // blocks
    return index * dp_size + dp_rank, blocks, rows // cfg.micro_batch_size if cfg.micro_batch_size else 1
