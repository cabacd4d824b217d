"""``parallelize``: TP, CP, EP, activation checkpointing and FSDP2 or DDP on the GPT, in that order,
through vemesh's public API and torch's (torchtitan's ``parallelize_llama`` is the shape followed).

Tensor parallelism for the GPT (:mod:`vemesh.models.gpt.model`), with torch's own ``parallelize_module``.

Megatron-style: in each block, q/k/v and the MLP's up projection are split
column-wise (each TP rank owns ``n_head // tp`` whole heads and ``4C // tp``
hidden units) and the two output projections row-wise, so each block costs one
all-reduce in attention and one in the MLP, forward and backward.

Every parameter becomes a DTensor on the TP mesh, so gradient clipping,
DDP and checkpointing see one kind of parameter:

    =============  ==========================  ===========================
    module         parameters                  activations out
    =============  ==========================  ===========================
    wte, wpe       Shard(0): rows of the table  Replicate (all-reduce)
    ln_*           Replicate                    Replicate
    q, k, v, c_fc  Shard(0): output features    local shard, Shard(-1)
    c_proj         Shard(1): input features     Replicate (all-reduce)
    lm_head        Shard(0): vocab rows         Replicate (all-gather)
    =============  ==========================  ===========================

A mixture-of-experts layer splits each expert as the MLP (expert TP equals TP) and keeps the
router whole on every TP rank, so every TP rank routes the same tokens the same way.

The loss is exact: the logits are all-gathered (V = 256 bytes, cheap) and every
TP rank computes the same full cross-entropy on the same batch.

With ``sequence_parallel=True`` the activations between blocks are split along
the sequence (``Shard(1)``): LayerNorms run on ``T // tp`` positions, the
all-reduces become reduce-scatter + all-gather. The math is the same; only the
summation order of the LayerNorm weight gradients changes (fp32 rounding).
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from vemesh import VESCALE_DEVICE_MESH
from vemesh.ddp import DistributedDataParallel
from vemesh.models.gpt.model import MoE
from vemesh.parallel import ExpertParallel, fully_shard


class ReplicateParallel(ParallelStyle):
    """Keep a module whole on every TP rank, with its parameters as ``Replicate()`` DTensors.

    Inputs are taken as replicated local tensors and outputs handed back as
    local tensors, so the module's math is untouched.
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def to_dtensor(mod, inputs, mesh):
            return tuple(
                DTensor.from_local(t, mesh, [Replicate()], run_check=False) if not isinstance(t, DTensor) else t
                for t in inputs
            )

        def to_local(mod, outputs, mesh):
            return outputs.to_local()

        return distribute_module(module, device_mesh, input_fn=to_dtensor, output_fn=to_local)


def gpt_tp_plan(layers: Iterable[str], *, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """The ``parallelize_module`` plan for a ``GPT`` whose blocks are ``h[layer]`` for ``layer`` in ``layers``."""
    if not sequence_parallel:
        plan: dict[str, ParallelStyle] = {
            "wte": RowwiseParallel(input_layouts=Replicate()),
            "wpe": RowwiseParallel(input_layouts=Replicate()),
            "ln_f": ReplicateParallel(),
            "lm_head": ColwiseParallel(output_layouts=Replicate()),
        }
        for i in layers:
            plan |= {
                f"h.{i}.ln_1": ReplicateParallel(),
                f"h.{i}.attn.q": ColwiseParallel(),
                f"h.{i}.attn.k": ColwiseParallel(),
                f"h.{i}.attn.v": ColwiseParallel(),
                f"h.{i}.attn.c_proj": RowwiseParallel(),
                f"h.{i}.ln_2": ReplicateParallel(),
                f"h.{i}.mlp.c_fc": ColwiseParallel(),
                f"h.{i}.mlp.c_proj": RowwiseParallel(),
            }
        return plan

    # Sequence parallel: between the blocks each rank holds x[:, rank's T // tp positions, :].
    plan = {
        "wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),  # (B, T/tp, C)
        "wpe": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(0)),  # (T/tp, C)
        "ln_f": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    }
    for i in layers:
        plan |= {
            f"h.{i}.ln_1": SequenceParallel(),
            f"h.{i}.attn": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            f"h.{i}.attn.q": ColwiseParallel(),
            f"h.{i}.attn.k": ColwiseParallel(),
            f"h.{i}.attn.v": ColwiseParallel(),
            f"h.{i}.attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
            f"h.{i}.ln_2": SequenceParallel(),
            f"h.{i}.mlp": PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate()),
            f"h.{i}.mlp.c_fc": ColwiseParallel(),
            f"h.{i}.mlp.c_proj": RowwiseParallel(output_layouts=Shard(1)),
        }
    return plan


