"""The GPT example's configuration: one pydantic model, validated once, overridable from the command line.

Every field is a flag: ``n_layer`` is ``--n-layer``, booleans come in pairs
(``--distributed-optimizer`` / ``--no-distributed-optimizer``). Nonsense fails
here, before any process group exists, with a message that names the flag::

    $ torchrun --nproc_per_node=3 examples/gpt/train.py --mesh-shape 1,3
    error: --mesh-shape: TP size 3 does not divide --n-head 4 (choose TP from 1, 2, 4)
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator, model_validator

from vemesh.layout import fill_sizes
from vemesh.layout.names import divisors as all_divisors
from vemesh.layout.names import listed
from vemesh.parallel import ParallelDims


class ConfigError(ValueError):
    """A bad configuration; ``str()`` is a user-facing message, one problem per line."""


def _world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


#: The dims --mesh-dims may name, and the names a plain --mesh-shape gets by its length.
MESH_DIMS = ("PP", "DP", "CP", "TP")
DEFAULT_MESH_DIMS = {2: ("DP", "TP"), 3: ("PP", "DP", "TP")}


class TrainConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    # the mesh's degrees and every dim they derive: the library's ParallelDims, asked, never re-derived here
    _dims: ParallelDims | None = PrivateAttr(default=None)

    # ---- parallelism
    mesh_shape: tuple[int, ...] | None = Field(
        None,
        description="DP,TP sizes (e.g. 2,2 or -1,2; -1 takes the rest of the world), or PP,DP,TP for a 3-D "
        "mesh with pipeline stages (e.g. 2,2,2), or one size per --mesh-dims name. Default: TP=2 when the world "
        "size is even, else TP=1; DP takes the rest.",
    )
    mesh_dims: tuple[str, ...] | None = Field(
        None,
        description="the mesh's dim names, outermost first, from PP, DP, CP, TP in any order (the placement vemesh plan "
        "--devices-per-host chooses; e.g. DP,CP,TP with --mesh-shape "
        "2,2,2); default DP,TP for two sizes and PP,DP,TP for three",
    )
    cp_load_balance: bool = Field(
        True, description="with CP: torch's head-tail sharding (rank r holds chunks r and 2CP-1-r of each sequence), "
        "which evens out the causal work; off: one contiguous slice per rank"
    )
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev"] = Field(
        "1f1b", description="torch.distributed.pipelining schedule (interleaved-1f1b, interleaved-zb: 2 stages per PP "
        "rank, round-robin; zbv, dualpipev: 2 stages per PP rank in a V, the last stage on PP rank 0)"
    )
    microbatches: int | None = Field(None, ge=1, description="micro-batches per step with PP > 1 (default: 2 x PP)")
    distributed_optimizer: bool = Field(True, description="ZeRO-1 vemesh.optim.DistributedOptimizer (else plain AdamW)")
    fsdp: bool = Field(
        False, description="torch's FSDP2 (fully_shard) over DP (x CP) instead of vemesh DDP + ZeRO-1: parameters, "
        "gradients and AdamW state sharded, each pipeline stage on its own; HSDP with --dp-replicate"
    )
    dp_replicate: int = Field(
        1, ge=1, description="with --fsdp: split DP into dp_replicate x dp_shard (HSDP: shards within a dp_shard "
        "group, replicas across dp_replicate)"
    )
    ep: int = Field(
        1, ge=1, description="expert parallelism with --moe-experts: each rank of an EP group holds 1/EP of the "
        "experts, tokens travel to them by all-to-all. EP folds over the DP (x CP) ranks (it must divide DP x CP); "
        "experts are averaged over the EDP = DP x CP / EP ranks that hold the same ones"
    )
    overlap_grad_reduce: bool = Field(True, description="start each gradient bucket's all-reduce during backward")
    sequence_parallel: bool = Field(False, description="shard activations along the sequence between TP regions")
    activation_checkpointing: bool = Field(False, description="keep only each block's input for backward and "
                                           "recompute the block there (torch.utils.checkpoint)")
    compile: bool = Field(False, description="torch.compile each block in place (fullgraph; with CP, a graph "
                          "break at the attention, whose ring runs eagerly), before FSDP2 or DDP wrap it")
    timeout_s: float = Field(600.0, gt=0, description="seconds a rank waits for the others, at start-up and in every collective")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda if available, else cpu (resolved here)")
    dtype: Literal["fp32", "bf16"] = Field("fp32", description="parameter and activation dtype")
    world_size: int = Field(default_factory=_world_size, ge=1, description="from torchrun's WORLD_SIZE; not a flag")

    # ---- data
    data: str | None = Field(None, description="a text file to train on (default: the Python standard library sources)")
    max_data_bytes: int = Field(2_000_000, gt=0, description="read at most this many bytes of the corpus")
    val_fraction: float = Field(0.1, gt=0.0, lt=1.0, description="held-out share of the corpus (its tail)")

    # ---- model
    n_layer: int = Field(2, ge=1)
    n_head: int = Field(4, ge=1)
    n_embd: int = Field(192, ge=1)
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    seq_len: int = Field(64, ge=2, description="tokens per sequence (also the model's block size)")
    moe_experts: int = Field(0, ge=0, description="mixture of experts: replace the MLP with this many experts and a "
                             "router (0: dense MLPs)")
    moe_top_k: int = Field(2, ge=1, description="with --moe-experts: experts per token (top-k softmax router)")
    moe_every: int = Field(1, ge=1, description="with --moe-experts: blocks 0, N, 2N, ... get the MoE, the others "
                           "keep their MLP")
    moe_aux_loss_coef: float = Field(0.0, ge=0.0, description="with --moe-experts: weight of the load-balancing "
                                     "loss (Switch Transformer's), added to the training loss (0: off)")

    # ---- optimization
    steps: int = Field(200, ge=1)
    global_batch_size: int = Field(32, ge=1, description="sequences per step, summed over DP ranks")
    micro_batch_size: int | None = Field(
        None, ge=1, description="sequences per forward on each DP rank; the DP rank's share of the global batch is "
        "run in global_batch_size / DP / this passes, gradients accumulated (default: all at once)"
    )
    gradient_sync: Literal["last", "each"] = Field(
        "last", description="with --micro-batch-size: which passes' backward averages the gradients over DP: the last "
        "(DDP's no_sync, FSDP2's set_requires_gradient_sync(False) on the others; FSDP2 then holds every unsharded "
        "gradient until it) or each (torchtitan's loop: FSDP2 reduce-scatters every pass, holding its shards)"
    )
    lr: float = Field(2e-3, gt=0.0, description="peak learning rate")
    min_lr: float = Field(2e-4, ge=0.0, description="learning rate at the end of the cosine decay")
    warmup_steps: int = Field(10, ge=0)
    weight_decay: float = Field(0.0, ge=0.0)
    grad_clip: float = Field(1.0, ge=0.0, description="clip the global gradient norm to this (0: off)")
    skip_nonfinite: int = Field(
        0, ge=0, description="skip up to N steps whose loss or gradient norm is nan/inf, then stop (0: stop at the first)"
    )
    seed: int = Field(1337, ge=0)

    # ---- output
    log_every: int = Field(10, ge=1, description="print a training line every N steps")
    eval_every: int = Field(50, ge=0, description="evaluate on the held-out split every N steps (0: only at the end)")
    eval_batches: int = Field(4, ge=1, description="global batches per evaluation")
    sample_tokens: int = Field(160, ge=0, description="length of the text sample generated at the end (0: none)")
    metrics_file: str | None = Field(None, description="write JSON lines (step, loss, tokens_per_s, ...) here")
    memory_report: str | None = Field(
        None, description="measure each rank's peak memory (torch's MemTracker) and the bytes of its collectives per "
        "mesh dim over the run, print them per rank class and write them to this JSON file (slow: for short runs)"
    )

    # ---- checkpoints and fault tolerance
    checkpoint_dir: str | None = Field(
        None, description="save checkpoints here, and resume from the latest good one found here at start"
    )
    checkpoint_every: int = Field(0, ge=0, description="save every N steps (0: only after the last step)")
    checkpoint_interval_s: float | None = Field(
        None, gt=0, description="also save when this many seconds have passed since the last save (rank 0's clock)"
    )
    keep_checkpoints: int = Field(3, ge=1, description="keep the newest N checkpoints")
    stop_grace_s: float = Field(
        15.0, ge=0, description="with --checkpoint-dir: on SIGTERM (torchrun stopping the workers, e.g. a node joined) "
        "save at the next step boundary if it comes within this many seconds, and exit (0: exit at once, unsaved)"
    )
    fail_at_step: int | None = Field(
        None, ge=1, description="fault injection: the last rank exits at the start of step K, on torchrun's first attempt only"
    )
    nan_at_step: int | None = Field(None, ge=1, description="fault injection: the loss of step K is nan on one rank")
    inject: str | None = Field(
        None, description="fault injection, to see the hang report of VEMESH_HANG_DIR once: sleep:R:S (rank R sleeps in "
        "compute at step S), skip-dp:R:S (skips its DP gradient average), wrong-size-tp:R:S (enters a TP all-reduce with "
        "the wrong size), slow:R:S:MS (sleeps MS ms every step from S: a straggler)"
    )
    straggler_every: int = Field(
        0, ge=0, description="every N steps, print per mesh dim which rank was last into its collectives, and by how "
        "much (torch's Flight Recorder; 0: never)"
    )

    # ---- live fault tolerance (torchft)
    ft_replica_id: int | None = Field(
        None, ge=0, description="live fault tolerance: this job (one torchrun) is replica I of several; torchft's "
        "lighthouse forms a quorum of the live replicas every step, gradients average across them, a lost replica "
        "costs no restart and a returning one heals from a live peer (needs torchft: pip install 'vemesh[ft]')"
    )
    ft_lighthouse: str | None = Field(
        None, description="with --ft-replica-id: the torchft lighthouse, http://HOST:29510 (default: $TORCHFT_LIGHTHOUSE)"
    )
    ft_min_replicas: int = Field(1, ge=1, description="with --ft-replica-id: the fewest replicas a step commits with")
    ft_timeout_s: float = Field(
        30.0, gt=0, description="with --ft-replica-id: seconds a quorum, a cross-replica reduce or a heal may take "
        "before the step is dropped (a quorum that never forms stops the run)"
    )

    @field_validator("mesh_shape", mode="before")
    @classmethod
    def _parse_mesh_shape(cls, v: Any) -> Any:
        if isinstance(v, str):
            parts = [p.strip() for p in v.split(",")]
            if not 1 <= len(parts) <= 4 or not all(p.lstrip("-").isdigit() for p in parts):
                raise ValueError(f"expected DP,TP like 2,2 or -1,2, PP,DP,TP like 2,2,1, or one size per --mesh-dims "
                                 f"name; got {v!r}")
            return tuple(int(p) for p in parts)
        return v

    @field_validator("mesh_dims", mode="before")
    @classmethod
    def _parse_mesh_dims(cls, v: Any) -> Any:
        if isinstance(v, str):
            v = tuple(p.strip() for p in v.split(","))
        if v is not None:
            unknown = [n for n in v if n not in MESH_DIMS]
            if unknown:
                raise ValueError(f"unknown dim name {unknown[0]!r} in {','.join(v)}; choose from {', '.join(MESH_DIMS)}")
            repeated = sorted({n for n in v if list(v).count(n) > 1})
            if repeated:
                raise ValueError(f"{', '.join(repeated)} appears more than once in {','.join(v)}")
        return v

    @field_validator("data")
    @classmethod
    def _data_exists(cls, v: str | None) -> str | None:
        if v is not None:
            path = Path(v)
            if not path.is_file():
                raise ValueError(f"no such file: {v!r}")
            if not os.access(path, os.R_OK):
                raise ValueError(f"{v!r} is not readable")
            if path.stat().st_size == 0:
                raise ValueError(f"{v!r} is empty; give a text file to train on")
        return v

    @field_validator("metrics_file", "memory_report")
    @classmethod
    def _metrics_writable(cls, v: str | None) -> str | None:
        if v is not None:
            path = Path(v)
            if path.is_dir():
                raise ValueError(f"{v!r} is a directory; give a file name")
            parent = path.parent if str(path.parent) else Path(".")
            if not parent.is_dir():
                raise ValueError(f"the directory of {v!r} does not exist")
            if not os.access(path if path.exists() else parent, os.W_OK):
                raise ValueError(f"{v!r} is not writable")
        return v

    @field_validator("checkpoint_dir")
    @classmethod
    def _checkpoint_dir_usable(cls, v: str | None) -> str | None:
        if v is None:
            return v
        path = Path(v)
        if path.exists() and not path.is_dir():
            raise ValueError(f"{v!r} is a file, not a directory")
        if path.is_dir() and (re.fullmatch(r"step_\d+", path.name) or (path / "vemesh.json").exists()):
            raise ValueError(f"{v!r} is a checkpoint itself; pass the directory that holds the checkpoints, {str(path.parent)!r}")
        existing = path
        while not existing.exists():
            existing = existing.parent
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{v!r} is not writable ({str(existing)!r} does not let this user create files)")
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainConfig:
        """Every combination of flags, one concern after another (each method names the flags it checks)."""
        self._check_device()
        self._check_mesh()
        self._check_cp()
        self._check_pp()
        self._check_fsdp()
        self._check_moe()
        self._check_ft()
        self._check_fsdp_ranks()
        self._check_model_and_batch()
        self._check_checkpoints_and_faults()
        replicate = self.dp_replicate if self.fsdp else 1  # HSDP's split, and EP over DP x CP: checked above by flag
        self._dims = replace(self._dims, dp_replicate=replicate, dp_shard=self._dims.dp // replicate, ep=self.ep)
        return self

    def _check_device(self) -> None:
        if self.device == "auto":
            object.__setattr__(self, "device", "cuda" if torch.cuda.is_available() else "cpu")
        elif self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: this torch build sees no CUDA device (use --device cpu or auto)")
        ranks, gpus = int(os.environ.get("LOCAL_WORLD_SIZE", "1")), torch.cuda.device_count()
        if self.device == "cuda" and ranks > gpus:  # each rank takes the GPU of its LOCAL_RANK, nccl one per rank
            raise ValueError(f"--device cuda: {ranks} processes on this host (torchrun's --nproc_per_node) but torch "
                             f"sees {gpus} CUDA device{'s' * (gpus != 1)}; each rank needs its own: launch at most "
                             f"{gpus} per host, or use --device cpu")

    def _check_mesh(self) -> None:
        """--mesh-shape and --mesh-dims: one size per name, the -1 filled in from the world size."""
        W = self.world_size
        if self.mesh_dims is not None and self.mesh_shape is None:
            raise ValueError(f"--mesh-dims {','.join(self.mesh_dims)} needs --mesh-shape with one size per name")
        if self.mesh_shape is not None:
            names = self.mesh_dims if self.mesh_dims is not None else DEFAULT_MESH_DIMS.get(len(self.mesh_shape))
            if names is None or len(names) != len(self.mesh_shape):
                given = f"--mesh-dims {','.join(self.mesh_dims)} names {len(self.mesh_dims)} dims" if self.mesh_dims \
                    else "without --mesh-dims, it takes 2 sizes (DP,TP) or 3 (PP,DP,TP)"
                raise ValueError(f"--mesh-shape {','.join(map(str, self.mesh_shape))} has {len(self.mesh_shape)} "
                                 f"sizes; {given}")
        if self.mesh_shape is None:
            tp = 2 if W % 2 == 0 else 1
            object.__setattr__(self, "mesh_shape", (W // tp, tp))
        names = self.mesh_dims if self.mesh_dims is not None else DEFAULT_MESH_DIMS[len(self.mesh_shape)]
        hint = "; launch with torchrun --nproc_per_node=N to use N processes" if W == 1 else ""
        shape = fill_sizes(self.mesh_shape, W, names=names, what="--mesh-shape", of="the number of processes", hint=hint)
        degrees = {n.lower(): s for n, s in zip(names, shape)}
        degrees["dp_shard"] = degrees.pop("dp", 1)
        try:
            self._dims = ParallelDims(W, **degrees, mesh_dims=names)
        except ValueError as e:
            raise ValueError(f"--mesh-dims {','.join(names)}: {e}") from None

    def _check_cp(self) -> None:
        """A CP dim: the sequence splits evenly; no attention dropout (sequence parallelism cuts each CP rank's part
        again over TP: :meth:`_check_model_and_batch`)."""
        cp = self.cp_size
        if cp == 1:
            return
        chunks = 2 * cp if self.cp_load_balance else cp
        if self.seq_len % chunks:
            raise ValueError(
                f"--seq-len {self.seq_len} does not split over CP {cp}: each CP rank holds "
                + (f"2 of {chunks} equal chunks (head-tail load balancing)" if self.cp_load_balance
                   else f"1 of {chunks} equal slices")
                + f"; use a multiple of {chunks}" + (" or --no-cp-load-balance" if self.cp_load_balance else "")
            )
        if self.dropout:
            raise ValueError(f"--dropout {self.dropout}: CP's ring attention supports no attention dropout; "
                             "use --dropout 0 with a CP dim")

    def _check_pp(self) -> None:
        """A PP dim: enough blocks for the stages, micro-batches the schedule can take."""
        pp, dp, cp = self.pp_size, self.dp_size, self.cp_size
        if "PP" not in self.mesh_dim_names and (self.microbatches is not None or "pp_schedule" in self.model_fields_set):
            raise ValueError("--microbatches and --pp-schedule need a PP dim: a 3-D --mesh-shape PP,DP,TP, "
                             "or PP in --mesh-dims")
        if pp == 1:
            return
        stages = pp * (2 if self.pp_schedule in ("interleaved-1f1b", "interleaved-zb", "zbv", "dualpipev") else 1)
        if stages > self.n_layer:
            raise ValueError(
                f"--mesh-shape: {stages} pipeline stages ({f'2 per PP rank with {self.pp_schedule}, ' if stages > pp else ''}"
                f"PP={pp}) cannot split --n-layer {self.n_layer}; use at most {self.n_layer} stages"
            )
        m = self.microbatches if self.microbatches is not None else 2 * pp
        object.__setattr__(self, "microbatches", m)
        per_rank = self.global_batch_size // dp if self.global_batch_size % dp == 0 else None
        if per_rank is not None and per_rank % m:
            raise ValueError(
                f"--microbatches {m} does not divide the {per_rank} sequences per DP rank "
                f"(--global-batch-size {self.global_batch_size} / DP {dp})"
            )
        if self.pp_schedule == "1f1b" and m < pp:
            raise ValueError(f"--microbatches {m}: the 1f1b schedule needs at least one per stage ({pp})")
        rounds = max(1, m // pp)
        if self.pp_schedule in ("interleaved-1f1b", "interleaved-zb") and m % rounds:
            raise ValueError(f"--microbatches {m}: {self.pp_schedule} needs a multiple of its {rounds} rounds (m // PP)")
        if self.pp_schedule in ("interleaved-zb", "zbv", "dualpipev") and dp * cp > 1 and self.fsdp:
            raise ValueError(
                f"--pp-schedule {self.pp_schedule} with --fsdp and DP {dp * cp}: torch's zero-bubble schedules add "
                "the weight gradients outside autograd's hooks, so FSDP2's reduce-scatter misses them (measured: "
                "the loss drifts 1e-2 from one process). Use DDP + ZeRO-1 (drop --fsdp), or gpipe, 1f1b or "
                "interleaved-1f1b with --fsdp"
            )
        if self.pp_schedule in ("zbv", "dualpipev") and m < stages:
            raise ValueError(f"--microbatches {m}: {self.pp_schedule} needs at least one per stage ({stages}: 2 per "
                             f"PP rank)")

    def _check_fsdp(self) -> None:
        """--fsdp and --dp-replicate (HSDP)."""
        dp = self.dp_size
        if not self.fsdp:
            if "dp_replicate" in self.model_fields_set:
                raise ValueError(f"--dp-replicate {self.dp_replicate} splits DP for HSDP; it needs --fsdp")
            return
        given = sorted(f for f in ("distributed_optimizer", "overlap_grad_reduce") if f in self.model_fields_set)
        if given:
            raise ValueError(f"--fsdp shards the optimizer state and reduces gradients itself; "
                             f"{' and '.join(_flag(f, getattr(self, f)) for f in given)} "
                             f"{'do' if len(given) > 1 else 'does'} not apply to it")
        if dp % self.dp_replicate:
            divisors = listed(all_divisors(dp), 64)
            raise ValueError(f"--dp-replicate {self.dp_replicate} does not divide the DP size {dp} (choose from {divisors})")

    def _check_fsdp_ranks(self) -> None:
        """--fsdp needs ranks to shard over (after --ft-*'s checks: live fault tolerance refuses FSDP2 outright)."""
        if self.fsdp and self.dp_size * self.cp_size == 1:
            shape = " x ".join(f"{n}={k}" for n, k in zip(self.mesh_dim_names, self._dims.mesh_shape))
            raise ValueError(f"--fsdp shards over DP x CP, which is 1 on the mesh {shape}: give DP or CP more than one "
                             f"rank (torchrun --nproc_per_node and --mesh-shape), or leave --fsdp out")

    def _check_model_and_batch(self) -> None:
        """The model's heads split over TP; the global batch over DP, in whole micro-batches."""
        pp, dp, tp = self.pp_size, self.dp_size, self.tp_size
        if self.n_embd % self.n_head:
            heads = listed(all_divisors(self.n_embd), 64)
            raise ValueError(f"--n-embd {self.n_embd} is not divisible by --n-head {self.n_head} (each head takes "
                             f"n_embd / n_head channels): choose --n-head from {heads}, or another --n-embd")
        if self.n_head % tp:
            divisors = listed(all_divisors(self.n_head), 64)
            raise ValueError(f"--mesh-shape: TP size {tp} does not divide --n-head {self.n_head} (choose TP from {divisors})")
        if self.global_batch_size % dp:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not divisible by the DP size {dp} "
                f"(each DP rank takes an equal slice)"
            )
        cp = self.cp_size  # sequence parallelism cuts each CP rank's part of the sequence again over TP
        if self.sequence_parallel and self.seq_len % (tp * cp):
            over = f"the TP size {tp}" if cp == 1 else f"CP x TP = {cp} x {tp} = {cp * tp}"
            raise ValueError(f"--sequence-parallel: --seq-len {self.seq_len} must be divisible by {over}")
        if self.min_lr > self.lr:
            raise ValueError(f"--min-lr {self.min_lr} is above --lr {self.lr}")
        if self.gradient_sync == "each" and pp > 1:
            raise ValueError("--gradient-sync each with PP > 1: torch's schedule runs the micro-batches (--microbatches) "
                             "and averages each stage's gradients on its last backward; leave --gradient-sync out")
        if self.micro_batch_size is not None:
            if pp > 1:
                raise ValueError("--micro-batch-size splits the batch of the DDP path; with PP > 1 use --microbatches")
            per_rank = self.global_batch_size // dp
            if per_rank % self.micro_batch_size:
                raise ValueError(
                    f"--micro-batch-size {self.micro_batch_size} does not divide the {per_rank} sequences per DP rank "
                    f"(--global-batch-size {self.global_batch_size} / DP {dp})"
                )

    def _check_checkpoints_and_faults(self) -> None:
        """Checkpoint flags need --checkpoint-dir; fault injections land on a step that runs."""
        pp = self.pp_size
        if self.checkpoint_interval_s and not self.checkpoint_dir:
            raise ValueError(f"--checkpoint-interval-s {self.checkpoint_interval_s} needs --checkpoint-dir")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError(f"--checkpoint-every {self.checkpoint_every} needs --checkpoint-dir")
        if self.nan_at_step is not None and pp > 1:
            raise ValueError("--nan-at-step injects into the loss of the DDP path; it does not apply with PP > 1")
        if self.nan_at_step is not None and self.nan_at_step > self.steps:
            raise ValueError(f"--nan-at-step {self.nan_at_step} is after the last step (--steps {self.steps})")
        if self.fail_at_step is not None and self.fail_at_step > self.steps:
            raise ValueError(f"--fail-at-step {self.fail_at_step} is after the last step (--steps {self.steps})")
        if self.inject is not None:
            from faults import Fault

            Fault.parse(self.inject, self.world_size, self.steps)

    def _check_moe(self) -> None:
        E, k, ep = self.moe_experts, self.moe_top_k, self.ep
        given = sorted(f for f in ("moe_top_k", "moe_every", "moe_aux_loss_coef", "ep") if f in self.model_fields_set)
        if not E:
            if given:
                raise ValueError(f"{', '.join(_flag(f) for f in given)} applies to a mixture of experts; add "
                                 "--moe-experts E")
            return
        if k > E:
            raise ValueError(f"--moe-top-k {k} is more than the {E} experts of --moe-experts; choose 1..{E}")
        folded = self.dp_size * self.cp_size
        if folded % ep:
            divisors = listed(all_divisors(folded), 64)
            raise ValueError(f"--ep {ep} does not divide DP x CP = {self.dp_size} x {self.cp_size} = {folded}: EP folds "
                             f"over the data-parallel ranks (choose from {divisors})")
        if E % ep:
            divisors = listed([d for d in all_divisors(E) if folded % d == 0], 64)
            raise ValueError(f"--ep {ep} does not divide the {E} experts of --moe-experts (each EP rank holds E / EP; "
                             f"choose from {divisors})")
        if self.pp_size > 1:
            raise ValueError("--moe-experts with a PP dim is not supported yet (the load-balancing loss and the expert "
                             "all-to-all under torch's schedules are untested); drop PP or the MoE")
        if self.sequence_parallel:
            raise ValueError("--moe-experts with --sequence-parallel is not supported: the router needs every token of "
                             "the TP group; drop --sequence-parallel")
        if self.fsdp and self.dp_replicate > 1 and ep > 1:
            raise ValueError("--ep with --dp-replicate (HSDP) is not supported: the experts shard over EDP only; "
                             "drop --dp-replicate")

    def _check_ft(self) -> None:
        given = sorted(f for f in ("ft_lighthouse", "ft_min_replicas", "ft_timeout_s") if f in self.model_fields_set)
        if self.ft_replica_id is None:
            if given:
                raise ValueError(f"{', '.join(_flag(f) for f in given)} applies to live fault tolerance; add --ft-replica-id I")
            return
        if importlib.util.find_spec("torchft") is None:  # found, not imported: torchft's logging is set up later
            raise ValueError("--ft-replica-id needs torchft, which is not installed here: pip install \"vemesh[ft]\" "
                             "(torchft, with its lighthouse torchft_lighthouse)")
        lighthouse = self.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE")
        if not lighthouse:
            raise ValueError("--ft-replica-id needs a torchft lighthouse: --ft-lighthouse http://HOST:29510 or "
                             "TORCHFT_LIGHTHOUSE (start one with: torchft_lighthouse --min_replicas 1)")
        if not re.fullmatch(r"https?://[^\s/:]+(:\d+)?/?", lighthouse):
            raise ValueError(f"--ft-lighthouse {lighthouse!r} is not an address like http://HOST:29510")
        unsupported = [(self.fsdp, "--fsdp"), (self.pp_size > 1, "a PP dim"), (bool(self.moe_experts), "--moe-experts"),
                       (not self.distributed_optimizer, "--no-distributed-optimizer")]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"--ft-replica-id with {what} is not supported: live fault tolerance runs DDP with the "
                                 "ZeRO-1 DistributedOptimizer (which steps only when the replicas vote to commit) over "
                                 "DP, TP and CP inside each replica")

    @property
    def grad_accum(self) -> int:
        """Passes per step on each DP rank (derived from the world: DP changes, the global batch does not)."""
        return self.grad_accum_for(self.dp_size, self.pp_size)

    def grad_accum_for(self, dp_size: int, pp_size: int) -> int:
        """Passes per step on each of ``dp_size`` DP ranks (the pipeline micro-batches instead when PP > 1)."""
        if self.micro_batch_size is None or pp_size > 1:
            return 1
        return self.global_batch_size // dp_size // self.micro_batch_size

    @property
    def local_world_size(self) -> int:
        return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))

    def n_params(self) -> int:
        """Parameters of the full model (blocks, embeddings, head), before any sharding."""
        C, V, L = self.n_embd, 256, self.n_layer
        dense = L * (12 * C * C + 13 * C) + 2 * V * C + self.seq_len * C + 2 * C
        moe_layers = len(range(0, L, self.moe_every)) if self.moe_experts else 0  # each: E - 1 more MLPs, a router
        return dense + moe_layers * ((self.moe_experts - 1) * (8 * C * C + 5 * C) + self.moe_experts * C)

    @property
    def dims(self) -> ParallelDims:
        """The job's degrees and every dim they derive (``grad_dim``, ``dp_cp``, the HSDP split, ``EDP``), from
        :class:`vemesh.parallel.ParallelDims`: what ``job.setup`` builds the mesh from."""
        assert self._dims is not None, "a TrainConfig is checked when it is built"
        return self._dims

    @property
    def pp_size(self) -> int:
        return self.dims.pp

    @property
    def dp_size(self) -> int:
        return self.dims.dp

    @property
    def cp_size(self) -> int:
        return self.dims.cp

    @property
    def tp_size(self) -> int:
        return self.dims.tp

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        return self.dims.mesh_dims

    def plan_command(self, device_memory: int | None = None) -> str:
        """The ``vemesh plan`` command of this run: the same GPT (``--model gpt:...``), mesh, batch, wrapper, dtype
        and switches, so that the planner gives its peak per rank before a launch (or after one ran out of memory).
        ``device_memory``: the device's bytes (``--device-memory``, which then checks that the peak fits)."""
        model = {"n_layer": self.n_layer, "n_embd": self.n_embd, "n_head": self.n_head, "vocab": 256,
                 "seq_len": self.seq_len}
        if self.moe_experts:
            model.update(moe_experts=self.moe_experts, moe_top_k=self.moe_top_k, moe_every=self.moe_every)
        args = ["vemesh plan", "--model gpt:" + ",".join(f"{k}={v}" for k, v in model.items()),
                f"--world-size {self.world_size}"]
        args += [f"--{dim} {n}" for dim, n in (("pp", self.pp_size), ("dp", self.dp_size), ("cp", self.cp_size),
                                               ("tp", self.tp_size), ("ep", self.ep)) if n > 1 or dim == "dp"]
        args.append(f"--global-batch-size {self.global_batch_size}")
        if self.pp_size > 1:  # each DP rank's share in the pipeline's micro-batches
            per_dp = self.global_batch_size // self.dp_size
            args += [f"--micro-batch-size {per_dp // (self.microbatches or 2 * self.pp_size)}",
                     f"--pp-schedule {self.pp_schedule}"]
        elif self.micro_batch_size is not None:
            args += [f"--micro-batch-size {self.micro_batch_size}"] + \
                (["--gradient-sync each"] if self.gradient_sync == "each" else [])
        args.append("--dp-mode " + ("fsdp" if self.fsdp else "zero1" if self.distributed_optimizer else "ddp"))
        if self.dp_replicate > 1:
            args.append(f"--dp-replicate {self.dp_replicate}")
        args.append(f"--dtype {self.dtype}")
        if self.device == "cpu":  # the optimizer as torch runs it there (a loop over tensors, not foreach)
            args.append("--device-type cpu")
        args += [flag for on, flag in ((self.sequence_parallel and self.tp_size > 1, "--sequence-parallel"),
                                       (self.activation_checkpointing, "--activation-checkpointing"),
                                       (self.compile, "--compile")) if on]
        if device_memory is not None:
            args.append(f"--device-memory {device_memory / 2**30:.1f}GiB")
        return " ".join(args)

    @classmethod
    def from_args(cls, argv: list[str] | None = None) -> TrainConfig:
        """Parse command-line flags into a validated config; raise ``ConfigError`` on any problem."""
        parser = _build_parser(cls)
        args: list[str] = []
        rest = iter(sys.argv[1:] if argv is None else argv)
        for arg in rest:  # argparse would take the "-1,2" in "--mesh-shape -1,2" for a flag
            value = next(rest, None) if arg == "--mesh-shape" else None
            args.append(arg if value is None else f"{arg}={value}")
        ns = parser.parse_args(args)
        try:
            return cls(**vars(ns))
        except ValidationError as e:
            raise ConfigError("\n".join(_describe(err) for err in e.errors())) from None


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and sys.exit(2) itself
        raise ConfigError(f"{message} (see --help)")


