"""The GPT preset as the planner traces it: a factory, a parallelize function and a step, the three functions a
user gives ``vemesh plan --model module:... --parallelize ... --step ...``, written as the example trains the GPT.

``vemesh plan --model gpt:...`` on a mesh without PP traces these (:func:`vemesh.planning.fit.predict`), so the
preset is planned by the same engine as any user model: the factory builds ``GPT(config)``; the parallelize
function is :func:`vemesh.models.gpt.parallelize` with the job's options (TP with or without sequence parallelism,
EP, activation checkpointing, FSDP2 with the example's mixed precision, or vemesh DDP); the step is the example's
micro-batch (random tokens, the fp32 cross-entropy, backward), inside ``context_parallel`` with the tokens, the
labels and the position buffer when the mesh has CP; and what the example does between the last backward and
``optimizer.step()``, and after it, in the step it times (:func:`before_optimizer_for`).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from vemesh import VESCALE_DEVICE_MESH
from vemesh.ddp import DistributedDataParallel
from vemesh.layout.data_dims import data_dims
from vemesh.models.gpt.model import GPT, GPTConfig
from vemesh.models.gpt.parallelize import parallelize
from vemesh.models.gpt.stages import cut_stage, stage_kinds
from vemesh.optim import clip_grad_norm_
from vemesh.parallel import context_parallel
from vemesh.parallel.schedules import build_stages, run_schedule, stage_indices, stages_per_rank

__all__ = ["before_optimizer_for", "factory", "loss_fn", "parallelize_for", "pipeline_step_for", "step"]


def factory(config: GPTConfig) -> Any:
    """``FACTORY()`` for the planner: a new ``GPT(config)`` per call (the same callable for one config)."""
    return functools.partial(GPT, config)


def stage_kinds_for(config: GPTConfig, pp_schedule: str) -> Any:
    """``FUNCTION(pp_rank, pp, n_blocks)``: what the stages of a PP rank are under :func:`parallelize_for`'s cut
    (:func:`vemesh.models.gpt.stages.stage_kinds`); a block is told by whether it is a MoE block, the one thing the
    preset does by the block's number (activation checkpointing takes every block)."""
    def moe(i: int) -> bool:
        return config.moe_experts > 0 and i % config.moe_every == 0

    def kinds(pp_rank: int, pp: int, n_blocks: int | None = None) -> tuple:
        return stage_kinds(config.n_layer if n_blocks is None else n_blocks, pp_rank, pp, pp_schedule, moe)

    return kinds


