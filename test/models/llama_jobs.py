"""What a user of vemesh writes for ``llama.py``: factories, parallelize functions and a step, the three things
``vemesh plan --model module:... --parallelize ... --step ...`` runs, and that a training script runs too.

Nothing here is vemesh's own code path for this model: it is the kind of code a user writes, with torch's
``parallelize_module`` for TP (torchtitan's Llama plan, with or without sequence parallelism), vemesh's
``ExpertParallel``, ``context_parallel`` and ``fully_shard``, vemesh's DDP, and torch's activation checkpointing.
``bench/plan_accuracy.py`` plans each job and measures it in a real gloo run with the same functions.
"""

from __future__ import annotations

import functools
import sys
from contextlib import nullcontext
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llama  # noqa: E402

from vemesh.ddp import DistributedDataParallel  # noqa: E402
from vemesh.parallel import ExpertParallel, context_parallel, fully_shard  # noqa: E402

SMALL = dict(vocab_size=512, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, hidden_dim=512, max_seq_len=128)


def make_dense() -> nn.Module:
    return llama.make(**SMALL)


def make_moe() -> nn.Module:
    return llama.make(**SMALL, moe_experts=4)


def make_dense_trunc_normal() -> nn.Module:
    """``make_dense`` initialised as pytorch/examples' Llama2 and torchtitan's models are: every Linear and Embedding
    weight ``nn.init.trunc_normal_`` in the constructor (which samples until its values fit: on fake tensors it would
    need them; on the meta device it is a no-op)."""
    model = make_dense()
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.trunc_normal_(module.weight, mean=0.0, std=0.02, a=-0.06, b=0.06)
    return model


def make_8b() -> nn.Module:
    """Llama-3.1-8B's shape: 32 blocks of width 4096, 32 query and 8 KV heads, SwiGLU 14336, vocab 128256, sequences
    of 8192 (torchtitan's default)."""
    return llama.Llama(llama.LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8,
                                         hidden_dim=14336, max_seq_len=8192, rope_theta=500000.0))


def make_70b() -> nn.Module:
    """Llama-3-70B's shape: 80 blocks of width 8192, 64 query and 8 KV heads, SwiGLU 28672, vocab 128256."""
    return llama.Llama(llama.LlamaConfig(vocab_size=128256, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8,
                                         hidden_dim=28672, max_seq_len=8192, rope_theta=500000.0))


def _tp(model: llama.Llama, mesh, sequence_parallel: bool) -> None:
    """torchtitan's Llama plan: attention and SwiGLU column- then row-wise; with SP, norms and the residual stream
    sharded on the sequence."""
    tp = mesh["TP"]
    seq = Shard(1) if sequence_parallel else Replicate()
    parallelize_module(model, tp, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Replicate()),
        **({"norm": SequenceParallel()} if sequence_parallel else {}),
    })
    for block in model.layers.values():
        plan = {
            "attention": PrepareModuleInput(input_layouts=(seq, None, None), desired_input_layouts=(Replicate(), None, None)),
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=seq),
            "feed_forward": PrepareModuleInput(input_layouts=(seq,), desired_input_layouts=(Replicate(),)),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=seq),
        }
        if sequence_parallel:
            plan.update({"attention_norm": SequenceParallel(), "ffn_norm": SequenceParallel()})
        parallelize_module(block, tp, plan)


def _model_parallel(model: llama.Llama, mesh, sequence_parallel: bool, checkpointed: bool) -> None:
    if mesh.get_strategy_size("TP") > 1:
        _tp(model, mesh, sequence_parallel)
    for block in model.layers.values():
        if mesh.get_strategy_size("EP") > 1 and isinstance(block.feed_forward, llama.MoE):
            parallelize_module(block.feed_forward.experts, mesh["EP"], ExpertParallel())
        if checkpointed:  # each block recomputed in backward (non-reentrant, as torchtitan's "full" AC)
            block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=False)


def parallelize_fsdp(model: llama.Llama, mesh) -> nn.Module:
    """TP with sequence parallelism (when the mesh has TP), EP (when it has EP), FSDP2 on each block and the root."""
    _model_parallel(model, mesh, sequence_parallel=True, checkpointed=False)
    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