def _flag(name: str, value: object = True) -> str:
    """The flag of field ``name``, as given: ``--no-...`` for a switch turned off."""
    return ("--no-" if value is False else "--") + name.replace("_", "-")


def _build_parser(cls: type[BaseModel]) -> argparse.ArgumentParser:
    p = _ArgumentParser(
        prog="train.py",
        description="Train a small GPT on a (DP, TP) or (PP, DP, TP) vemesh mesh. Every flag maps to a TrainConfig field.",
        argument_default=argparse.SUPPRESS,  # absent flags keep the pydantic defaults
    )
    for name, field in cls.model_fields.items():
        if name == "world_size":
            continue
        default = field.get_default(call_default_factory=False)
        described = field.description or ""  # a description that says its own default keeps it: no "(default: None)"
        help_text = described if "(default:" in described else f"{described} (default: {default})".strip()
        if field.annotation is bool:
            p.add_argument(_flag(name), dest=name, action="store_true", help=help_text)
            p.add_argument("--no-" + name.replace("_", "-"), dest=name, action="store_false")
        else:
            p.add_argument(_flag(name), dest=name, metavar=name.upper(), help=help_text)
    return p


def _describe(err: dict[str, Any]) -> str:
    """One pydantic error as ``--flag: message``."""
    msg = str(err["msg"]).removeprefix("Value error, ")
    if not err["loc"]:
        return msg  # model-level checks already name their flags
    return f"{_flag(str(err['loc'][0]))}: {msg}"
