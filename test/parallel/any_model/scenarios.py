"""What each rank runs in test_any_model.py: a Llama-style model that is not the example's GPT, parallelized with
vemesh's library APIs only, trained 3 steps, and compared with one process training on the global batch.

Each case returns its loss per step (the mean over the global batch) and the largest difference of any final
parameter from the one-process run; every rank also computes that run itself (the model is small).
"""

from __future__ import annotations

import functools
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import llama  # noqa: E402
import parity  # noqa: E402

from vemesh import VESCALE_DEVICE_MESH as mesh  # noqa: E402
from vemesh.parallel import ExpertParallel, ExpertTensorParallel, ParallelDims, context_parallel  # noqa: E402

STEPS, BATCH, SEQ, LR = 3, 4, 32, 1e-3
EPS = 1e-6  # AdamW turns a rounding difference in a near-zero gradient into a step of lr: bound it


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def reference(moe: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the global batch, torch's AdamW."""
    model = llama.make(moe_experts=moe)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        loss = llama.loss_fn(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def train(dims: ParallelDims, moe: int, wrap: str, optimizer: str = "adamw", ac: bool = False) -> dict[str, Any]:
    dims.build("cpu", mesh)
    model = llama.make(moe_experts=moe)
    if ac:  # activation checkpointing of every block (non-reentrant): backward recomputes SDPA, inside the context
        for block in model.layers.values():
            block.forward = functools.partial(checkpoint, type(block).forward, block, use_reentrant=False)
    if dims.tp > 1:  # attention over TP (torch's plan); each expert split over TP inside its EP rank (expert TP)
        for block in model.layers.values():
            parallelize_module(block, mesh["TP"], {"attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
                                                   "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel()})
            parallelize_module(block.feed_forward.experts, mesh["EP", "TP"], ExpertTensorParallel())
    elif dims.ep > 1:  # each EP rank keeps E / EP experts of every block; tokens travel over mesh["EP"]
        for block in model.layers.values():
            parallelize_module(block.feed_forward.experts, mesh["EP"], ExpertParallel())
    rope = [model.rope_cos, model.rope_sin]
    model = parity.wrap(model, model.layers.values(), wrap)  # DDP's default: dp_cp with CP, experts over EDP
    opt = parity.optimizer(model, optimizer, lr=LR, eps=EPS)
    rows = mesh.lookup_rank("DP")
    data = mesh.get_group(dims.grad_dim) if dims.grad_dim else None
    cp = mesh["CP"] if dims.cp > 1 else None
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = (t.chunk(dims.dp)[rows].clone() for t in batch(step))
        with context_parallel(cp, buffers=[x, y, *rope], buffer_seq_dims=[1, 1, 0, 0]) if cp else _nothing():
            loss = llama.loss_fn(model(x), y)
            loss.backward()
        opt.step()
        losses.append(parity.mean_over(loss, data))
    params = parity.whole_params(model)
    mesh.reset()
    return {"losses": losses, "params": params}


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


compare = parity.compare


CASES_4 = {  # name: (degrees, MoE experts, wrapper, optimizer[, activation checkpointing])
    "dp2-cp2-ddp": (dict(cp=2), 0, "ddp", "adamw"),
    "dp2-cp2-ddp-checkpointed": (dict(cp=2), 0, "ddp", "adamw", True),
    "dp2-cp2-fsdp2": (dict(cp=2), 0, "fsdp", "adamw"),
    "ep2-over-dp4-ddp": (dict(ep=2), 4, "ddp", "adamw"),
    "ep2-over-dp4-zero1": (dict(ep=2), 4, "ddp", "zero1"),
    "ep2-over-dp4-fsdp2": (dict(ep=2), 4, "fsdp", "adamw"),
    "cp2-ep2-ddp": (dict(cp=2, ep=2), 4, "ddp", "adamw"),
    "cp2-ep2-fsdp2": (dict(cp=2, ep=2), 4, "fsdp", "adamw"),
    "ep2-tp2-expert-tp-ddp": (dict(tp=2, ep=2), 4, "ddp", "adamw"),
    "ep2-tp2-expert-tp-zero1": (dict(tp=2, ep=2), 4, "ddp", "zero1"),
    "ep2-tp2-expert-tp-fsdp2": (dict(tp=2, ep=2), 4, "fsdp", "adamw"),
}
class _Attention(nn.Module):
    """Attention whose TP plan keeps q, k and v DTensors into SDPA (its views take the global head count), as
    pytorch/examples' Llama2 does: on CPU, torch's attention kernel then runs under vemesh's DTensor rule for it."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, self.heads, -1).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        return self.wo(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))


def _adamw_steps(model: nn.Module) -> list[float]:
    """``STEPS`` AdamW steps of a token model (vocabulary 256) on the whole batch of each step; each step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, eps=EPS)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        x, y = batch(step)
        loss = F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _attention_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(256, 32), _Attention(), nn.Linear(32, 256))


def attention_on_dtensors(world_size: int) -> dict[str, Any]:
    """TP over every rank with the attention's inputs DTensors (heads sharded), 3 AdamW steps, against one process."""
    ref = _attention_model()
    ref_losses = _adamw_steps(ref)
    ParallelDims(world_size, tp=world_size).build("cpu", mesh)
    try:
        model = _attention_model()
        parallelize_module(model[1], mesh["TP"], {"wq": ColwiseParallel(use_local_output=False),
                                                  "wk": ColwiseParallel(use_local_output=False),
                                                  "wv": ColwiseParallel(use_local_output=False), "wo": RowwiseParallel()})
        losses = _adamw_steps(model)
        params = {n: p.full_tensor() if hasattr(p, "full_tensor") else p for n, p in model.named_parameters()}
    finally:
        mesh.reset()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "param_diff": max((params[n] - p).abs().max().item() for n, p in ref.named_parameters())}


class _HeadNormAttention(nn.Module):
    """Attention with an RMSNorm over each head's queries and keys (Qwen3's q/k norms). Its views take ``-1`` heads, so
    under TP with local outputs each rank normalises its own heads: the norms' weights see only those."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(dim, dim, bias=False) for _ in range(4))
        self.q_norm, self.k_norm = nn.RMSNorm(self.head_dim), nn.RMSNorm(self.head_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = (w(x).view(b, s, -1, self.head_dim) for w in (self.wq, self.wk, self.wv))
        q, k = self.q_norm(q), self.k_norm(k)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


def norms_over_local_heads(world_size: int, wrap: str = "ddp") -> dict[str, Any]:
    """TP = 2 with vemesh DDP (over DP = world / 2, 1 on 2 ranks) or FSDP2 (DP = 2 on 4): with the q/k norms left
    plain, the first backward (DDP) or optimizer step (FSDP2) raises, since each TP rank's norm gradient is its own
    heads'; with them sharded on the head dim (SequenceParallel(sequence_dim=2)), 3 AdamW steps match one process
    (every DP rank trains on the whole batch, whose mean is the one process's)."""
    from torch.distributed.tensor.parallel import SequenceParallel

    from vemesh.ddp import DistributedDataParallel
    from vemesh.parallel import fully_shard

    def make() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(256, 32), _HeadNormAttention(), nn.Linear(32, 256))

    ref = make()
    ref_losses = _adamw_steps(ref)
    plan = {"wq": ColwiseParallel(), "wk": ColwiseParallel(), "wv": ColwiseParallel(), "wo": RowwiseParallel()}
    heads = {"q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
             "k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)}
    out: dict[str, Any] = {}
    for styled in (False, True):
        ParallelDims(world_size, tp=2, mesh_dims=("DP", "TP")).build("cpu", mesh)
        try:
            model = make()
            parallelize_module(model[1], mesh["TP"], {**plan, **(heads if styled else {})})
            model = DistributedDataParallel(model) if wrap == "ddp" else fully_shard(model)
            try:
                losses = _adamw_steps(model)
            except RuntimeError as e:
                out["unstyled" if not styled else "styled_error"] = str(e)
                continue
            params = {n.removeprefix("module."): p.full_tensor() if hasattr(p, "full_tensor") else p
                      for n, p in model.named_parameters()}  # FSDP2's: gathered over DP (and TP)
        finally:
            mesh.reset()
        if styled:
            out["loss_diff"] = max(abs(a - b) for a, b in zip(losses, ref_losses))
            out["param_diff"] = max((params[n] - p).abs().max().item() for n, p in ref.named_parameters())
    return out


class _SideBySide(nn.Module):
    """A block whose attention-like and MLP branches both read its input and are added to it (GPT-J's, Cohere's),
    under torch's non-reentrant checkpoint."""

    def __init__(self, early_stop: bool) -> None:
        super().__init__()
        self.wv, self.wo = nn.Linear(32, 32, bias=False), nn.Linear(32, 32, bias=False)
        self.w1, self.w2 = nn.Linear(32, 64, bias=False), nn.Linear(64, 32, bias=False)
        self.early_stop = early_stop

    def branches(self, x: torch.Tensor) -> torch.Tensor:
        attention = self.wo(self.wv(x))
        mlp = self.w2(F.relu(self.w1(x)))
        return x + attention + mlp  # the first branch's output read only here, after the second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return checkpoint(self.branches, x, use_reentrant=False, early_stop=self.early_stop)


def side_by_side_checkpointed(world_size: int, wrap: str = "ddp") -> dict[str, Any]:
    """TP = 2 with vemesh DDP (or FSDP2, ``wrap="fsdp"``, over DP = 2 on 4 ranks) over two side-by-side blocks under
    torch's checkpoint: recomputed whole (``early_stop=False``), nothing is left unwaited and nothing is said; stopped
    early (torch's default), the recompute issues the first branch's all-reduce and stops before anything reads it,
    torch's work registry holds it every step, and the first averaged backward (FSDP2: the first optimizer step)
    warns once. Both train as one process does. Run in that order: what the second leaves stays held."""
    import warnings

    from vemesh.ddp import DistributedDataParallel
    from vemesh.parallel import fully_shard, tp_replicas

    def make(early_stop: bool) -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Embedding(256, 32), _SideBySide(early_stop), _SideBySide(early_stop),
                             nn.Linear(32, 256))

    ref = make(True)
    ref_losses = _adamw_steps(ref)
    plan = {"wv": ColwiseParallel(), "wo": RowwiseParallel(), "w1": ColwiseParallel(), "w2": RowwiseParallel()}
    out: dict[str, Any] = {"loss_diff": 0.0, "param_diff": 0.0}
    for early_stop in (False, True):
        ParallelDims(world_size, tp=2, mesh_dims=("DP", "TP")).build("cpu", mesh)
        tp_replicas._WARNED.clear()
        try:
            model = make(early_stop)
            for block in model[1:3]:
                parallelize_module(block, mesh["TP"], plan)
            model = DistributedDataParallel(model) if wrap == "ddp" else fully_shard(model)
            before = torch._C._distributed_c10d._get_work_registry_size()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                losses = _adamw_steps(model)
            said = [str(w.message) for w in caught if "MEMORY LEAK" in str(w.message)]
            held = torch._C._distributed_c10d._get_work_registry_size() - before
            out["stopped early" if early_stop else "whole"] = {"said": said, "held": held}
            params = {n.removeprefix("module."): p.full_tensor() if hasattr(p, "full_tensor") else p
                      for n, p in model.named_parameters()}
        finally:
            mesh.reset()
        out["loss_diff"] = max(out["loss_diff"], *(abs(a - b) for a, b in zip(losses, ref_losses)))
        out["param_diff"] = max(out["param_diff"], *((params[n] - p).abs().max().item()
                                                     for n, p in ref.named_parameters()))
    return out


#: name: (degrees, MoE experts, wrapper, optimizer), or a function of the world size that returns the differences
CASES_2 = {"cp2-ddp": (dict(cp=2), 0, "ddp", "adamw"), "tp2-attention-on-dtensors": attention_on_dtensors,
           "tp2-norms-over-local-heads": norms_over_local_heads,
           "tp2-side-by-side-checkpointed": side_by_side_checkpointed}
CASES_4["dp2-tp2-norms-over-local-heads-fsdp2"] = functools.partial(norms_over_local_heads, wrap="fsdp")
CASES_4["dp2-tp2-side-by-side-checkpointed-fsdp2"] = functools.partial(side_by_side_checkpointed, wrap="fsdp")


def worker(rank: int, world_size: int, cases: dict[str, Any]) -> dict[str, Any]:
    refs = {moe: reference(moe) for moe in {c[1] for c in cases.values() if not callable(c)}}
    out: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            if callable(case):
                out[name] = case(world_size)
                continue
            degrees, moe, wrap, optimizer, *ac = case
            got = train(ParallelDims(world_size, **degrees), moe, wrap, optimizer, *ac)
            out[name] = compare(got, refs[moe])
        except Exception:  # noqa: BLE001 - reported back to pytest
            out[name] = {"error": traceback.format_exc()}
            mesh.reset()
    return out


def broadcast_trap(rank: int, world_size: int) -> dict[str, Any]:
    """DP=2 x CP=2 with DDP's buffer broadcast also over the sharded RoPE tables (what torch's DDP would do):
    the control that shows the exactness test would see the trap."""
    import vemesh.parallel.ddp.distributed_data_parallel as ddp_module

    ddp_module.sharded_buffers = lambda: set()
    return compare(train(ParallelDims(world_size, cp=2), 0, "ddp"), reference(0))


def checkpointed_backward_outside(rank: int, world_size: int) -> dict[str, Any]:
    """SDPA under activation checkpointing inside the context, backward after it: refused at the exit."""
    ParallelDims(world_size, cp=2).build("cpu", mesh)
    attention = llama.Attention(llama.LlamaConfig())
    cos, sin = llama.rope_tables(16, 32, 1e4)
    x = torch.randn(1, 32, 64, requires_grad=True)
    out: dict[str, Any] = {}
    try:
        with context_parallel(mesh["CP"], buffers=[cos, sin], buffer_seq_dims=[0, 0]):
            part = x[:, :16] if mesh.lookup_rank("CP") == 0 else x[:, 16:]
            y = torch.utils.checkpoint.checkpoint(attention, part, cos, sin, use_reentrant=False)
    except RuntimeError as e:
        out["refused"] = str(e)
    with context_parallel(mesh["CP"], buffers=[cos, sin], buffer_seq_dims=[0, 0]):  # the fix: backward inside
        y = torch.utils.checkpoint.checkpoint(attention, part, cos, sin, use_reentrant=False)
        y.sum().backward()
    out["inside"] = x.grad is not None
    mesh.reset()
    return out
