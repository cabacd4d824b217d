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

What each rank does: every rank builds the same model from the same seed; TP
shards it over ``VESCALE_DEVICE_MESH["TP"]``; DDP averages gradients over
``VESCALE_DEVICE_MESH["DP"]`` during backward; the ZeRO-1 optimizer (a
``torch.optim.Optimizer``) steps 1/DP of the state on each DP rank (or, with
``--fsdp``, torch's FSDP2 shards parameters, gradients and AdamW state over DP). The loop is
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

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from config import ConfigError, TrainConfig
from cp import apply_cp, shard_batch, without_cp
from ep import apply_ep, expert_parameters, sum_counts, take_load
from ep import layout_line as expert_layout_line
from data import VOCAB_SIZE, ByteDataset, decode, encode
from model import GPT, GPTConfig
from pipeline import Pipeline, cut_stage, generate, layout_line, split_layers, stage_indices, stages_per_rank, to_rank0
from stopping import StopRequest
from vemesh import VESCALE_DEVICE_MESH, checkpoint
from vemesh.parallel import ParallelDims
from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.ft import ReplicaError
from vemesh.optim import DistributedOptimizer, clip_grad_norm_

SAMPLE_PROMPT = "def "


def print0(*args, **kwargs) -> None:
    """Print on global rank 0 only (before the process group exists, trust torchrun's RANK)."""
    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0"))
    if rank == 0:
        print(*args, **kwargs, flush=True)


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


@torch.no_grad()
def evaluate(forward, dataset: ByteDataset, cfg: TrainConfig, *, dp_rank: int, dp_size: int, dp_group,
             device, cut=lambda t: t, last_pp: int | None = None) -> float | None:
    """Mean loss over ``cfg.eval_batches`` fixed global batches of the held-out split, on global rank 0.

    ``forward(x)`` returns the logits, or None on a pipeline rank without the last stage; ``cut``
    keeps this CP rank's tokens; ``dp_group`` holds the ranks whose means make the global one.
    """
    losses = []
    for i in range(cfg.eval_batches):
        x, y = map(cut, dataset.get_batch("val", step=i, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                          seq_len=cfg.seq_len, dp_rank=dp_rank, dp_size=dp_size))
        logits = forward(x.to(device))
        if logits is not None:
            losses.append(loss_fn(logits, y.to(device)))
    loss = dp_mean(torch.stack(losses).mean(), dp_group) if losses else None
    return to_rank0(loss if loss is None else torch.tensor(loss), last_pp)


def main(argv: list[str] | None = None) -> int:
    # --------------------------------------------------------------- config
    try:
        cfg = TrainConfig.from_args(argv)
        # ------------------------------------------------------------- data
        dataset = ByteDataset(cfg.data, max_bytes=cfg.max_data_bytes, val_fraction=cfg.val_fraction)
        dataset.check(cfg.seq_len)
    except ConfigError as e:  # bad flags or data: one clear message, no traceback, exit code 2
        print0(f"error: {e}".replace("\n", "\nerror: "), file=sys.stderr)
        return 2
    meter = None
    if cfg.memory_report:  # measured from the first allocation: the mesh, the model, the wrappers, the steps
        from vemesh.planning.measure import RunMeter
        meter = RunMeter()
    try:
        with meter or contextlib.nullcontext():
            code = run(cfg, dataset, meter)
    except ReplicaError as e:  # live fault tolerance cannot go on (no lighthouse, no quorum in time): one line
        print0(f"error: {e}", file=sys.stderr)
        code = 1
    close_mesh()
    return code


def run(cfg: TrainConfig, dataset: ByteDataset, meter=None) -> int:
    """Build the mesh, the model and the optimizer, train, and return the exit code."""
    if meter is not None:  # the corpus is host data that batches are cut from, not this rank's device memory
        meter.exclude(dataset.train, dataset.val)
    # ------------------------------------------------------- device and mesh
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    device_type = cfg.device  # "auto" was resolved to "cuda" or "cpu" by the config
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores among this host's ranks
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world_size))
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[cfg.dtype]

    # The mesh and every dim derived from it (the HSDP split, dp_cp, the EDP x EP fold), by the library's one rule.
    # Every size and rank below comes from the mesh.
    dims = ParallelDims(cfg.world_size, pp=cfg.pp_size,
                        dp_replicate=cfg.dp_replicate if cfg.fsdp else 1,
                        dp_shard=cfg.dp_size // (cfg.dp_replicate if cfg.fsdp else 1), cp=cfg.cp_size, tp=cfg.tp_size,
                        ep=cfg.ep, mesh_dims=cfg.mesh_dim_names)
    dims.build(device_type, VESCALE_DEVICE_MESH, timeout=cfg.timeout_s)
    mesh_shape = list(dims.mesh_shape)  # as launched, for the log and the metrics
    mesh_text = " x ".join(f"{n}={s}" for n, s in zip(VESCALE_DEVICE_MESH.mesh_dim_names, mesh_shape))
    dp_size = VESCALE_DEVICE_MESH.get_strategy_size("DP")  # each DP rank takes its rows of the global batch
    cp_size = VESCALE_DEVICE_MESH.get_strategy_size("CP")  # each CP rank takes its tokens of every row
    # Gradients and losses are averaged over every rank that holds a different part of the batch:
    # DP alone, or DP x CP flattened into one dim (torchtitan's dp_cp) when the sequence is split too.
    grad_dim = dims.grad_dim
    dp_rank = VESCALE_DEVICE_MESH.lookup_rank("DP")
    dp_group = VESCALE_DEVICE_MESH.get_group(grad_dim)
    cp_mesh = VESCALE_DEVICE_MESH["CP"] if cp_size > 1 else None

    def cut(t: torch.Tensor) -> torch.Tensor:  # this CP rank's tokens of a (B, T) batch
        return t if cp_mesh is None else shard_batch(t, cp_mesh, cfg.cp_load_balance)
    tp_size = VESCALE_DEVICE_MESH.get_strategy_size("TP")
    pp_size = VESCALE_DEVICE_MESH.get_strategy_size("PP")
    grad_accum = cfg.grad_accum_for(dp_size, pp_size)

    print0(f"vemesh GPT example: {dist.get_world_size()} processes on {device_type} "
           f"(backend {dist.get_backend()}), mesh {mesh_text}")
    print0(VESCALE_DEVICE_MESH.describe())
    replicas = join_replicas(cfg, device_type, grad_dim) if cfg.ft_replica_id is not None else None

    print0(f"data: {dataset.source}: {len(dataset.train):,} train / {len(dataset.val):,} held-out bytes")

    # ----------------------------------------------------------------- model
    torch.manual_seed(cfg.seed)  # every rank builds the same weights before they are sharded
    model_config = GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                             n_head=cfg.n_head, n_embd=cfg.n_embd, dropout=cfg.dropout,
                             moe_experts=cfg.moe_experts, moe_top_k=cfg.moe_top_k, moe_every=cfg.moe_every)
    # FSDP2 keeps fp32 parameters and computes in bf16 (its MixedPrecisionPolicy), as ZeRO-1 keeps fp32 masters
    model = GPT(model_config).to(device=device, dtype=torch.float32 if cfg.fsdp else dtype)
    model.checkpoint_blocks = cfg.activation_checkpointing
    n_params = model.num_params()
    parts, stages = [model], [0]
    if pp_size > 1:  # this rank's stages: the full model with the other stages' blocks removed
        n_stages = pp_size * stages_per_rank(cfg.pp_schedule)
        stages = stage_indices(VESCALE_DEVICE_MESH.lookup_rank("PP"), pp_size, cfg.pp_schedule)
        parts = [cut_stage(model, s, n_stages) for s in stages]
        del model
    if cfg.ep > 1:  # each EP rank keeps E / EP experts; tokens reach them by all-to-all over mesh["EP"]
        parts = [apply_ep(p, VESCALE_DEVICE_MESH["EP"]) for p in parts]
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, expert_layout_line(VESCALE_DEVICE_MESH, cfg.moe_experts))
        print0(f"expert parallel: EP={cfg.ep} folded over {grad_dim} ({dp_size * cp_size} ranks), EDP="
               f"{dp_size * cp_size // cfg.ep}; {cfg.moe_experts // cfg.ep} of {cfg.moe_experts} experts per rank, "
               f"top-{cfg.moe_top_k}; dense gradients averaged over {grad_dim}, expert gradients over EDP")
        print0("\n".join(lines))
    if cfg.moe_aux_loss_coef and dist.get_world_size(dp_group) > 1:  # the balance loss sees the whole batch's routing
        for p in parts:
            for moe in p.moe_layers():
                moe.count = sum_counts(dp_group)
    if tp_size > 1:
        from tp_plan import apply_tp  # torch's tensor-parallel styles: imported only when there is a TP dim
        parts = [apply_tp(p, VESCALE_DEVICE_MESH["TP"], sequence_parallel=cfg.sequence_parallel) for p in parts]
    if cp_mesh is not None:  # ring attention over mesh["CP"], global positions
        parts = [apply_cp(p, cp_mesh, cfg.seq_len, cfg.cp_load_balance) for p in parts]
        mine = cut(torch.arange(cfg.seq_len).unsqueeze(0))[0].tolist()
        runs = [(p, q) for p, q in zip([mine[0]] + [b for a, b in zip(mine, mine[1:]) if b != a + 1],
                                       [a for a, b in zip(mine, mine[1:]) if b != a + 1] + [mine[-1]])]
        print0(f"context parallel: CP={cp_size} over mesh[\"CP\"], ring attention; each rank holds "
               f"{cfg.seq_len // cp_size} of {cfg.seq_len} tokens per sequence "
               + ("(head-tail load balancing: 2 chunks)" if cfg.cp_load_balance else "(one contiguous slice)")
               + f"; rank 0 (CP rank {VESCALE_DEVICE_MESH.lookup_rank('CP')}) holds positions "
               + ", ".join(f"{p}..{q}" for p, q in runs)
               + f"; gradients averaged over {grad_dim} = DP x CP ({dp_size * cp_size} ranks)")
    raw_model = parts[0]  # for eval and generation without PP, without the DDP wrapper
    if cfg.fsdp:  # torch's FSDP2 on the DP (x CP) view, 2-D for HSDP: each block, then the rest
        shard_mesh = VESCALE_DEVICE_MESH[dims.fsdp_dims]  # HSDP: (dp_replicate, dp_shard[_cp]); else grad_dim
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        chunks = []
        for part in parts:  # with PP, each stage of this rank is sharded on its own (torchtitan's way)
            for block in part.h.values():
                if cfg.ep > 1 and hasattr(block.mlp, "experts"):  # experts shard over EDP, summed there, / DP x CP
                    fully_shard(block.mlp.experts, mesh=VESCALE_DEVICE_MESH["EDP"], mp_policy=mp)
                    block.mlp.experts.set_gradient_divide_factor(float(dp_size * cp_size))
                    if dp_size * cp_size > cfg.ep:  # EDP > 1: sum, then divide (gloo has no PREMUL_SUM); on one
                        block.mlp.experts.set_force_sum_reduction_for_comms(True)  # rank torch 2.13 would divide twice
                fully_shard(block, mesh=shard_mesh, mp_policy=mp)
            chunks.append(fully_shard(part, mesh=shard_mesh, mp_policy=mp))
    else:
        chunks = []
        for p in parts:  # with EP, experts average over EDP (the ranks that hold the same ones)
            experts = dict(expert_data_parallel=VESCALE_DEVICE_MESH["EDP"], expert_parameters=expert_parameters(p)) \
                if cfg.ep > 1 else {}
            chunks.append(DDP(p, VESCALE_DEVICE_MESH[grad_dim], overlap_grad_reduce=cfg.overlap_grad_reduce,
                              replicas=replicas, **experts))
    model = chunks[0] if pp_size == 1 else chunks
    # the experts as they are now (TP and FSDP2 replace parameters), for the gradient norm
    expert_norm = dict(expert_parameters=[q for p in parts for q in expert_parameters(p)],
                       expert_groups=[VESCALE_DEVICE_MESH.get_group("EP")]) if cfg.ep > 1 else {}
    print0(f"model: {n_params:,} parameters, n_layer={cfg.n_layer} n_head={cfg.n_head} "
           f"n_embd={cfg.n_embd} seq_len={cfg.seq_len} dtype={cfg.dtype}"
           + (f" moe_experts={cfg.moe_experts} top_k={cfg.moe_top_k}" if cfg.moe_experts else "")
           + (" sequence-parallel" if cfg.sequence_parallel and tp_size > 1 else "")
           + (" activation-checkpointing" if cfg.activation_checkpointing else ""))
    pipe, last_pp = None, None  # last_pp: the PP rank holding the last stage (and the loss)
    if pp_size > 1:  # every rank's place in the pipeline, found through the mesh, printed by rank 0
        lines = [None] * dist.get_world_size()
        dist.all_gather_object(lines, layout_line(stages, cfg.pp_schedule))
        print0("\n".join(lines))
        layers = split_layers(cfg.n_layer, n_stages)
        pipe = Pipeline(chunks, stages, n_stages, cfg.pp_schedule, cfg.microbatches, loss_fn, device)
        last_pp = pipe.last_pp
        print0(f"pipeline: {cfg.pp_schedule}, {n_stages} stages over PP={pp_size} (blocks per stage "
               f"{[len(b) for b in layers]}), {cfg.microbatches} micro-batches of "
               f"{cfg.global_batch_size // dp_size // cfg.microbatches} sequences per DP rank")

    # ------------------------------------------------------------- optimizer
    adamw = dict(lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
    params = [p for c in chunks for p in c.parameters()]
    if cfg.distributed_optimizer and not cfg.fsdp:  # a torch.optim.Optimizer whose AdamW state is split over DP
        optimizer = DistributedOptimizer(torch.optim.AdamW, models=chunks, **adamw)
        kind = "ZeRO-1 DistributedOptimizer"
        if replicas is not None:  # what a returning replica takes from a live one (each rank its own shards)
            replicas.track(model, optimizer)
    else:  # with FSDP2 the parameters are shards already, and so is AdamW's state
        optimizer = torch.optim.AdamW(params, **adamw)
        kind = "AdamW"
        if cfg.fsdp:
            kind += " on FSDP2 shards" + (f" (HSDP, {cfg.dp_replicate} replicas)" if cfg.dp_replicate > 1 else "")
    print0(f"optimizer: {kind}, "
           f"global batch {cfg.global_batch_size} x {cfg.seq_len} tokens, "
           f"{cfg.global_batch_size // dp_size} sequences per DP rank"
           + (f" in {grad_accum} passes" if grad_accum > 1 else "") + f", {cfg.steps} steps")

    # ---------------------------------------------------------------- resume
    start_step = 0  # optimizer steps already done (0: a fresh run)
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun's attempt, from 0
    if cfg.checkpoint_dir:
        try:  # one job per directory (a restart of this job takes its lock back); every rank gets the same answer
            checkpoint.acquire_lock(cfg.checkpoint_dir)
            resumed = checkpoint.load_latest(cfg.checkpoint_dir, model=model, optimizer=optimizer)
        except checkpoint.CheckpointError as e:
            print0(f"error: cannot resume: {e}".replace("\n", "\nerror: "), file=sys.stderr)
            return shutdown(cfg, 1, release=not isinstance(e, checkpoint.CheckpointLockedError))
        if resumed is None:
            print0(f"checkpoints: none in {cfg.checkpoint_dir} yet; starting at step 1")
        else:
            start_step = resumed[0]
            if replicas is not None:  # torchft counts committed steps; a peer that is behind heals from this one
                replicas.manager.load_state_dict({"step": start_step, "batches_committed": 0})
            print0(f"resumed from {checkpoint.checkpoint_path(cfg.checkpoint_dir, start_step)} (saved on mesh "
                   f"{resumed[1].get('mesh')}, restart {restart}): continuing at step {start_step + 1}")
    metrics = None
    if cfg.metrics_file and dist.get_rank() == 0:  # keep the rows of the steps before the checkpoint, drop the rest
        rows = []
        if start_step > 0 and os.path.exists(cfg.metrics_file):
            with open(cfg.metrics_file) as f:
                rows = [json.loads(line) for line in f if line.strip()]
        kept = [r for r in rows if r.get("step", 0) <= start_step]
        if start_step > 0 and rows:  # a restart (torchrun's, or an elastic change of world): say what changed
            before = rows[-1]
            print0(f"reconfigured: mesh {before.get('mesh')} ({before.get('world_size')} processes) -> "
                   f"{mesh_shape} ({dist.get_world_size()} processes); resumed step {start_step}; "
                   f"steps redone: {len(rows) - len(kept)}")
        metrics = open(cfg.metrics_file, "w")
        metrics.writelines(json.dumps(r) + "\n" for r in kept)

    # ------------------------------------------------------------- training
    stop = StopRequest(cfg.stop_grace_s, enabled=bool(cfg.checkpoint_dir))  # SIGTERM: save, then stop
    tokens_per_step = cfg.global_batch_size * cfg.seq_len
    t_start = time.perf_counter()
    skipped = 0  # steps skipped for a non-finite loss or gradient norm
    last_save = time.monotonic()
    step = start_step
    while step < cfg.steps:
        step += 1
        if step == cfg.fail_at_step and restart == 0 and dist.get_rank() == dist.get_world_size() - 1:
            print(f"rank {dist.get_rank()}: --fail-at-step {step}: exiting to simulate a crashed worker",
                  file=sys.stderr, flush=True)
            os._exit(13)
        t0 = time.perf_counter()
        if meter is not None:  # --memory-report: count the collectives of the step, from zero_grad to step
            meter.begin_step()
        optimizer.zero_grad()  # with --ft-replica-id, first this step's quorum: a replica that is behind heals here
        rows = (dp_rank, dp_size, grad_accum)  # which rows of the global batch this rank takes, in how many passes
        if replicas is not None and replicas.refused is not None:  # a replica that must not take part joined:
            print0(f"step {replicas.step + 1:5d}/{cfg.steps} | not run, retried with the next quorum: {replicas.refused}")
            optimizer.step()  # the vote only, down: nothing commits, and the newcomer has left
            step -= 1
            continue
        if replicas is not None:  # the live replicas split the global batch: this one's rows, by its index now
            step, rows = replicas.step + 1, replica_rows(cfg, dp_rank, dp_size)
            if replicas.change is not None:
                print0(f"fault tolerance: {replicas.change}")
            if step > cfg.steps:  # healed from a peer that had finished
                break
        # Dropout masks: the same within a TP group (its activations are replicated), different
        # across DP, and a function of the step, so that a resumed run draws the same ones.
        torch.manual_seed(cfg.seed + 1 + rows[0] + 1_000_003 * step)
        lr = get_lr(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        x, y = dataset.get_batch("train", step=step, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                 seq_len=cfg.seq_len, dp_rank=rows[0], dp_size=rows[1])
        x, y = cut(x).to(device), cut(y).to(device)

        if pipe is None:
            # grad_accum passes over equal slices; all but the last accumulate without DP communication
            passes = list(zip(x.chunk(rows[2]), y.chunk(rows[2])))
            loss, aux_total = 0.0, 0.0
            for i, (xs, ys) in enumerate(passes):
                with gradient_sync(model, i == len(passes) - 1):
                    part = loss_fn(model(xs), ys) / len(passes)
                    if step == cfg.nan_at_step and restart == 0 and dist.get_rank() == 0:
                        part = part * float("nan")  # fault injection: one rank's loss goes bad
                    loss = loss + part.detach()
                    if cfg.moe_aux_loss_coef:  # the load-balancing loss trains the router; the logged loss omits it
                        aux = raw_model.aux_loss() / len(passes)
                        aux_total = aux_total + aux.detach()
                        part = part + cfg.moe_aux_loss_coef * aux
                    part.backward()  # after the last, every .grad is averaged over DP
            # the global norm, TP shards included (clipping only with --grad-clip); with EP each rank holds
            # other experts, and vemesh's clip sums their part over the EP group (torch's would not)
            norm = clip_grad_norm_(params, cfg.grad_clip or float("inf"), **expert_norm)
        else:
            loss = pipe.step(x, y)  # micro-batches through torch's schedule; the loss on the last stage only
            # the norm of the whole model: torch's per stage, summed over PP
            norm = clip_grad_norm_(params, cfg.grad_clip or float("inf"), groups=[VESCALE_DEVICE_MESH["PP"].get_group()])
        if replicas is not None:  # the mean over the global batch: over DP here, then across the replicas
            loss = replicas.average_(torch.tensor(dp_mean(loss, dp_group)))
        # a nan or inf loss or gradient norm on any rank: every rank skips the step, or stops
        # (and whether torchrun asked any rank to stop: then all stop after this step, saved)
        flags = torch.tensor([float(not torch.isfinite(norm) or (loss is not None and not torch.isfinite(loss))),
                              float(stop.received.is_set())])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        bad, stopping = bool(flags[0].item()), bool(flags[1].item())
        if replicas is not None and replicas.errored() is not None:
            bad = False  # a failed cross-replica reduce: the replicas' vote drops the step (below), not a skip
        if stopping:
            stop.agreed()
        if bad:
            skipped += 1
            if skipped > cfg.skip_nonfinite:
                print0(f"error: step {step}: the loss or the gradient norm is nan or inf; stopping before the "
                       f"optimizer steps (--skip-nonfinite {cfg.skip_nonfinite} allows skipping that many such steps). "
                       f"The checkpoints in {cfg.checkpoint_dir or '(none)'} are untouched.", file=sys.stderr)
                return shutdown(cfg, 1, metrics=metrics)
            print0(f"step {step:5d}/{cfg.steps} | non-finite loss or gradient norm: step skipped "
                   f"({skipped} of --skip-nonfinite {cfg.skip_nonfinite})" + (", to be retried" if replicas else ""))
            if replicas is not None:  # every replica saw the same averaged values: all vote the step down
                replicas.discard("non-finite loss or gradient norm")
                optimizer.step()  # only the vote: the gradients are dropped and the step retried
            else:
                optimizer.zero_grad()  # the weights stay as they were; the step still counts
        else:
            optimizer.step()
        if meter is not None:
            meter.end_step()
        if replicas is not None and not optimizer.committed:  # not every replica reduced: nothing was applied
            if not bad:
                reason = str(replicas.errored() or "too few replicas").splitlines()[0]
                reason = re.sub(r"^\[[^\]]*\]\s*", "", reason).split(". ")[0]  # gloo's: drop the source path
                print0(f"step {step:5d}/{cfg.steps} | not committed, retried with the next quorum: {reason}")
            step -= 1
            continue

        # the mean over the global batch, sent from the last stage to rank 0
        train_loss = to_rank0(None if loss is None else torch.tensor(loss.item() if replicas else dp_mean(loss, dp_group)),
                              last_pp)
        dt = time.perf_counter() - t0
        record = {"step": step, "loss": train_loss, "lr": lr, "tokens_per_s": tokens_per_step / dt,
                  "elapsed_s": time.perf_counter() - t_start, "restart": restart, "skipped": bad,
                  "world_size": dist.get_world_size(), "mesh": mesh_shape, "grad_norm": float(norm),
                  "time": time.time(), "pid": os.getpid()}
        if replicas is not None:  # replicas that took part in this step
            record["participants"] = rows[1] // dp_size
        if cfg.moe_experts:  # the router's load: token slots per expert of each MoE layer, over the global batch
            record["expert_load"] = take_load(raw_model, dp_group)
            if cfg.moe_aux_loss_coef:
                record["aux_loss"] = dp_mean(torch.as_tensor(aux_total), dp_group)
        rank0 = dist.get_rank() == 0  # the losses arrive on rank 0 only
        if rank0 and (step % cfg.log_every == 0 or step == start_step + 1 or step == cfg.steps):
            print0(f"step {step:5d}/{cfg.steps} | loss {train_loss:.4f} | lr {lr:.2e} | "
                   f"{record['tokens_per_s']:8.0f} tok/s | {record['elapsed_s']:6.1f}s")
        if (cfg.eval_every and step % cfg.eval_every == 0) or step == cfg.steps:
            for c in chunks:
                c.eval()
            record["eval_loss"] = evaluate(raw_model if pipe is None else pipe.forward, dataset, cfg,
                                           dp_rank=dp_rank, dp_size=dp_size, dp_group=dp_group, device=device, cut=cut,
                                           last_pp=last_pp)
            for c in chunks:
                c.train()
            if rank0:
                print0(f"step {step:5d}/{cfg.steps} | eval loss {record['eval_loss']:.4f} (held-out)")
        if metrics:
            metrics.write(json.dumps(record) + "\n")
            metrics.flush()
        due = cfg.checkpoint_dir and (step == cfg.steps or (cfg.checkpoint_every and step % cfg.checkpoint_every == 0))
        if cfg.checkpoint_interval_s and not due and not stopping:  # rank 0's clock decides for everyone
            late = torch.tensor(float(time.monotonic() - last_save >= cfg.checkpoint_interval_s))
            dist.broadcast(late, src=0)
            due = bool(late.item())
        if due or (stopping and cfg.checkpoint_dir):
            last_save = time.monotonic()
            t_save = time.perf_counter()
            path = checkpoint.save(cfg.checkpoint_dir, model=model, optimizer=optimizer, step=step,
                                   extra={"loss": train_loss, "mesh": mesh_shape},
                                   keep_last=cfg.keep_checkpoints)
            print0(f"step {step:5d}/{cfg.steps} | saved {path} ({time.perf_counter() - t_save:.2f}s)")
        if stopping and step < cfg.steps:
            print0(f"step {step:5d}/{cfg.steps} | stopping: torchrun sent SIGTERM (a node joined, or the job is "
                   f"being stopped); step {step} is saved, so a restart redoes nothing")
            if not stop.received.is_set() and not stop.wait(cfg.timeout_s):  # its agent had not asked it yet
                print(f"rank {dist.get_rank()}: other ranks were stopped by torchrun, but this one got no SIGTERM "
                      f"within --timeout-s {cfg.timeout_s:g}; exiting", file=sys.stderr, flush=True)
                return shutdown(cfg, 1, metrics=metrics)
            return shutdown(cfg, 0, metrics=metrics)

    if meter is not None:  # each rank's peak and bytes, by PP rank (the planner's rank classes)
        from vemesh.planning.measure import report
        text = report(meter, VESCALE_DEVICE_MESH, f"PP rank {VESCALE_DEVICE_MESH.lookup_rank('PP')}" if pp_size > 1
                      else "every rank", cfg.memory_report)
        print0(f"{text}\nwritten to {cfg.memory_report}")

    # --------------------------------------------------------------- sample
    if cfg.sample_tokens:
        # Every rank runs the (sharded) model in lockstep and draws the same tokens; rank 0 prints.
        prompt = encode(SAMPLE_PROMPT).unsqueeze(0).to(device)  # (1, T)
        gen = torch.Generator(device=device).manual_seed(cfg.seed)
        for c in chunks:
            c.eval()
        if pipe is None:
            with without_cp(raw_model):  # whole sequences: every CP rank holds every weight of its TP shard
                out = raw_model.generate(prompt, cfg.sample_tokens, generator=gen)
        else:  # a token at a time through the stages, to the rank of the next stage
            with contextlib.ExitStack() as whole:
                for part in parts:
                    whole.enter_context(without_cp(part))
                out = generate(pipe, prompt, cfg.sample_tokens, cfg.seq_len, generator=gen)
        print0(f"sample after {cfg.steps} steps:\n{'-' * 60}\n{decode(out[0].tolist())}\n{'-' * 60}")

    print0(f"done in {time.perf_counter() - t_start:.1f}s")
    return shutdown(cfg, 0, metrics=metrics)


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


def join_replicas(cfg: TrainConfig, device_type: str, grad_dim: str):
    """Join the live replicas through torchft (this job is one of them) as the mesh's ``dp_replicate`` dim."""
    import logging

    from vemesh.ft import start_replicas

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's servers log every quorum and vote at INFO
    logging.getLogger("torchft.manager").setLevel(logging.ERROR)  # and warn that gloo has no flight recorder
    replicas = start_replicas(cfg.ft_replica_id, lighthouse=cfg.ft_lighthouse, min_replicas=cfg.ft_min_replicas,
                              device_type=device_type, timeout=cfg.ft_timeout_s,
                              admits=batch_split(cfg, VESCALE_DEVICE_MESH.get_strategy_size("DP")))
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
