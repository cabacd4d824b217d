"""Llama 3 parallelized as torchtitan does it: TP with sequence parallelism and a vocabulary-parallel loss, activation
checkpointing (``none``, ``full``, ``selective-op``, ``selective-N``), FSDP2 (HSDP on a mesh that splits DP) or
vemesh DDP, and pipeline stages for every torch schedule. CP is the step's (``context_parallel`` around it).
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from vemesh.ddp import DistributedDataParallel
from vemesh.layout.names import divisors, listed
from vemesh.models.gpt.stages import copy_stage
from vemesh.parallel.schedules import split_layers
from vemesh.models.llama3.config import AC_MODES, check_ac
from vemesh.models.llama3.model import Llama3
from vemesh.parallel import fully_shard

__all__ = ["AC_MODES", "activation_checkpointing", "apply_tp", "check_ac", "cut_stage", "recomputes",
           "selective_op_policy"]

#: The ops whose outputs torchtitan's per-op policy keeps (every other matmul's, attention's, the TP reduce-scatter's,
#: the max's); every other op in a block is recomputed in backward.
_SAVED = {torch.ops.aten.mm.default, torch.ops.aten.max.default,
          torch.ops.aten._scaled_dot_product_efficient_attention.default,
          torch.ops.aten._scaled_dot_product_flash_attention.default,
          torch.ops.aten._scaled_dot_product_cudnn_attention.default,
          torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
          torch.ops._c10d_functional.reduce_scatter_tensor.default}


def selective_op_policy() -> Any:
    """torchtitan's per-op rule as a ``create_selective_checkpoint_contexts`` policy: keep the outputs of the ops in
    :data:`_SAVED`, but recompute every second matmul (counted apart in the forward and in the recompute)."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
        phase = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[phase] += 1
        keep = func in _SAVED and not (func == torch.ops.aten.mm.default and counts[phase] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _selective_op_contexts() -> Any:
    """``context_fn`` of ``selective-op``, called at each checkpointed forward: a policy of its own, whose matmul count
    starts afresh (as torchtitan's; one policy for all of a block's forwards counted on, and with a block's 7 matmuls
    kept another 3 or 4 every other step)."""
    return create_selective_checkpoint_contexts(selective_op_policy())


def recomputes(mode: str, block: int) -> bool:
    """Whether ``mode`` (:func:`check_ac`) wraps block number ``block`` (the full model's numbering) for recompute:
    ``selective-N`` every N-th from block 0, ``full`` and ``selective-op`` every block, ``none`` none."""
    mode = check_ac(mode)
    every = int(mode.rsplit("-", 1)[1]) if mode[len("selective-"):].isdigit() else 1
    return mode != "none" and block % every == 0


def activation_checkpointing(model: Llama3, mode: str) -> None:
    """Wrap the blocks' forwards for ``mode`` (:func:`check_ac`): ``full`` recomputes every block from its input,
    ``selective-op`` keeps what :func:`selective_op_policy` saves, ``selective-N`` recomputes blocks 0, N, 2N, ...
    whole (block numbers are the full model's, so every pipeline stage agrees)."""
    mode = check_ac(mode)
    for key, block in model.layers.items():
        if not recomputes(mode, int(key)):
            continue
        kwargs: dict[str, Any] = {"use_reentrant": False}
        if mode == "selective-op":
            kwargs["context_fn"] = _selective_op_contexts
        block.forward = functools.partial(checkpoint, type(block).forward, block, **kwargs)


def apply_tp(model: Llama3, tp_mesh: Any, *, sequence_parallel: bool = True) -> None:
    """torchtitan's plan on ``tp_mesh``: attention and SwiGLU column- then row-wise; with sequence parallelism the
    norms and the residual stream sharded on the sequence; the head's logits left sharded on the vocabulary for
    ``loss_parallel``. The query and KV heads must divide by the TP degree."""
    tp = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_kv_heads % tp:
        raise ValueError(f"TP {tp} does not divide Llama 3's {cfg.n_kv_heads} KV heads; choose TP from "
                         f"{listed(divisors(cfg.n_kv_heads))}")
    seq = Shard(1) if sequence_parallel else Replicate()
    top: dict[str, Any] = {}
    if model.tok_embeddings is not None:
        top["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=seq)
    if model.norm is not None:
        top.update({"norm": SequenceParallel()} if sequence_parallel else {})
        top["output"] = ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False)
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers.values():
        plan: dict[str, Any] = {
            "attention": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp_mesh, plan)


def cut_stage(model: Llama3, stage: int, n_stages: int) -> Llama3:
    """A copy of ``model`` holding stage ``stage``'s blocks (as even as possible, earlier stages taking the rest),
    the embedding on the first stage and the norm and head on the last; every parameter keeps its full-model name."""
    return copy_stage(model, "layers", {str(i) for i in split_layers(len(model.layers), n_stages)[stage]},
                      ("tok_embeddings",) * (stage != 0) + ("norm", "output") * (stage != n_stages - 1))


def parallelize(model: nn.Module, mesh: Any, *, dp_mode: str = "fsdp", ac: str = "full", sequence_parallel: bool = True,
                param_dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """One model (or one pipeline stage) on ``mesh`` (the mesh manager): TP where the mesh has TP, ``ac``'s
    checkpointing, then FSDP2 on each block and the root (``dp_mode="fsdp"``, computing in ``param_dtype`` with fp32
    gradient reduction; HSDP where the mesh splits DP) or vemesh DDP (``"ddp"``, ``"zero1"``) where the mesh has
    data-parallel ranks."""
    if mesh.get_strategy_size("TP") > 1:
        apply_tp(model, mesh["TP"], sequence_parallel=sequence_parallel)
    activation_checkpointing(model, ac)
    data = mesh.get_strategy_size("DP") * mesh.get_strategy_size("CP")
    if data == 1:
        return model
    if dp_mode == "fsdp":
        policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
        pipelined = mesh.get_strategy_size("PP") > 1  # torchtitan keeps a stage's blocks gathered across micro-batches
        for block in model.layers.values():
            fully_shard(block, mp_policy=policy, reshard_after_forward=not pipelined)
        return fully_shard(model, mp_policy=policy, reshard_after_forward=not pipelined)
    return DistributedDataParallel(model)
