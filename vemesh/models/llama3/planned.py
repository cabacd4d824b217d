"""The Llama 3 preset as the planner traces it (``vemesh plan --model llama3:8b``): a factory, a parallelize function,
a step and, with PP, the schedule's loss and step: the functions a user of torchtitan would write, so the preset is
planned by the same engine as any user model (:mod:`vemesh.planning.user_model`, :mod:`vemesh.planning.pipeline_plan`).

The step draws a micro-batch of ``seq_len`` tokens, runs the model, and the fp32 cross-entropy (under TP inside
torch's ``loss_parallel``, the logits sharded on the vocabulary), then backward; with CP inside ``context_parallel``
with the tokens, the labels and RoPE's tables. Between the last backward and ``optimizer.step()`` it clips the
gradients' global norm, as torchtitan's loop does.

torchtitan compiles that loss with the blocks (``compile.components``, ``["model", "loss"]`` by default since 2025;
its December 2024 commit left it eager). Compiled, the cross-entropy holds neither the fp32 logits nor their
log-softmax nor an fp32 gradient: inductor reads the bf16 logits once for each row's log-sum-exp and writes their
gradient in one kernel, in bf16. :func:`compiled_loss_fn` holds what that kernel holds (measured against
``torch.compile`` on this CPU: ``test_llama3_speedups.py``), for the planner's trace of ``--compile``.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import torch
from torch import nn

from vemesh import VESCALE_DEVICE_MESH
from vemesh.models.llama3.model import Llama3, Llama3Config, loss_fn
from vemesh.models.llama3.parallelize import check_ac, cut_stage, parallelize, recomputes
from vemesh.optim import clip_grad_norm_
from vemesh.parallel import context_parallel
from vemesh.models.gpt.stages import stage_kinds
from vemesh.parallel.schedules import build_stages, run_schedule

__all__ = ["before_optimizer", "compiled_loss_fn", "factory", "loss_fn", "parallelize_for", "pipeline_step_for", "step",
           "step_for"]


class _CompiledCrossEntropy(torch.autograd.Function):
    """The mean cross-entropy of ``(N, V)`` logits as inductor's compiled kernels hold it: the forward keeps each row's
    log-sum-exp (``N`` values) and the logits it was given; the backward writes the gradient, ``softmax - one_hot``
    scaled, into one new tensor of the logits' dtype (computed in place there)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        lse = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(1, targets[:, None]).squeeze(1)
        ctx.save_for_backward(logits, targets, lse)
        return (lse.float() - picked.float()).mean()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        scale = grad / logits.shape[0]
        out = (logits - lse[:, None]).exp_().mul_(scale)  # one region under compile's replay (vemesh.planning.fusion)
        return out.scatter_add_(1, targets[:, None], (-scale).expand(targets.shape[0], 1).to(out.dtype)), None


def compiled_loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """:func:`loss_fn` as ``torch.compile`` runs it (see the module docstring). Vocabulary-parallel logits (DTensors,
    under TP's ``loss_parallel``) are left to :func:`loss_fn`: traced eager."""
    from torch.distributed.tensor import DTensor

    if isinstance(logits, DTensor):
        return loss_fn(logits, targets)
    return _CompiledCrossEntropy.apply(logits.flatten(0, 1), targets.flatten(0, 1))


def factory(config: Llama3Config) -> Any:
    """``FACTORY()``: a new ``Llama3(config)`` per call (the same callable for one config)."""
    return functools.partial(Llama3, config)


@functools.lru_cache(maxsize=64)
def parallelize_for(mode: str, dtype: str, ac: str, pp_schedule: str = "1f1b") -> Any:
    """``FUNCTION(model, mesh)``: :func:`vemesh.models.llama3.parallelize.parallelize` for the job's options; with PP
    in the mesh, this rank's stages (:func:`cut_stage`), each parallelized and a torch ``PipelineStage`` on the group
    of ``mesh["PP"]``."""
    ac = check_ac(ac)
    compute = torch.bfloat16 if dtype == "bf16" else torch.float32

    def one(part: nn.Module, mesh: Any) -> nn.Module:
        return parallelize(part, mesh, dp_mode=mode, ac=ac, param_dtype=compute)

    def llama3_parallelize(model: nn.Module, mesh: Any) -> Any:
        pp = mesh.get_strategy_size("PP")
        if pp == 1:
            return one(model, mesh)
        return build_stages(model, mesh, pp_schedule, cut_stage, one)

    llama3_parallelize.__qualname__ = f"parallelize[{mode}, ac={ac}]"
    return llama3_parallelize