def apply_tp(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False) -> nn.Module:
    """Shard ``model`` (a ``GPT``, or a pipeline stage of one) over the 1-D ``tp_mesh`` in place and return it.

    Every rank must have built the model with the same weights (same seed): TP rank 0's copy is what gets
    sharded or broadcast (``SequenceParallel``'s LayerNorms keep each rank's own copy). On a (DP=2, TP=2)
    mesh, rank 1 (TP rank 1) ends up with heads 2-3 of every q/k/v, the second half of every ``c_fc`` and
    byte ids 128-255 of ``wte``.
    """
    plan = gpt_tp_plan(model.h.keys(), sequence_parallel=sequence_parallel)
    names = [name for name, _ in model.named_modules()]  # in module order: every rank shards in the same order
    present = set(names)  # a pipeline stage lacks some of them
    for name in names:  # mixture-of-experts layers: the router whole, as ReplicateParallel keeps it
        if name.endswith(".router"):
            plan[name] = ReplicateParallel()
    return parallelize_module(model, tp_mesh, {k: v for k, v in plan.items() if k in present})


def parallelize(model: nn.Module, mesh: Any = None, *, data_parallel: str = "ddp", sequence_parallel: bool = False,
                activation_checkpointing: bool = False, compile: bool = False, mp_policy: Any = None,
                **ddp_options: Any) -> nn.Module:
    """Apply every parallelism of the mesh (as :class:`~vemesh.parallel.ParallelDims` builds it) to ``model``, in order.

    1. **TP** over ``mesh["TP"]`` (:func:`apply_tp`), with sequence parallelism if asked;
    2. **CP**: nothing to change in the model (its positions are a buffer, its attention torch's SDPA):
       the training step runs inside ``vemesh.parallel.context_parallel(mesh["CP"], buffers=[x, y, model.pos])``;
    3. **EP**: each MoE's grouped experts over ``mesh["EP"]`` (``ExpertParallel``);
    4. **activation checkpointing** of every block; with ``compile``, every block compiled in place
       (``block.compile(fullgraph=True)``, torchtitan's per-block compile), before FSDP2 or DDP wrap it; without
       ``fullgraph`` with CP (the ring runs eagerly: a graph break at each attention) and in MoE blocks (the
       routing sizes tensors by the data);
    5. **FSDP2** (``data_parallel="fsdp"``: ``vemesh.parallel.fully_shard`` per block, then the root; experts on
       EDP) or **DDP** (``"ddp"``: vemesh's DDP with no group, so over the mesh's data dims, experts over EDP;
       ``ddp_options`` go to it, e.g. ``replicas=``), or nothing (``"none"``).

    Args:
        model: a ``GPT`` or a pipeline stage of one, the same weights on every rank.
        mesh: the mesh manager (default ``VESCALE_DEVICE_MESH``), with standard dim names (``ParallelDims.build``).

    Returns:
        The module to train: the model, wrapped in DDP or sharded by FSDP2.
    """
    mesh = VESCALE_DEVICE_MESH if mesh is None else mesh
    if data_parallel not in ("ddp", "fsdp", "none"):
        raise ValueError(f"data_parallel must be 'ddp', 'fsdp' or 'none'; got {data_parallel!r}")
    if mesh.get_strategy_size("TP") > 1:
        model = apply_tp(model, mesh["TP"], sequence_parallel=sequence_parallel)
    if mesh.get_strategy_size("EP") > 1:
        for moe in [m for m in model.modules() if hasattr(m, "router") and hasattr(m, "experts")]:
            parallelize_module(moe.experts, mesh["EP"], ExpertParallel())
    model.checkpoint_blocks = activation_checkpointing
    if compile:  # whole graphs, but where the CP ring runs eagerly, or a MoE's routing sizes its tensors by the data
        for block in model.h.values():
            block.compile(fullgraph=mesh.get_strategy_size("CP") == 1 and not isinstance(block.mlp, MoE))
    if data_parallel == "fsdp":
        options = {} if mp_policy is None else {"mp_policy": mp_policy}
        for block in model.h.values():
            fully_shard(block, mesh=mesh, **options)
        return fully_shard(model, mesh=mesh, **options)
    if data_parallel == "ddp":
        return DistributedDataParallel(model, **ddp_options)
    return model
