"""The GPT example's job: the mesh (``ParallelDims``), the model as ``vemesh.models.gpt.parallelize`` wraps it, the
optimizer, and the helpers every part of the loop uses (``print0``, the loss, the DP mean).

Each function here runs once at start-up, on every rank, in the order ``train.run`` calls them.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import warnings
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._functorch import config as functorch_config
from torch.distributed.fsdp import MixedPrecisionPolicy

from config import TrainConfig
from data import VOCAB_SIZE, ByteDataset
from faults import Faults
from moe import experts_line, sum_counts
from pipeline import Pipeline, layout_line
from stopping import StopRequest
from vemesh import VESCALE_DEVICE_MESH
from vemesh.models.gpt import GPT, GPTConfig, cut_stage, parallelize, split_layers, stage_indices, stages_per_rank
from vemesh.optim import DistributedOptimizer
from vemesh.parallel import ParallelDims, context_parallel
from vemesh.parallel.context import positions
from vemesh.parallel.schedules import ZERO_BUBBLE


def print0(*args, **kwargs) -> None:
    """Print on global rank 0 only (before the process group exists, trust torchrun's RANK)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(*args, **kwargs, flush=True)


def print_error(message: str) -> None:
    """An error, on every rank's stderr: whichever rank exits first, torchrun kills the others, so a message
    left to rank 0 alone could vanish behind torchrun's banner."""
    print("error: " + message.replace("\n", "\nerror: "), file=sys.stderr, flush=True)


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every token of this rank's batch, computed in fp32."""
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


def dp_mean(value: torch.Tensor, dp_group: dist.ProcessGroup) -> float:
    """The mean of a scalar over the DP ranks (every DP rank holds an equal share of the batch)."""
    if dist.get_world_size(dp_group) == 1:  # no other rank holds a share (the planner's GPT preset skips it too)
        return value.item()
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
    faults: Faults | None = None  # --inject, --fail-at-step, --nan-at-step (faults.py)

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


@dataclass
class Step:
    """What one optimizer step did, whatever happened to it (the loop reads one type)."""

    loss: Any = None  # this rank's loss (a tensor); None on a pipeline rank without the last stage
    aux: Any = 0.0  # the MoE load-balancing loss (not in the logged loss)
    norm: Any = None  # the gradient norm before clipping
    lr: float = 0.0
    rows: tuple[int, int, int] = (0, 1, 1)  # (row block, blocks, passes) of the global batch
    mean_loss: float | None = None  # the global batch's mean loss, when the step already has it (live replicas)
    extra: dict = field(default_factory=dict)  # more fields for the metrics row
    skipped: bool = False  # a non-finite loss or norm on some rank: nothing applied, the step counts
    stopping: bool = False  # torchrun asked some rank to stop: all stop after this step, saved
    retry: bool = False  # nothing applied, and the step is redone (live replicas: not every one reduced)
    finished: bool = False  # healed from a peer past the last step (live replicas)
    exit_code: int | None = None  # stop the job with this code


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
    dims = cfg.dims
    if cfg.straggler_every:  # the summaries read torch's Flight Recorder: on before the first collective
        os.environ.setdefault("TORCH_FR_BUFFER_SIZE", "20000")
    dims.build(cfg.device, VESCALE_DEVICE_MESH, timeout=cfg.timeout_s)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]
    job = Job(cfg, dataset, dims, device, dtype, meter)
    job.faults = Faults.of(cfg)
    mesh_text = " x ".join(f"{n}={s}" for n, s in zip(dims.mesh_dims, dims.mesh_shape))
    print0(f"vemesh GPT example: {dist.get_world_size()} processes on {cfg.device} "
           f"(backend {dist.get_backend()}), mesh {mesh_text}")
    print0(VESCALE_DEVICE_MESH.describe())
    if cfg.fsdp and dims.tp > 1 and dims.fsdp_dims:  # FSDP2's gradients are sharded over its dims and TP: a norm of
        # them (clip_grad_norm_) reduces over both, which DTensor does in one all-reduce where the two are flattened
        shard = dims.fsdp_dims[-1]  # (torch's advice; without, two, and a warning on every rank)
        VESCALE_DEVICE_MESH.flatten((shard, "TP"), f"{shard}_tp")
    if cfg.ft_replica_id is not None:  # live fault tolerance: this job is one replica of a torchft quorum
        from live_ft import join_replicas  # torchft is an optional extra: imported only when asked for
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
    if cfg.compile and cfg.pp_schedule in ZERO_BUBBLE and dims.pp > 1:  # their split backward keeps the graph for
        # the weight pass, which a compiled backward that reuses its inputs' buffers refuses (torch's own switch)
        functorch_config.donated_buffer = False
    job.chunks = [parallelize(p, VESCALE_DEVICE_MESH, sequence_parallel=cfg.sequence_parallel,
                              activation_checkpointing=cfg.activation_checkpointing, compile=cfg.compile, **wrap)
                  for p in job.parts]
    job.model = job.chunks[0] if dims.pp == 1 else job.chunks
    if cfg.fsdp and dims.tp > 1:  # the logits are TP's all-gathered output, which torch hands back as a view of it;
        # FSDP2's root warns that an in-place op on such a view would skip its hook. loss_fn and the sampler only read
        # them (out of place), and a copy would hold the logits twice
        warnings.filterwarnings("ignore", message=r"FSDP2-wrapped module \(\w+\) returned a view tensor")
    print0(f"model: {n_params:,} parameters, n_layer={cfg.n_layer} n_head={cfg.n_head} "
           f"n_embd={cfg.n_embd} seq_len={cfg.seq_len} dtype={cfg.dtype}"
           + (f" moe_experts={cfg.moe_experts} top_k={cfg.moe_top_k}" if cfg.moe_experts else "")
           + (" sequence-parallel" if cfg.sequence_parallel and dims.tp > 1 else "")
           + (" activation-checkpointing" if cfg.activation_checkpointing else "")
           + (" compiled" if cfg.compile else ""))
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


