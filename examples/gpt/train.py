"""Train a small GPT with tensor, data, pipeline, context and expert parallelism on one vemesh mesh.

On a CPU machine (gloo), 4 processes on a (DP=2, TP=2) mesh, about two minutes; or one process on a 1x1 mesh:

    torchrun --nproc_per_node=4 examples/gpt/train.py
    python examples/gpt/train.py

Other shapes, sizes and options (every TrainConfig field is a flag; see --help):

    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 4,1     # pure DP
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 1,4     # pure TP
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape -1,2 --sequence-parallel
    torchrun --nproc_per_node=4 examples/gpt/train.py --no-distributed-optimizer --dtype bf16
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 4,1 --fsdp --dp-replicate 2   # FSDP2, HSDP
    python examples/gpt/train.py --data my_text.txt --steps 500 --metrics-file metrics.jsonl

Pipeline x data x tensor on (PP, DP, TP), any torch schedule (--pp-schedule gpipe | 1f1b | interleaved-1f1b |
interleaved-zb | zbv | dualpipev, --microbatches N); four dims by name with --mesh-dims (CP: ring attention):

    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-shape 2,2,2 --n-layer 4
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 2,1,2 --n-layer 4 --pp-schedule interleaved-1f1b
    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-dims DP,CP,TP --mesh-shape 2,2,2
    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-dims PP,DP,CP --mesh-shape 2,2,2 --n-layer 4 --fsdp

A mixture of experts with expert parallelism (E / EP experts per rank, all-to-all over mesh["EP"]):

    torchrun --nproc_per_node=4 examples/gpt/train.py --moe-experts 8 --ep 2 --mesh-shape 2,2

Checkpoints on any mesh, and torchrun's restart of a crashed worker (the last rank exits at step 60 once):

    torchrun --nproc_per_node=4 --max-restarts=1 examples/gpt/train.py \
        --checkpoint-dir ckpt --checkpoint-every 25 --fail-at-step 60

Live fault tolerance with torchft (pip install "vemesh[ft]"; live_ft.py): each replica is its own torchrun:

    torchft_lighthouse --min_replicas 1 --bind "[::]:29510" --heartbeat_timeout_ms 1000 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    torchrun --nproc_per_node=2 --master-port=29601 examples/gpt/train.py --mesh-shape 1,2 --ft-replica-id 0 &
    torchrun --nproc_per_node=2 --master-port=29602 examples/gpt/train.py --mesh-shape 1,2 --ft-replica-id 1

On GPUs (nccl) and across nodes the same script runs unchanged:

    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/gpt/train.py --mesh-shape -1,8

What each rank does (job.py): ``ParallelDims`` builds the mesh and its derived dims; every rank builds the same
GPT from the same seed; ``vemesh.models.gpt.parallelize`` applies TP, EP, activation checkpointing and DDP over
the data dims (or FSDP2); ZeRO-1 steps 1/DP of the AdamW state. The loop below is torch's own: ``zero_grad``,
``backward``, ``clip_grad_norm_``, ``step``; each rank keeps its rows of the same global batch, so the loss
matches a single-process run of the same config.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

import torch
import torch.distributed as dist

from checkpoints import open_metrics, resume, save_when_due, shutdown
from config import ConfigError, TrainConfig
from data import ByteDataset
from evaluation import evaluate, finish
from job import Job, Loop, Step, build_model, build_optimizer, dp_mean, loss_fn, print0, print_error, setup
from moe import take_load
from pipeline import to_rank0
from stopping import StopRequest
from vemesh import VESCALE_DEVICE_MESH, checkpoint, hangs
from vemesh.ft import ReplicaError
from vemesh.optim import clip_grad_norm_

__all__ = ["loss_fn", "main"]


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.min_lr`` at the last step."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def main(argv: list[str] | None = None) -> int:
    try:  # bad flags or data: one clear message on every rank, no traceback, exit code 2
        cfg = TrainConfig.from_args(argv)
        dataset = ByteDataset(cfg.data, max_bytes=cfg.max_data_bytes, val_fraction=cfg.val_fraction)
        dataset.check(cfg.seq_len)
    except ConfigError as e:
        print_error(str(e))
        return 2
    meter = None
    if cfg.memory_report:  # measured from the first allocation: the mesh, the model, the wrappers, the steps
        from vemesh.planning.measure import RunMeter
        meter = RunMeter()
        meter.exclude(dataset.train, dataset.val)  # the corpus is host data that batches are cut from
    try:
        with meter or contextlib.nullcontext():
            code = run(cfg, dataset, meter)
    except ReplicaError as e:  # live fault tolerance cannot go on (no lighthouse, no quorum in time): one line
        print_error(str(e))
        code = 1
    except RuntimeError as e:  # out of memory (CUDA's OutOfMemoryError, the CPU allocator's): what to plan instead
        if not isinstance(e, torch.OutOfMemoryError) and "can't allocate memory" not in str(e):
            raise
        print_error(out_of_memory(cfg, e))
        code = 1
    hangs.dump()  # with VEMESH_HANG_DIR: this rank's dump of a run that ended (vemesh diagnose --stragglers reads them)
    close_mesh()
    return code


def out_of_memory(cfg: TrainConfig, e: RuntimeError) -> str:
    """One line for a run that ran out of memory: the allocator's words, and the ``vemesh plan`` command of this run
    (with the device's memory on CUDA), which gives each rank's peak before a launch."""
    memory = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory if cfg.device == "cuda" else None
    said = str(e).strip().splitlines()[0].rstrip(".") if str(e).strip() else type(e).__name__
    return (f"out of memory: {said}. Plan this run before launching it (each rank's peak, and with --device-memory "
            "whether it fits; a search without --dp and --tp finds the meshes that do): "
            + cfg.plan_command(memory))


def run(cfg: TrainConfig, dataset: ByteDataset, meter=None) -> int:
    """Build the mesh, the model and the optimizer, resume, train, and return the exit code."""
    job = setup(cfg, dataset, meter)
    try:
        build_model(job)
        build_optimizer(job)
        try:
            start_step = resume(job)
        except checkpoint.CheckpointError as e:
            print_error(f"cannot resume: {e}")
            return shutdown(cfg, 1, release=not isinstance(e, checkpoint.CheckpointLockedError))
        return train(job, start_step)
    finally:
        if job.replicas is not None:  # leave the live replicas (torchft's manager and servers)
            job.replicas.shutdown()


def train(job: Job, start_step: int) -> int:
    """The loop: torch's own zero_grad, backward, clip, step; checkpoints, evaluation and the metrics."""
    cfg = job.cfg
    loop = Loop(start_step, open_metrics(job, start_step), StopRequest(cfg.stop_grace_s, enabled=bool(cfg.checkpoint_dir)))
    while loop.step < cfg.steps:
        loop.step += 1
        t0 = time.perf_counter()
        VESCALE_DEVICE_MESH.mark_step(loop.step)  # the step of each collective, in a hang report
        if job.meter is not None:  # --memory-report: count the collectives of the step, zero_grad to the mean loss
            job.meter.begin_step()
        job.optimizer.zero_grad()  # with --ft-replica-id, first this step's quorum: a replica that is behind heals here
        done = train_step(job, loop)
        if job.meter is not None:
            job.meter.end_step()
        if done.retry:  # nothing applied: redo the step
            loop.step -= 1
            continue
        if done.finished:
            break
        if done.exit_code is not None:
            return shutdown(cfg, done.exit_code, metrics=loop.metrics)
        code = after_step(job, loop, done, t0)  # not None: the job stopped there (saved, files closed)
        if code is not None:
            return code
    finish(job, loop)
    return shutdown(cfg, 0, metrics=loop.metrics)


def train_step(job: Job, loop: Loop) -> Step:
    """One optimizer step (as one of the live replicas when there are: live_ft.step)."""
    if job.replicas is not None:
        from live_ft import step as replica_step
        return replica_step(job, loop, compute, agree, skip_or_stop)
    done = compute(job, loop, (job.dp_rank, job.dp_size, job.cfg.grad_accum_for(job.dp_size, job.dims.pp)))
    agree(job, loop, done)
    if done.skipped:
        done.exit_code = skip_or_stop(job, loop)
        job.optimizer.zero_grad()  # the weights stay as they were; the step still counts
    else:
        job.optimizer.step()
    if done.loss is not None:  # the batch's mean loss, within the step (the planner's GPT preset counts it there too)
        done.mean_loss = dp_mean(done.loss, job.dp_group)
    return done


def compute(job: Job, loop: Loop, rows: tuple[int, int, int]) -> Step:
    """Forward, backward and clipping on this rank's ``rows`` of the global batch: ``(row block, blocks, passes)``."""
    cfg = job.cfg
    # Dropout masks: the same within a TP group (its activations are replicated), different
    # across DP, and a function of the step, so that a resumed run draws the same ones.
    torch.manual_seed(cfg.seed + 1 + rows[0] + 1_000_003 * loop.step)
    lr = get_lr(loop.step, cfg)
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    x, y = job.dataset.get_batch("train", step=loop.step, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                 seq_len=cfg.seq_len, dp_rank=rows[0], dp_size=rows[1])
    x, y = x.to(job.device), y.to(job.device)
    faults = job.faults.during(loop.step, loop.restart, job.chunks, job.parts[0]) if job.faults else contextlib.nullcontext()
    with faults, job.cp(x, y):  # with CP: this rank's tokens of every row, ring attention
        loss, aux = forward_backward(job, x, y, rows[2])
    params = [p for c in job.chunks for p in c.parameters()]
    pp = [VESCALE_DEVICE_MESH.get_group("PP")] if job.pipe is not None else []  # the whole model's norm: sum the stages
    norm = clip_grad_norm_(params, cfg.grad_clip or float("inf"), groups=pp)
    return Step(loss=loss, aux=aux, norm=norm, lr=lr, rows=rows)


def forward_backward(job: Job, x: torch.Tensor, y: torch.Tensor, passes: int):
    """The loss of this rank's batch and its gradients: ``passes`` slices without PP (all but the last
    accumulate without DP communication, unless --gradient-sync each), or micro-batches through torch's schedule
    (loss on the last stage)."""
    if job.pipe is not None:
        return job.pipe.step(x, y), 0.0
    loss, aux_total = 0.0, 0.0
    for i, (xs, ys) in enumerate(zip(x.chunk(passes), y.chunk(passes))):
        with gradient_sync(job.model, i == passes - 1 or job.cfg.gradient_sync == "each"):
            part = loss_fn(job.model(xs), ys) / passes
            loss = loss + part.detach()
            if job.cfg.moe_aux_loss_coef:  # the load-balancing loss trains the router; the logged loss omits it
                aux = job.parts[0].aux_loss() / passes
                aux_total = aux_total + aux.detach()
                part = part + job.cfg.moe_aux_loss_coef * aux
            part.backward()  # after the last, every .grad is averaged over DP
    return loss, aux_total


def agree(job: Job, loop: Loop, done: Step) -> None:
    """Every rank agrees on a non-finite loss or norm anywhere (skip or stop), and on a stop torchrun asked for."""
    loss = done.loss
    flags = torch.tensor([float(not torch.isfinite(done.norm) or (loss is not None and not torch.isfinite(loss))),
                          float(loop.stop.received.is_set())])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    done.skipped, done.stopping = bool(flags[0].item()), bool(flags[1].item())
    if done.stopping:
        loop.stop.agreed()


def skip_or_stop(job: Job, loop: Loop, retried: str = "") -> int | None:
    """Count a non-finite step: exit code 1 past --skip-nonfinite, else None (the step is skipped)."""
    cfg = job.cfg
    loop.skipped += 1
    if loop.skipped > cfg.skip_nonfinite:
        print_error(f"step {loop.step}: the loss or the gradient norm is nan or inf; stopping before the "
                    f"optimizer steps (--skip-nonfinite {cfg.skip_nonfinite} allows skipping that many such steps). "
                    f"The checkpoints in {cfg.checkpoint_dir or '(none)'} are untouched.")
        return 1
    print0(f"step {loop.step:5d}/{cfg.steps} | non-finite loss or gradient norm: step skipped "
           f"({loop.skipped} of --skip-nonfinite {cfg.skip_nonfinite}){retried}")
    return None


def after_step(job: Job, loop: Loop, done: Step, t0: float) -> int | None:
    """Log, evaluate, write the metrics, save when due; an exit code when the job stops here."""
    cfg, dp_group, step = job.cfg, job.dp_group, loop.step
    mean = done.mean_loss if done.mean_loss is not None or done.loss is None else dp_mean(done.loss, dp_group)
    train_loss = to_rank0(None if mean is None else torch.tensor(mean), job.last_pp)  # from the last stage to rank 0
    dt = time.perf_counter() - t0
    record = {"step": step, "loss": train_loss, "lr": done.lr, "tokens_per_s": cfg.global_batch_size * cfg.seq_len / dt,
              "elapsed_s": time.perf_counter() - loop.t_start, "restart": loop.restart, "skipped": done.skipped,
              "world_size": dist.get_world_size(), "mesh": list(job.dims.mesh_shape), "grad_norm": float(done.norm),
              "time": time.time(), "pid": os.getpid(), **done.extra}
    if cfg.moe_experts:  # the router's load: token slots per expert of each MoE layer, over the global batch
        record["expert_load"] = take_load(job.parts[0], dp_group)
        if cfg.moe_aux_loss_coef:
            record["aux_loss"] = dp_mean(torch.as_tensor(done.aux), dp_group)
    if dist.get_rank() == 0 and (step % cfg.log_every == 0 or step == loop.start + 1 or step == cfg.steps):
        print0(f"step {step:5d}/{cfg.steps} | loss {train_loss:.4f} | lr {done.lr:.2e} | "
               f"{record['tokens_per_s']:8.0f} tok/s | {record['elapsed_s']:6.1f}s")
    if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
        record["eval_loss"] = evaluate(job)
        if dist.get_rank() == 0:
            print0(f"step {step:5d}/{cfg.steps} | eval loss {record['eval_loss']:.4f} (held-out)")
    if cfg.straggler_every and step % cfg.straggler_every == 0:  # every rank gathers; rank 0 prints one line
        line = hangs.straggler_summary(since_ns=loop.stragglers_since)
        loop.stragglers_since = time.time_ns()
        print0(f"step {step:5d}/{cfg.steps} | {line}") if line else None
    if loop.metrics:
        loop.metrics.write(json.dumps(record) + "\n")
        loop.metrics.flush()
    return save_when_due(job, loop, train_loss, done.stopping)


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of one backward pass: gradients are averaged over DP only if ``sync``."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2's switch
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()


def close_mesh() -> None:
    """Drop the mesh and its cached views, and destroy torch's process groups."""
    VESCALE_DEVICE_MESH.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Leave without tearing the interpreter down, as multiprocessing's children do: a gloo worker thread that
    # releases a finished collective's tensors after the interpreter began finalizing cannot take the GIL, and
    # the process aborts ("terminate called without an active exception", about one run in 15 on 2 busy cores).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