def parallelize_ddp(model: llama.Llama, mesh) -> nn.Module:
    """TP without sequence parallelism, EP, and vemesh DDP over the mesh's data dims (ZeRO-1 is the optimizer's)."""
    _model_parallel(model, mesh, sequence_parallel=False, checkpointed=False)
    return DistributedDataParallel(model)


def parallelize_torch_ddp(model: llama.Llama, mesh) -> nn.Module:
    """torch's own DDP over the mesh's DP group, as a torch user wraps a model (its gradients beside its buckets)."""
    return nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group())


def parallelize_torch_ddp_bucket_view(model: llama.Llama, mesh) -> nn.Module:
    """torch's own DDP with ``gradient_as_bucket_view=True``: each ``.grad`` a view into its bucket."""
    return nn.parallel.DistributedDataParallel(model, process_group=mesh["DP"].get_group(),
                                               gradient_as_bucket_view=True)


def parallelize_torch_replicate(model: llama.Llama, mesh) -> nn.Module:
    """torch's composable DDP, as torchtitan applies it (``replicate``; torch's DDP, built at the first forward)."""
    from torch.distributed._composable.replicate import replicate

    return replicate(model, device_mesh=mesh["DP"])


def parallelize_checkpointed(model: llama.Llama, mesh) -> nn.Module:
    """TP with sequence parallelism (when the mesh has TP), every block under activation checkpointing, then FSDP2:
    torchtitan's Llama recipe with full activation checkpointing."""
    _model_parallel(model, mesh, sequence_parallel=True, checkpointed=True)
    for block in model.layers.values():
        fully_shard(block)
    return fully_shard(model)


def before_optimizer(model: nn.Module) -> None:
    """What a training loop does between the last backward and ``optimizer.step()``: clip the gradients' global
    norm (vemesh's ``clip_grad_norm_``, for DTensor and plain gradients alike), and all-reduce the loss over every
    rank for the log (``--before-optimizer``)."""
    import torch.distributed as dist

    from vemesh.optim import clip_grad_norm_

    clip_grad_norm_(model.parameters(), 1.0)
    dist.all_reduce(torch.zeros(()))