@functools.lru_cache(maxsize=32)
def parallelize_for(mode: str, dtype: str, sequence_parallel: bool, activation_checkpointing: bool,
                    pp_schedule: str = "1f1b") -> Any:
    """``FUNCTION(model, mesh)`` for the planner: the example's wrapping of the GPT for the job's options.

    ``mode`` is ``"fsdp"`` (FSDP2 on each block and the root, fp32 parameters computing in ``dtype`` as the example's
    mixed-precision policy does) or ``"ddp"``/``"zero1"`` (vemesh DDP; the optimizer makes it ZeRO-1). With PP in
    the mesh it returns this rank's pipeline stages, as the example builds them: the stages ``pp_schedule`` places
    on this PP rank cut from the model (:func:`cut_stage`), each parallelized, each a torch ``PipelineStage`` on the
    group of ``mesh["PP"]``.
    """
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32
    wrap: dict[str, Any] = (dict(data_parallel="fsdp", mp_policy=MixedPrecisionPolicy(param_dtype=compute,
                                                                                         reduce_dtype=torch.float32))
                            if mode == "fsdp" else dict(data_parallel="ddp"))

    def one(part: nn.Module, mesh: Any) -> nn.Module:
        return parallelize(part, mesh, sequence_parallel=sequence_parallel,
                           activation_checkpointing=activation_checkpointing, **wrap)

    def gpt_parallelize(model: nn.Module, mesh: Any) -> Any:
        pp = mesh.get_strategy_size("PP")
        if pp == 1:
            return one(model, mesh)
        return build_stages(model, mesh, pp_schedule, cut_stage, one)

    gpt_parallelize.__qualname__ = f"parallelize[{mode}{', sp' if sequence_parallel else ''}" \
                                   f"{', ac' if activation_checkpointing else ''}]"
    return gpt_parallelize


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """One micro-batch as the example computes it: its tokens, the fp32 cross-entropy, backward; with CP, inside
    ``context_parallel`` with the tokens, the labels and the model's position buffer."""
    core = model.module if isinstance(model, DistributedDataParallel) else model
    config = core.config
    x = torch.randint(0, config.vocab_size, (micro_batch_size, config.block_size))
    y = torch.randint(0, config.vocab_size, (micro_batch_size, config.block_size))
    cp = VESCALE_DEVICE_MESH.get_strategy_size("CP") > 1
    within = context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[x, y, core.pos], buffer_seq_dims=[1, 1, 0]) \
        if cp else contextlib.nullcontext()
    with within:  # the logits are not held while backward runs, as in the example's loss_fn(model(x), y)
        loss = F.cross_entropy(model(x).float().view(-1, config.vocab_size), y.view(-1))
        loss.backward()
    return loss.detach()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The example's loss: the fp32 cross-entropy of one micro-batch's logits (the pipeline schedule's ``loss_fn``)."""
    return F.cross_entropy(logits.float().flatten(0, -2), targets.flatten())


@functools.lru_cache(maxsize=8)
def pipeline_step_for(pp_schedule: str) -> Any:
    """``STEP(schedule, batch_size)`` for the planner with PP: the example's step of a batch through torch's schedule
    (tokens on the first stage, targets and losses on the last, no logits kept), with vemesh DDP's averaging held to
    the end under a zero-bubble schedule (:func:`vemesh.parallel.schedules.run_schedule`)."""

    def pipeline_step(schedule: Any, batch_size: int) -> None:
        # torch's schedules keep their stages as _stage (one) or _stages (several); the stages' modules are the chunks
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        chunks = [s.submod for s in stages]
        cores = [c.module if isinstance(c, DistributedDataParallel) else c for c in chunks]
        config = cores[0].config
        x = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
        y = torch.randint(0, config.vocab_size, (batch_size, config.block_size))
        cp = VESCALE_DEVICE_MESH.get_strategy_size("CP") > 1
        within = context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[x, y, *(c.pos for c in cores)],
                                  buffer_seq_dims=[1, 1] + [0] * len(cores)) if cp else contextlib.nullcontext()
        with within:  # as the example's step: each CP rank keeps its part of the sequence and of the stages' positions
            run_schedule(schedule, pp_schedule, chunks, x, target=y, losses=[], return_outputs=False)

    pipeline_step.__qualname__ = f"pipeline_step[{pp_schedule}]"
    return pipeline_step


@functools.lru_cache(maxsize=8)
def before_optimizer_for(pp_schedule: str = "1f1b", max_norm: float = 1.0) -> Any:
    """``BEFORE_OPTIMIZER(model)`` for the planner: the example's own work around ``optimizer.step()`` in a step
    (the GPT example's ``train.py``): ``compute``'s ``clip_grad_norm_`` over every chunk's parameters (summed over the
    pipeline's stages with PP; a DTensor's norm over its mesh), ``agree``'s all-reduce of two flags over every rank
    (a non-finite step, a stop), and ``after_step``'s mean of the loss over the gradient dim on the ranks that hold
    it (the last stage's with PP). The test of the example's memory report holds the calls per dim equal."""

    def before_optimizer(model: Any) -> None:
        mesh = VESCALE_DEVICE_MESH
        parts = model if isinstance(model, (list, tuple)) else [model]
        params = [p for part in parts for p in getattr(part, "submod", part).parameters()]
        pp = mesh.get_strategy_size("PP")
        norm = clip_grad_norm_(params, max_norm or math.inf, groups=[mesh.get_group("PP")] if pp > 1 else [])
        flags = torch.stack([torch.isfinite(norm).logical_not().float(), torch.zeros((), device=norm.device)])
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        n_stages = pp * stages_per_rank(pp_schedule)
        grad = data_dims(mesh.layout).grad
        holds_loss = pp == 1 or n_stages - 1 in stage_indices(mesh.lookup_rank("PP"), pp, pp_schedule)
        if holds_loss and grad is not None and mesh.get_strategy_size(grad) > 1:  # job.dp_mean's all-reduce
            dist.all_reduce(torch.zeros((), device=norm.device), group=mesh.get_group(grad))

    before_optimizer.__qualname__ = f"before_optimizer[{pp_schedule}]"
    return before_optimizer
