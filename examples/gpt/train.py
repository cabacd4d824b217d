"""Train a small GPT with tensor, data and pipeline parallelism on one vemesh mesh.

On a CPU machine (gloo), 4 processes on a (DP=2, TP=2) mesh, about two minutes:

    torchrun --nproc_per_node=4 examples/gpt/train.py

One process (a 1x1 mesh, no torchrun needed):

    python examples/gpt/train.py

Other shapes, sizes and options (every TrainConfig field is a flag; see --help):

    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 4,1     # pure DP
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 1,4     # pure TP
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape -1,2 --sequence-parallel
    torchrun --nproc_per_node=4 examples/gpt/train.py --no-distributed-optimizer --dtype bf16
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 4,1 --fsdp --dp-replicate 2   # FSDP2, HSDP
    python examples/gpt/train.py --data my_text.txt --steps 500 --metrics-file metrics.jsonl

Pipeline x data x tensor parallelism on a 3-D (PP, DP, TP) mesh, with torch's schedules
(--pp-schedule gpipe | 1f1b | interleaved-1f1b, --microbatches N, default 2 x PP):

    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-shape 2,2,2 --n-layer 4
    torchrun --nproc_per_node=4 examples/gpt/train.py --mesh-shape 2,1,2 --n-layer 4 --pp-schedule interleaved-1f1b

Four dims by name (--mesh-dims, from PP, DP, CP, TP in mesh order): context parallelism splits
every sequence over mesh["CP"] (ring attention), FSDP2 runs under the pipeline, and every torch
schedule is there (--pp-schedule zbv | dualpipev | interleaved-zb too):

    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-dims DP,CP,TP --mesh-shape 2,2,2
    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-dims PP,DP,CP --mesh-shape 2,2,2 --n-layer 4 --fsdp
    torchrun --nproc_per_node=2 examples/gpt/train.py --mesh-shape 2,1,1 --n-layer 4 --pp-schedule zbv

A mixture of experts (--moe-experts E, top-k router) with expert parallelism: each EP rank holds
E / EP experts, EP folds over the DP (x CP) ranks, tokens travel by all-to-all over mesh["EP"]:

    torchrun --nproc_per_node=4 examples/gpt/train.py --moe-experts 8 --ep 2 --mesh-shape 2,2

Checkpoints and recovery: save every 25 steps, resume automatically from the latest good
checkpoint (on any mesh shape), and let torchrun restart a crashed worker. --fail-at-step
makes the last rank exit at step 60 on the first attempt, to watch the recovery:

    torchrun --nproc_per_node=4 --max-restarts=1 examples/gpt/train.py \
        --checkpoint-dir ckpt --checkpoint-every 25 --fail-at-step 60
    torchrun --nproc_per_node=2 examples/gpt/train.py --checkpoint-dir ckpt --mesh-shape -1,2   # fewer workers

Live fault tolerance with torchft (pip install "vemesh[ft]"): each replica is its own torchrun, a lost
one costs no restart, a returning one heals from a live peer (the replicas split each global batch):

    torchft_lighthouse --min_replicas 1 --bind "[::]:29510" --heartbeat_timeout_ms 1000 &
    export TORCHFT_LIGHTHOUSE=http://localhost:29510
    torchrun --nproc_per_node=2 --master-port=29601 examples/gpt/train.py --mesh-shape 1,2 --ft-replica-id 0 &
    torchrun --nproc_per_node=2 --master-port=29602 examples/gpt/train.py --mesh-shape 1,2 --ft-replica-id 1

On GPUs (nccl) and across nodes the same script runs unchanged:

    torchrun --nproc_per_node=8 examples/gpt/train.py --mesh-shape -1,4
    torchrun --nnodes=2 --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/gpt/train.py --mesh-shape -1,8

What each rank does: ``ParallelDims`` builds the mesh and every dim derived from it; every rank builds the
same model (``vemesh.models.gpt``) from the same seed, and its ``parallelize`` applies TP over
``VESCALE_DEVICE_MESH["TP"]``, EP over ``["EP"]``, activation checkpointing, and DDP over the data dims (or, with
``--fsdp``, torch's FSDP2); each step runs inside ``context_parallel`` when there is a CP dim. The ZeRO-1
optimizer (a ``torch.optim.Optimizer``) steps 1/DP of the state on each DP rank. The loop is
torch's own: ``optimizer.zero_grad(); loss.backward(); clip_grad_norm_; optimizer.step()``. Each step, every rank draws the same global batch and keeps the
rows of its DP rank, so the loss (the mean over the global batch) matches a
single-process run of the same config.
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy

from config import ConfigError, TrainConfig
from data import VOCAB_SIZE, ByteDataset, decode, encode
from faults import Fault, no_dp_sync
from moe import experts_line, sum_counts, take_load
from pipeline import Pipeline, generate, layout_line, to_rank0
from stopping import StopRequest
from vemesh import VESCALE_DEVICE_MESH, checkpoint, hangs
from vemesh.ft import ReplicaError
from vemesh.models.gpt import GPT, GPTConfig, cut_stage, parallelize, split_layers, stage_indices, stages_per_rank
from vemesh.optim import DistributedOptimizer, clip_grad_norm_
from vemesh.parallel import ParallelDims, context_parallel
from vemesh.parallel.context import positions

SAMPLE_PROMPT = "def "


def print0(*args, **kwargs) -> None:
    """Print on global rank 0 only (before the process group exists, trust torchrun's RANK)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(*args, **kwargs, flush=True)


def print_error(message: str) -> None:
    """An error, on every rank's stderr: whichever rank exits first, torchrun kills the others, so a message
    left to rank 0 alone could vanish behind torchrun's banner."""
    print("error: " + message.replace("\n", "\nerror: "), file=sys.stderr, flush=True)


def get_lr(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``cfg.lr``, then cosine decay to ``cfg.min_lr`` at the last step."""
    if step <= cfg.warmup_steps:
        return cfg.lr * step / max(1, cfg.warmup_steps)
    progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (cfg.lr - cfg.min_lr)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of this rank's batch, computed in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def dp_mean(value: torch.Tensor, dp_group: dist.ProcessGroup) -> float:
    """The mean of a scalar over the DP ranks (every DP rank holds an equal share of the batch)."""
    value = value.detach().float().clone()
    dist.all_reduce(value, op=dist.ReduceOp.SUM, group=dp_group)  # gloo has no AVG
    return value.item() / dist.get_world_size(dp_group)


@dataclass
class Job:
    """Everything a step needs, set up once: the mesh's sizes and groups, the model and the optimizer."""

    cfg: TrainConfig
    dataset: ByteDataset
    dims: ParallelDims
    device: torch.device
    dtype: torch.dtype
    meter: Any = None
    replicas: Any = None
    parts: list[torch.nn.Module] = field(default_factory=list)  # this rank's model, or its pipeline stages, unwrapped
    chunks: list[torch.nn.Module] = field(default_factory=list)  # the same, wrapped in DDP or sharded by FSDP2
    model: Any = None  # what the optimizer and checkpoints take: the wrapped model, or the list of stages
    optimizer: Any = None
    pipe: Pipeline | None = None
    last_pp: int | None = None  # the PP rank holding the last stage (and the loss)
    fault: Fault | None = None  # --inject

    @property
    def dp_size(self) -> int:  # each DP rank takes its rows of the global batch
        return VESCALE_DEVICE_MESH.get_strategy_size("DP")

    @property
    def dp_rank(self) -> int:
        return VESCALE_DEVICE_MESH.lookup_rank("DP")

    @property
    def dp_group(self) -> dist.ProcessGroup:  # the ranks whose means make the global batch's: DP, or dp_cp
        return VESCALE_DEVICE_MESH.get_group(self.dims.grad_dim)

    def cp(self, *tensors: torch.Tensor) -> contextlib.AbstractContextManager:
        """The context a step runs in: with CP, each rank keeps its part of the sequence of ``tensors`` (and of the
        stages' position buffers), and attention is ring attention over mesh["CP"]."""
        if self.dims.cp == 1:
            return contextlib.nullcontext()
        buffers = [*tensors, *(p.pos for p in self.parts)]
        return context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=buffers, load_balance=self.cfg.cp_load_balance,
                                buffer_seq_dims=[1] * len(tensors) + [0] * len(self.parts))


def main(argv: list[str] | None = None) -> int:
    try:  # bad flags or data: one clear message, no traceback, exit code 2
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
    hangs.dump()  # with VEMESH_HANG_DIR: this rank's dump of a run that ended (vemesh diagnose --stragglers reads them)
    close_mesh()
    return code


def run(cfg: TrainConfig, dataset: ByteDataset, meter=None) -> int:
    """Build the mesh, the model and the optimizer, resume, train, and return the exit code."""
    job = setup(cfg, dataset, meter)
    build_model(job)
    build_optimizer(job)
    try:
        start_step = resume(job)
    except checkpoint.CheckpointError as e:
        print_error(f"cannot resume: {e}")
        return shutdown(cfg, 1, release=not isinstance(e, checkpoint.CheckpointLockedError))
    return train(job, start_step)


def setup(cfg: TrainConfig, dataset: ByteDataset, meter) -> Job:
    """This rank's device, and the mesh with every derived dim (the library's one rule: ParallelDims)."""
    local_rank, local_world_size = int(os.environ.get("LOCAL_RANK", "0")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if cfg.device == "cuda":  # "auto" was resolved to "cuda" or "cpu" by the config
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores among this host's ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    replicate = cfg.dp_replicate if cfg.fsdp else 1
    dims = ParallelDims(cfg.world_size, pp=cfg.pp_size, dp_replicate=replicate, dp_shard=cfg.dp_size // replicate,
                        cp=cfg.cp_size, tp=cfg.tp_size, ep=cfg.ep, mesh_dims=cfg.mesh_dim_names)
    if cfg.straggler_every:  # the summaries read torch's Flight Recorder: on before the first collective
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    dims.build(cfg.device, VESCALE_DEVICE_MESH, timeout=cfg.timeout_s)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    job = Job(cfg, dataset, dims, device, dtype, meter)
    if cfg.inject is not None:
        job.fault = Fault.parse(cfg.inject, cfg.world_size, cfg.steps)
    mesh_text = " x ".join(f"{n}={s}" for n, s in zip(dims.mesh_dims, dims.mesh_shape))
    print0(f"vemesh GPT example: {dist.get_world_size()} processes on {cfg.device} "
           f"(backend {dist.get_backend()}), mesh {mesh_text}")
    print0(VESCALE_DEVICE_MESH.describe())
    if cfg.ft_replica_id is not None:
        job.replicas = join_replicas(cfg, dims.grad_dim, job.dp_size)
    print0(f"data: {dataset.source}: {len(dataset.train):,} train / {len(dataset.val):,} held-out bytes")
    return job


def build_model(job: Job) -> None:
    """Every rank builds the same GPT, keeps its pipeline stages, and parallelizes them (TP, EP, checkpointing,
    then FSDP2 or DDP: vemesh.models.gpt.parallelize)."""
    cfg, dims = job.cfg, job.dims
    torch.manual_seed(cfg.seed)  # every rank builds the same weights before they are sharded
    config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                       n_embd=cfg.n_embd, dropout=cfg.dropout, moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k,
                       moe_every=cfg.moe_every)
    # FSDP2 keeps fp32 parameters and computes in bf16 (its MixedPrecisionPolicy), as ZeRO-1 keeps fp32 masters
    model = GPT(config).to(device=job.device, dtype=torch.float32 if cfg.fsdp else job.dtype)
    n_params = model.num_params()
    stages, n_stages = [0], 1
    job.parts = [model]
    if dims.pp > 1:  # this rank's stages: the full model with the other stages' blocks removed
        n_stages = dims.pp * stages_per_rank(cfg.pp_schedule)
        stages = stage_indices(VESCALE_DEVICE_MESH.lookup_rank("PP"), dims.pp, cfg.pp_schedule)
        job.parts = [cut_stage(model, s, n_stages) for s in stages]
        del model
    print_parallel_lines(job)
    if cfg.moe_aux_loss_coef and dist.get_world_size(job.dp_group) > 1:  # the balance loss sees the whole batch's routing
        for part in job.parts:
            for moe in part.moe_layers():
                moe.count = sum_counts(job.dp_group)
    wrap = dict(data_parallel="fsdp", mp_policy=MixedPrecisionPolicy(param_dtype=job.dtype, reduce_dtype=torch.float32)) \
        if cfg.fsdp else dict(data_parallel="ddp", overlap_grad_reduce=cfg.overlap_grad_reduce, replicas=job.replicas)
    job.chunks = [parallelize(p, VESCALE_DEVICE_MESH, sequence_parallel=cfg.sequence_parallel,
                              activation_checkpointing=cfg.activation_checkpointing, **wrap) for p in job.parts]
    job.model = job.chunks[0] if dims.pp == 1 else job.chunks
    print0(f"model: {n_params:,} parameters, n_layer={cfg.n_layer} n_head={cfg.n_head} "
           f"n_embd={cfg.n_embd} seq_len={cfg.seq_len} dtype={cfg.dtype}"
           + (f" moe_experts={cfg.moe_experts} top_k={cfg.moe_top_k}" if cfg.moe_experts else "")
           + (" sequence-parallel" if cfg.sequence_parallel and dims.tp > 1 else "")
           + (" activation-checkpointing" if cfg.activation_checkpointing else ""))
    if dims.pp > 1:  # every rank's place in the pipeline, found through the mesh, printed by rank 0
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, layout_line(stages, cfg.pp_schedule))
        print0("\n".join(lines))
        job.pipe = Pipeline(job.chunks, stages, n_stages, cfg.pp_schedule, cfg.microbatches, loss_fn, job.device)
        job.last_pp = job.pipe.last_pp
        print0(f"pipeline: {cfg.pp_schedule}, {n_stages} stages over PP={dims.pp} (blocks per stage "
               f"{[len(b) for b in split_layers(cfg.n_layer, n_stages)]}), {cfg.microbatches} micro-batches of "
               f"{cfg.global_batch_size // job.dp_size // cfg.microbatches} sequences per DP rank")