def _core(model: nn.Module) -> llama.Llama:
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model  # torch's, or vemesh's


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """One forward and backward of ``micro_batch_size`` sequences; under CP, inside ``context_parallel``."""
    from vemesh import VESCALE_DEVICE_MESH as mesh

    core = _core(model)
    tokens = torch.randint(0, core.cfg.vocab_size, (micro_batch_size, core.cfg.max_seq_len + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    cp = mesh.get_strategy_size("CP") > 1
    rope = [core.rope_cos, core.rope_sin]
    with context_parallel(mesh["CP"], buffers=[x, y, *rope], buffer_seq_dims=[1, 1, 0, 0]) if cp else nullcontext():
        loss = llama.loss_fn(model(x), y)
        loss.backward()
    return loss.detach()


def _pipeline(model: llama.Llama, mesh, schedule: str, wrap) -> list:
    """This PP rank's stages, as torchtitan's ``pipeline_llm`` cuts them: the whole model copied per stage, the other
    stages' blocks deleted, the embedding on the first stage and the norm and head on the last; each stage wrapped
    (``wrap(part, mesh)``) and given to torch's ``PipelineStage`` on ``mesh["PP"]``'s group."""
    import copy

    from torch.distributed.pipelining import PipelineStage

    from vemesh.parallel.schedules import stage_indices, stages_per_rank

    pp = mesh.get_strategy_size("PP")
    n_stages = pp * stages_per_rank(schedule)
    per = len(model.layers) // n_stages
    stages = []
    for s in stage_indices(mesh.lookup_rank("PP"), pp, schedule):
        part = copy.deepcopy(model)
        for key in list(part.layers.keys()):
            if not s * per <= int(key) < (s + 1) * per:
                del part.layers[key]
        if s != 0:
            part.tok_embeddings = None
        if s != n_stages - 1:
            part.norm = part.output = None
        stages.append(PipelineStage(wrap(part, mesh), s, n_stages, torch.device("cpu"), group=mesh["PP"].get_group()))
    return stages


def _ddp_chunk(part: llama.Llama, mesh) -> nn.Module:
    _model_parallel(part, mesh, sequence_parallel=False, checkpointed=False)
    return DistributedDataParallel(part)


def parallelize_pp_1f1b(model: llama.Llama, mesh) -> list:
    """PP with torch's 1F1B (one stage per PP rank), TP without sequence parallelism, vemesh DDP per stage."""
    return _pipeline(model, mesh, "1f1b", _ddp_chunk)


def parallelize_pp_1f1b_torch_ddp(model: llama.Llama, mesh) -> list:
    """PP with torch's 1F1B, torch's own DDP per stage over the mesh's DP group."""
    return _pipeline(model, mesh, "1f1b", lambda part, mesh: nn.parallel.DistributedDataParallel(
        part, process_group=mesh["DP"].get_group()))


def parallelize_pp_interleaved(model: llama.Llama, mesh) -> list:
    """PP with torch's interleaved 1F1B (two stages per PP rank, round-robin), TP, vemesh DDP per stage."""
    return _pipeline(model, mesh, "interleaved-1f1b", _ddp_chunk)


def step_pp(schedule, batch_size: int) -> None:
    """One step of a DP rank's batch through torch's pipeline schedule (it splits the batch into micro-batches)."""
    tokens = torch.randint(0, SMALL["vocab_size"], (batch_size, SMALL["max_seq_len"] + 1))
    schedule.step(tokens[:, :-1].contiguous(), target=tokens[:, 1:].contiguous(), losses=[], return_outputs=False)


def parallelize_any(model: llama.Llama, mesh):
    """A script that runs on any mesh, as a search with ``--loss`` plans it: 1F1B stages where the mesh has PP, else
    the whole model; TP inside, and vemesh DDP where the mesh has data-parallel ranks."""
    def wrap(part: llama.Llama, mesh) -> nn.Module:
        _model_parallel(part, mesh, sequence_parallel=False, checkpointed=False)
        return DistributedDataParallel(part) if mesh.get_strategy_size("DP") > 1 else part

    if mesh.get_strategy_size("PP") > 1:
        return _pipeline(model, mesh, "1f1b", wrap)
    return wrap(model, mesh)


def step_any(model_or_schedule, batch_size: int):
    """:func:`step_pp` given a pipeline schedule (a DP rank's batch), else :func:`step` (a micro-batch)."""
    if isinstance(model_or_schedule, nn.Module):
        return step(model_or_schedule, batch_size)
    return step_pp(model_or_schedule, batch_size)


loss_fn = llama.loss_fn


def step_amp(model: nn.Module, micro_batch_size: int, device_type: str = "cuda") -> torch.Tensor:
    """:func:`step` under torch's automatic mixed precision, as a CUDA training loop writes it: the forward and the
    loss in ``torch.autocast(device_type, dtype=torch.bfloat16)``, the parameters staying fp32."""
    with torch.autocast(device_type, dtype=torch.bfloat16):
        return step(model, micro_batch_size)


def step_amp_cpu(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """:func:`step_amp` with CPU autocast."""
    return step_amp(model, micro_batch_size, "cpu")


def parallelize_fsdp_compiled(model: llama.Llama, mesh) -> nn.Module:
    """``parallelize_fsdp`` with each block compiled whole before FSDP2 shards it, as torchtitan's parallelize does
    (``apply_compile``: ``fullgraph=True``)."""
    _model_parallel(model, mesh, sequence_parallel=True, checkpointed=False)
    for block in model.layers.values():
        block.compile(fullgraph=True)
        fully_shard(block)
    return fully_shard(model)


def make_dense_frozen() -> nn.Module:
    """``make_dense`` as a fine-tune freezes it: the token embedding and every norm's weight frozen (read by index
    and by an elementwise product: no op returns them, so a tracker sees them only where it was told of them)."""
    model = make_dense()
    for name, p in model.named_parameters():
        if name.startswith("tok_embeddings") or "norm" in name:
            p.requires_grad_(False)
    return model
