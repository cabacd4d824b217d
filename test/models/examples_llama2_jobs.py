"""pytorch/examples' Llama2 as that repository ships it (``distributed/tensor_parallelism/llama2_model.py``, whose
constructor initialises with ``nn.init.trunc_normal_``), and what a user of its ``fsdp_tp_example.py`` writes for
vemesh: the factory, parallelize functions and a step that ``vemesh plan --model module:...`` and
``bench/plan_user_run.py`` run.

pytorch/examples is a repository, not a package: set ``PYTORCH_EXAMPLES`` to a checkout of
https://github.com/pytorch/examples (``git clone --depth 1 https://github.com/pytorch/examples``). Nothing of it is
copied here; the model file is imported from the checkout, unchanged.

TP is the example's own plan (TP with sequence parallelism: the embedding row-wise into a sequence-sharded
residual stream, the norms ``SequenceParallel``, attention and SwiGLU column- then row-wise), by its module names,
on ``mesh["TP"]``; data parallelism is FSDP2 on the model, as the example shards it, or vemesh DDP (ZeRO-1 is the
optimizer's).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import fully_shard

#: where llama2_model.py lies in a checkout of pytorch/examples
MODEL_DIR = Path("distributed") / "tensor_parallelism"


def model_dir() -> Path | None:
    """The checkout's ``distributed/tensor_parallelism`` from ``PYTORCH_EXAMPLES``, or None when it is not set or
    holds no ``llama2_model.py``."""
    root = os.environ.get("PYTORCH_EXAMPLES")
    where = Path(root) / MODEL_DIR if root else None
    return where if where is not None and (where / "llama2_model.py").is_file() else None


def _llama2():  # type: ignore[no-untyped-def]
    where = model_dir()
    if where is None:
        raise ImportError(f"pytorch/examples' Llama2 needs PYTORCH_EXAMPLES set to a checkout of "
                          f"https://github.com/pytorch/examples (with {MODEL_DIR / 'llama2_model.py'}); "
                          f"got {os.environ.get('PYTORCH_EXAMPLES')!r}")
    if str(where) not in sys.path:
        sys.path.insert(0, str(where))
    import llama2_model

    return llama2_model


SEQ, VOCAB = 256, 32000


def make() -> nn.Module:
    """``Transformer.from_model_args`` with the example's own config (``fsdp_tp_example.py``: width 256, 2 layers,
    16 heads, vocab 32000)."""
    llama2 = _llama2()
    return llama2.Transformer.from_model_args(llama2.ModelArgs(dim=256, n_layers=2, n_heads=16, vocab_size=VOCAB))


def _tp(model: nn.Module, mesh) -> None:
    """The example's TP + SP plan, by its module names (when the mesh has TP)."""
    if mesh.get_strategy_size("TP") == 1:
        return
    tp = mesh["TP"]
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, tp, {
            "attention_norm": SequenceParallel(),
            "attention": PrepareModuleInput(input_layouts=(Shard(1), Replicate()),
                                            desired_input_layouts=(Replicate(), Replicate())),
            "attention.wq": ColwiseParallel(use_local_output=False),
            "attention.wk": ColwiseParallel(use_local_output=False),
            "attention.wv": ColwiseParallel(use_local_output=False),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
            "feed_forward.w3": ColwiseParallel(),
        })


def parallelize_fsdp(model: nn.Module, mesh) -> nn.Module:
    """The example's TP + SP plan, then FSDP2 on the whole model over the data dims, as the example shards it."""
    _tp(model, mesh)
    return fully_shard(model)


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:
    """The example's TP + SP plan, then vemesh DDP over the mesh's data dims."""
    _tp(model, mesh)
    return DistributedDataParallel(model)


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """One forward and backward of ``micro_batch_size`` sequences of 256 tokens: the next-token loss."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()