def print_parallel_lines(job: Job) -> None:
    """The start-up lines of expert and context parallelism: who holds which experts, which positions."""
    cfg, dims = job.cfg, job.dims
    if dims.ep > 1:  # each EP rank keeps E / EP experts; tokens reach them by all-to-all over mesh["EP"]
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, experts_line(VESCALE_DEVICE_MESH, cfg.moe_experts))
        print0(f"expert parallel: EP={dims.ep} folded over {dims.grad_dim} ({dims.dp * dims.cp} ranks), EDP="
               f"{dims.dp * dims.cp // dims.ep}; {cfg.moe_experts // dims.ep} of {cfg.moe_experts} experts per rank, "
               f"top-{cfg.moe_top_k}; dense gradients averaged over {dims.grad_dim}, expert gradients over EDP")
        print0("\n".join(lines))
    if dims.cp > 1:  # ring attention over mesh["CP"], global positions
        mine = positions(cfg.seq_len, VESCALE_DEVICE_MESH.lookup_rank("CP"), dims.cp,
                         load_balance=cfg.cp_load_balance).tolist()
        starts = [mine[0]] + [b for a, b in zip(mine, mine[1:]) if b != a + 1]
        ends = [a for a, b in zip(mine, mine[1:]) if b != a + 1] + [mine[-1]]
        print0(f"context parallel: CP={dims.cp} over mesh[\"CP\"], ring attention; each rank holds "
               f"{cfg.seq_len // dims.cp} of {cfg.seq_len} tokens per sequence "
               + ("(head-tail load balancing: 2 chunks)" if cfg.cp_load_balance else "(one contiguous slice)")
               + f"; rank 0 (CP rank {VESCALE_DEVICE_MESH.lookup_rank('CP')}) holds positions "
               + ", ".join(f"{p}..{q}" for p, q in zip(starts, ends))
               + f"; gradients averaged over {dims.grad_dim} = DP x CP ({dims.dp * dims.cp} ranks)")