def stage_kinds_for(cfg: Llama3Config, ac: str, pp_schedule: str) -> Any:
    """``FUNCTION(pp_rank, pp, n_blocks)``: what the stages of a PP rank are under :func:`parallelize_for`'s cut
    (:func:`vemesh.models.gpt.stages.stage_kinds`); a block is told by whether ``ac`` recomputes it, which
    ``selective-N`` decides by the block's number."""
    recomputed = functools.partial(recomputes, check_ac(ac))

    def kinds(pp_rank: int, pp: int, n_blocks: int | None = None) -> tuple:
        return stage_kinds(cfg.n_layers if n_blocks is None else n_blocks, pp_rank, pp, pp_schedule, recomputed)

    return kinds


def _loss_context() -> Any:
    """torch's ``loss_parallel`` where the mesh has TP (the head's logits are sharded on the vocabulary)."""
    if VESCALE_DEVICE_MESH.get_strategy_size("TP") > 1:
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()
    return contextlib.nullcontext()


def _cp_context(tensors: list[torch.Tensor], seq_dims: list[int]) -> Any:
    if VESCALE_DEVICE_MESH.get_strategy_size("CP") > 1:
        return context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=tensors, buffer_seq_dims=seq_dims)
    return contextlib.nullcontext()


def _core(model: nn.Module) -> Llama3:
    return getattr(model, "module", model)


def step(model: nn.Module, micro_batch_size: int, loss: Any = loss_fn) -> torch.Tensor:
    """One micro-batch: tokens and labels, the model, the fp32 cross-entropy, backward (see the module docstring)."""
    core = _core(model)
    cfg = core.cfg
    x = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len))
    y = torch.randint(0, cfg.vocab_size, (micro_batch_size, cfg.seq_len))
    with _cp_context([x, y, core.rope_cos, core.rope_sin], [1, 1, 0, 0]), _loss_context():
        value = loss(model(x), y)
        value.backward()
    return value.detach()


def _compiled_step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    return step(model, micro_batch_size, compiled_loss_fn)


def step_for(compiled_loss: bool) -> Any:
    """``STEP(model, micro_batch_size)``: :func:`step`, with :func:`compiled_loss_fn` where the loss is compiled."""
    return _compiled_step if compiled_loss else step


@functools.lru_cache(maxsize=16)
def pipeline_step_for(pp_schedule: str) -> Any:
    """``STEP(schedule, batch_size)``: a DP rank's batch through torch's schedule (tokens on the first stage, labels
    and losses on the last, the schedule's ``loss_fn``), inside ``context_parallel`` and ``loss_parallel`` where the
    mesh has CP and TP."""

    def pipeline_step(schedule: Any, batch_size: int) -> None:
        stages = getattr(schedule, "_stages", None) or [schedule._stage]
        chunks = [s.submod for s in stages]
        cores = [_core(c) for c in chunks]
        cfg = cores[0].cfg
        x = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
        y = torch.randint(0, cfg.vocab_size, (batch_size, cfg.seq_len))
        tables = [t for c in cores for t in (c.rope_cos, c.rope_sin)]
        with _cp_context([x, y, *tables], [1, 1] + [0] * len(tables)), _loss_context():
            run_schedule(schedule, pp_schedule, chunks, x, target=y, losses=[], return_outputs=False)

    pipeline_step.__qualname__ = f"pipeline_step[{pp_schedule}]"
    return pipeline_step


def before_optimizer(model: Any) -> None:
    """torchtitan's clipping of the gradients' global norm over every chunk's parameters (over the PP group too)."""
    parts = model if isinstance(model, (list, tuple)) else [model]
    params = [p for part in parts for p in getattr(part, "submod", part).parameters()]
    pp = VESCALE_DEVICE_MESH.get_strategy_size("PP")
    clip_grad_norm_(params, 1.0, groups=[VESCALE_DEVICE_MESH.get_group("PP")] if pp > 1 else [])