def build_optimizer(job: Job) -> None:
    """ZeRO-1 (a torch.optim.Optimizer whose AdamW state is split over DP), or AdamW on FSDP2's shards."""
    cfg = job.cfg
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    if cfg.distributed_optimizer and not cfg.fsdp:
        job.optimizer = DistributedOptimizer(torch.optim.AdamW, models=job.chunks, **adamw)
        kind = "ZeRO-1 DistributedOptimizer"
        if job.replicas is not None:  # what a returning replica takes from a live one (each rank its own shards)
            job.replicas.track(job.model, job.optimizer)
    else:  # with FSDP2 the parameters are shards already, and so is AdamW's state
        job.optimizer = torch.optim.AdamW([p for c in job.chunks for p in c.parameters()], **adamw)
        kind = "AdamW"
        if cfg.fsdp:
            kind += " on FSDP2 shards" + (f" (HSDP, {cfg.dp_replicate} replicas)" if cfg.dp_replicate > 1 else "")
    passes = cfg.grad_accum_for(job.dp_size, job.dims.pp)
    print0(f"optimizer: {kind}, "
           f"global batch {cfg.global_batch_size} x {cfg.seq_len} tokens, "
           f"{cfg.global_batch_size // job.dp_size} sequences per DP rank"
           + (f" in {passes} passes" if passes > 1 else "") + f", {cfg.steps} steps")


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
        job.replicas.manager.load_state_dict({"step": resumed[0], "batches_committed": 0})
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


@dataclass
class Loop:
    """The training loop's running state."""

    start: int  # optimizer steps already done when the loop began (0: a fresh run)
    metrics: Any
    stop: StopRequest
    step: int = 0
    t_start: float = field(default_factory=time.perf_counter)
    last_save: float = field(default_factory=time.monotonic)
    skipped: int = 0  # steps skipped for a non-finite loss or gradient norm
    stragglers_since: int = 0  # --straggler-every: the collectives entered after this time (ns)
    restart: int = field(default_factory=lambda: int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def __post_init__(self) -> None:
        self.step = self.start


def train(job: Job, start_step: int) -> int:
    """The loop: torch's own zero_grad, backward, clip, step; checkpoints, evaluation and the metrics."""
    cfg = job.cfg
    loop = Loop(start_step, open_metrics(job, start_step), StopRequest(cfg.stop_grace_s, enabled=bool(cfg.checkpoint_dir)))
    while loop.step < cfg.steps:
        loop.step += 1
        if loop.step == cfg.fail_at_step and loop.restart == 0 and dist.get_rank() == dist.get_world_size() - 1:
            print(f"rank {dist.get_rank()}: --fail-at-step {loop.step}: exiting to simulate a crashed worker",
                  file=sys.stderr, flush=True)
            os._exit(13)
        t0 = time.perf_counter()
        VESCALE_DEVICE_MESH.mark_step(loop.step)  # the step of each collective, in a hang report
        if job.meter is not None:  # --memory-report: count the collectives of the step, from zero_grad to step
            job.meter.begin_step()
        job.optimizer.zero_grad()  # with --ft-replica-id, first this step's quorum: a replica that is behind heals here
        outcome = train_step(job, loop)
        if job.meter is not None:
            job.meter.end_step()
        if outcome == "retry":  # not every replica reduced, or one that must not take part joined: nothing applied
            loop.step -= 1
            continue
        if outcome == "done":  # healed from a peer that had finished
            break
        if isinstance(outcome, int):  # stop with this exit code
            return shutdown(cfg, outcome, metrics=loop.metrics)
        code = after_step(job, loop, outcome, t0)
        if code is not None:
            return code
    finish(job, loop)
    return shutdown(cfg, 0, metrics=loop.metrics)


def train_step(job: Job, loop: Loop):
    """One optimizer step: what it did (a dict), "retry" to redo it with the next quorum, "done", or an exit code."""
    cfg, replicas = job.cfg, job.replicas
    rows = (job.dp_rank, job.dp_size, cfg.grad_accum_for(job.dp_size, job.dims.pp))  # which rows, in how many passes
    if replicas is not None and replicas.refused is not None:  # a replica that must not take part joined:
        print0(f"step {replicas.step + 1:5d}/{cfg.steps} | not run, retried with the next quorum: {replicas.refused}")
        job.optimizer.step()  # the vote only, down: nothing commits, and the newcomer has left
        return "retry"
    if replicas is not None:  # the live replicas split the global batch: this one's rows, by its index now
        loop.step, rows = replicas.step + 1, replica_rows(cfg, job.dp_rank, job.dp_size)
        if replicas.change is not None:
            print0(f"fault tolerance: {replicas.change}")
        if loop.step > cfg.steps:  # healed from a peer that had finished
            return "done"
    # Dropout masks: the same within a TP group (its activations are replicated), different
    # across DP, and a function of the step, so that a resumed run draws the same ones.
    torch.manual_seed(cfg.seed + 1 + rows[0] + 1_000_003 * loop.step)
    lr = get_lr(loop.step, cfg)
    for group in job.optimizer.param_groups:
        group["lr"] = lr
    x, y = job.dataset.get_batch("train", step=loop.step, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                 seq_len=cfg.seq_len, dp_rank=rows[0], dp_size=rows[1])
    x, y = x.to(job.device), y.to(job.device)
    if job.fault is not None:
        job.fault.before_compute(loop.step)
    with job.cp(x, y):  # with CP: this rank's tokens of every row, ring attention
        loss, aux = forward_backward(job, loop, x, y, rows[2])
    params = [p for c in job.chunks for p in c.parameters()]
    pp = [VESCALE_DEVICE_MESH.get_group("PP")] if job.pipe is not None else []  # the whole model's norm: sum the stages
    norm = clip_grad_norm_(params, cfg.grad_clip or float("inf"), groups=pp)
    if replicas is not None:  # the mean over the global batch: over DP here, then across the replicas
        loss = replicas.average_(torch.tensor(dp_mean(loss, job.dp_group)))
    return apply_step(job, loop, loss, aux, norm, lr, rows)


def forward_backward(job: Job, loop: Loop, x: torch.Tensor, y: torch.Tensor, passes: int):
    """The loss of this rank's batch and its gradients: ``passes`` slices without PP (all but the last
    accumulate without DP communication), or micro-batches through torch's schedule (loss on the last stage)."""
    cfg = job.cfg
    skip = job.fault is not None and job.fault.skips_dp(loop.step)  # --inject skip-dp
    if job.pipe is not None:
        with no_dp_sync(job.chunks) if skip else contextlib.nullcontext():
            return job.pipe.step(x, y), 0.0
    loss, aux_total = 0.0, 0.0
    for i, (xs, ys) in enumerate(zip(x.chunk(passes), y.chunk(passes))):
        with gradient_sync(job.model, i == passes - 1 and not skip):
            part = loss_fn(job.model(xs), ys) / passes
            if loop.step == cfg.nan_at_step and loop.restart == 0 and dist.get_rank() == 0:
                part = part * float("nan")  # fault injection: one rank's loss goes bad
            loss = loss + part.detach()
            if cfg.moe_aux_loss_coef:  # the load-balancing loss trains the router; the logged loss omits it
                aux = job.parts[0].aux_loss() / passes
                aux_total = aux_total + aux.detach()
                part = part + cfg.moe_aux_loss_coef * aux
            part.backward()  # after the last, every .grad is averaged over DP
    return loss, aux_total


def apply_step(job: Job, loop: Loop, loss, aux, norm, lr: float, rows):
    """Skip or stop on a non-finite loss or norm (every rank agrees), else step; the step's record."""
    cfg, replicas = job.cfg, job.replicas
    # a nan or inf loss or gradient norm on any rank: every rank skips the step, or stops
    # (and whether torchrun asked any rank to stop: then all stop after this step, saved)
    flags = torch.tensor([float(not torch.isfinite(norm) or (loss is not None and not torch.isfinite(loss))),
                          float(loop.stop.received.is_set())])
    dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad, stopping = bool(flags[0].item()), bool(flags[1].item())
    if replicas is not None and replicas.errored() is not None:
        bad = False  # a failed cross-replica reduce: the replicas' vote drops the step (below), not a skip
    if stopping:
        loop.stop.agreed()
    if bad:
        loop.skipped += 1
        if loop.skipped > cfg.skip_nonfinite:
            print_error(f"step {loop.step}: the loss or the gradient norm is nan or inf; stopping before the "
                        f"optimizer steps (--skip-nonfinite {cfg.skip_nonfinite} allows skipping that many such steps). "
                        f"The checkpoints in {cfg.checkpoint_dir or '(none)'} are untouched.")
            return 1
        print0(f"step {loop.step:5d}/{cfg.steps} | non-finite loss or gradient norm: step skipped "
               f"({loop.skipped} of --skip-nonfinite {cfg.skip_nonfinite})" + (", to be retried" if replicas else ""))
        if replicas is not None:  # every replica saw the same averaged values: all vote the step down
            replicas.discard("non-finite loss or gradient norm")
            job.optimizer.step()  # only the vote: the gradients are dropped and the step retried
        else:
            job.optimizer.zero_grad()  # the weights stay as they were; the step still counts
    else:
        job.optimizer.step()
    if replicas is not None and not job.optimizer.committed:  # not every replica reduced: nothing was applied
        if not bad:
            reason = str(replicas.errored() or "too few replicas").splitlines()[0]
            reason = re.sub(r"^\[[^\]]*\]\s*", "", reason).split(". ")[0]  # gloo's: drop the source path
            print0(f"step {loop.step:5d}/{cfg.steps} | not committed, retried with the next quorum: {reason}")
        return "retry"
    return {"loss": loss, "aux": aux, "norm": norm, "lr": lr, "rows": rows, "bad": bad, "stopping": stopping}


def after_step(job: Job, loop: Loop, done: dict, t0: float) -> int | None:
    """Log, evaluate, write the metrics, save when due; an exit code when the job stops here."""
    cfg, dp_group = job.cfg, job.dp_group
    loss = done["loss"]
    # the mean over the global batch, sent from the last stage to rank 0
    train_loss = to_rank0(None if loss is None else torch.tensor(loss.item() if job.replicas else dp_mean(loss, dp_group)),
                          job.last_pp)
    dt = time.perf_counter() - t0
    record = {"step": loop.step, "loss": train_loss, "lr": done["lr"], "tokens_per_s": cfg.global_batch_size * cfg.seq_len / dt,
              "elapsed_s": time.perf_counter() - loop.t_start, "restart": loop.restart, "skipped": done["bad"],
              "world_size": dist.get_world_size(), "mesh": list(job.dims.mesh_shape), "grad_norm": float(done["norm"]),
              "time": time.time(), "pid": os.getpid()}
    if job.replicas is not None:  # replicas that took part in this step
        record["participants"] = done["rows"][1] // job.dp_size
    if cfg.moe_experts:  # the router's load: token slots per expert of each MoE layer, over the global batch
        record["expert_load"] = take_load(job.parts[0], dp_group)
        if cfg.moe_aux_loss_coef:
            record["aux_loss"] = dp_mean(torch.as_tensor(done["aux"]), dp_group)
    step = loop.step
    if dist.get_rank() == 0 and (step % cfg.log_every == 0 or step == loop.start + 1 or step == cfg.steps):
        print0(f"step {step:5d}/{cfg.steps} | loss {train_loss:.4f} | lr {done['lr']:.2e} | "
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
    return save_when_due(job, loop, train_loss, done["stopping"])


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


@torch.no_grad()
def evaluate(job: Job) -> float | None:
    """Mean loss over ``cfg.eval_batches`` fixed global batches of the held-out split, on global rank 0."""
    cfg = job.cfg
    forward = job.parts[0] if job.pipe is None else job.pipe.forward  # without the DDP wrapper
    for c in job.chunks:
        c.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = job.dataset.get_batch("val", step=i, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                     seq_len=cfg.seq_len, dp_rank=job.dp_rank, dp_size=job.dp_size)
        x, y = x.to(job.device), y.to(job.device)
        with job.cp(x, y):
            logits = forward(x)  # None on a pipeline rank without the last stage
            if logits is not None:
                losses.append(loss_fn(logits, y))
    for c in job.chunks:
        c.train()
    loss = dp_mean(torch.stack(losses).mean(), job.dp_group) if losses else None
    return to_rank0(loss if loss is None else torch.tensor(loss), job.last_pp)


def finish(job: Job, loop: Loop) -> None:
    """After the last step: the memory report, a text sample (whole sequences, outside CP), the time."""
    cfg = job.cfg
    if job.meter is not None:  # each rank's peak and bytes, by PP rank (the planner's rank classes)
        from vemesh.planning.measure import report
        text = report(job.meter, VESCALE_DEVICE_MESH, f"PP rank {VESCALE_DEVICE_MESH.lookup_rank('PP')}"
                      if job.dims.pp > 1 else "every rank", cfg.memory_report)
        print0(f"{text}\nwritten to {cfg.memory_report}")
    if cfg.sample_tokens:  # every rank runs the (sharded) model in lockstep and draws the same tokens
        prompt = encode(SAMPLE_PROMPT).unsqueeze(0).to(job.device)  # (1, T)
        gen = torch.Generator(device=job.device).manual_seed(cfg.seed)
        for c in job.chunks:
            c.eval()
        if job.pipe is None:
            out = job.parts[0].generate(prompt, cfg.sample_tokens, generator=gen)
        else:  # a token at a time through the stages, to the rank of the next stage
            out = generate(job.pipe, prompt, cfg.sample_tokens, cfg.seq_len, generator=gen)
        print0(f"sample after {cfg.steps} steps:\n{'-' * 60}\n{decode(out[0].tolist())}\n{'-' * 60}")
    print0(f"done in {time.perf_counter() - loop.t_start:.1f}s")


def gradient_sync(model: torch.nn.Module, sync: bool) -> contextlib.AbstractContextManager:
    """The context of one backward pass: gradients are averaged over DP only if ``sync``."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2's switch
        model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()
    return contextlib.nullcontext() if sync else model.no_sync()


def shutdown(cfg: TrainConfig, code: int, *, metrics=None, release: bool = True) -> int:
    """Close the metrics file and give the checkpoint directory back; return ``code``."""
    if metrics:
        metrics.close()
    if cfg.checkpoint_dir and release:
        checkpoint.release_lock(cfg.checkpoint_dir)
    return code


def join_replicas(cfg: TrainConfig, grad_dim: str, dp_size: int):
    """Join the live replicas through torchft (this job is one of them) as the mesh's ``dp_replicate`` dim."""
    import logging

    from vemesh.ft import start_replicas

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and vote at INFO
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)  # and warn that gloo has no flight recorder
    replicas = start_replicas(cfg.ft_replica_id, lighthouse=cfg.ft_lighthouse, min_replicas=cfg.ft_min_replicas,
                              device_type=cfg.device, timeout=cfg.ft_timeout_s, admits=batch_split(cfg, dp_size))
    VESCALE_DEVICE_MESH.add_replicas(replicas)
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


def replica_rows(cfg: TrainConfig, dp_rank: int, dp_size: int) -> tuple[int, int, int]:
    """``(row block, blocks, passes)``: this rank's share of the global batch among the replicas of this step."""
    n = VESCALE_DEVICE_MESH.get_strategy_size("dp_replicate")  # replicas taking part now (a count the batch
    index = VESCALE_DEVICE_MESH.lookup_rank("dp_replicate")  # splits over: others are refused at their join)
    blocks = n * dp_size
    rows = cfg.global_batch_size // blocks
    return index * dp_size + dp_rank, blocks, rows // cfg.micro_batch_size if cfg.micro_batch_size else 1


def close_mesh() -> None:
    """Drop the mesh and its cached views, and destroy torch's process groups."""
    if VESCALE_DEVICE_MESH.is_initialized() and VESCALE_DEVICE_MESH.replicas is not None:
        VESCALE_DEVICE_MESH.replicas.shutdown()
    VESCALE_DEVICE_MESH.reset()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    code = main()
    # Leave without tearing the interpreter down, as multiprocessing's children do. A gloo worker
    # thread releases the tensors of a finished collective a moment after the collective completes,
    # which takes the GIL; if the interpreter is already finalizing by then, the thread cannot get it
    # and the process aborts ("terminate called without an active exception", about one run in 15
    # on 2 busy cores). Everything this script owns is closed by now; flush what print() buffered.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
