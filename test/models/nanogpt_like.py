"""A GPT written the way nanoGPT and GPT-2 write theirs, in this project's own words, and the plans ``vemesh check``
is tested on: the right ones, and the plausible wrong ones it must name.

The model's shape is theirs: one fused ``c_attn`` Linear whose output is split into q, k and v with *global* sizes
(``split(n_embd, dim=2)``, ``view(B, T, n_head, C // n_head)``), and the token embedding tied to the head
(``transformer.wte.weight = lm_head.weight``). The right TP plan (:func:`parallelize`) is vemesh's recipe for that
shape: ``FusedColwiseParallel(3, use_local_output=False)`` so that the forward's global sizes see a DTensor of the
global shape, and ``vemesh.parallel.parallelize_module`` so that the tied weight stays one parameter (the embedding
``RowwiseParallel`` and the head ``ColwiseParallel``, both ``Shard(0)`` of ``[vocab, n_embd]``).

``LocalBlock`` models (:func:`make_local`) read the fused output as *local* heads (``view(B, T, 3, -1, hs)``), as
``examples/my_model`` does: the shape for which torch's ``ColwiseParallel`` on the fused Linear is silently wrong.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module as torch_parallelize_module)

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import FusedColwiseParallel, parallelize_module

SMALL = dict(vocab=96, block_size=32, n_layer=2, n_head=4, n_embd=32)


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.resid_dropout = nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout = n_head, n_embd, dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, n_embd: int, dropout: float) -> None:
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(n_embd, 4 * n_embd), nn.Linear(4 * n_embd, n_embd)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn, self.mlp = CausalSelfAttention(n_embd, n_head, dropout), MLP(n_embd, dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class LocalBlock(nn.Module):
    """A block whose attention reads the fused output as local heads (``-1``), and which may norm q and k per head
    (``qk_norm``: one LayerNorm over the head dim, shared by every head, as Qwen3's q/k norms)."""

    def __init__(self, n_embd: int, n_head: int, dropout: float, qk_norm: bool = False, noise: bool = False) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.qkv, self.proj = nn.Linear(n_embd, 3 * n_embd), nn.Linear(n_embd, n_embd)
        self.mlp = MLP(n_embd, dropout)
        self.hs = n_embd // n_head
        self.q_norm = nn.LayerNorm(self.hs) if qk_norm else nn.Identity()
        self.noise = Noise() if noise else nn.Identity()  # on this rank's heads: other draws under TP

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.qkv(self.ln_1(x)).view(B, T, 3, -1, self.hs).unbind(2)
        q = self.noise(self.q_norm(q))
        y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, -1))
        return x + self.mlp(self.ln_2(x))


class Noise(nn.Module):
    """Adds noise drawn in the forward (a random op that is not dropout): ``noise=True`` puts it on a LocalBlock's
    q, where each TP rank draws for its own heads (other numbers than one process draws)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + 0.01 * torch.randn_like(x) if self.training else x


class GPT(nn.Module):
    def __init__(self, vocab: int, block_size: int, n_layer: int, n_head: int, n_embd: int, dropout: float = 0.0,
                 local: bool = False, qk_norm: bool = False, noise: bool = False) -> None:
        super().__init__()
        blocks = (LocalBlock(n_embd, n_head, dropout, qk_norm, noise) if local else Block(n_embd, n_head, dropout)
                  for _ in range(n_layer))
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd), wpe=nn.Embedding(block_size, n_embd), drop=nn.Dropout(dropout),
            h=nn.ModuleList(blocks), ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # tied, as nanoGPT and GPT-2 tie them
        for name, p in self.named_parameters():  # GPT-2's init: scaled residual projections
            if name.endswith("c_proj.weight") or name.endswith(".proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * n_layer))
        self.vocab = vocab

    def forward(self, idx: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        return logits, F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)


def make(**kwargs: object) -> GPT:
    return GPT(**{**SMALL, **kwargs})  # type: ignore[arg-type]


def make_local(**kwargs: object) -> GPT:
    return GPT(**{**SMALL, "local": True, **kwargs})  # type: ignore[arg-type]


def make_named(name: str, what: str = "", fn: str = "") -> GPT:
    """A factory whose keyword arguments are named as vemesh's own call of it names its arguments (``--model-kwargs
    name=qk,what=...,fn=...``): they reach the factory, not vemesh."""
    return make_local(**({"qk_norm": True} if name == "qk" else {}))


def step(model: nn.Module, micro_batch_size: int) -> None:
    vocab = SMALL["vocab"]
    tokens = torch.randint(0, vocab, (micro_batch_size, SMALL["block_size"] + 1))
    _, loss = model(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())  # as nanoGPT's get_batch gives them
    loss.backward()


def _ends(model: GPT, mesh: object, parallelize: object = parallelize_module) -> None:
    """The tied ends, both Shard(0) of [vocab, n_embd]: the embedding row-wise, the head column-wise (logits whole)."""
    parallelize(model, mesh["TP"], {  # type: ignore[operator,index]
        "transformer.wte": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate())})


def _data(model: nn.Module, mesh: object) -> nn.Module:
    return DistributedDataParallel(model) if mesh.get_strategy_size("DP") > 1 else model  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------- the right plans
def parallelize(model: GPT, mesh: object) -> nn.Module:
    """nanoGPT's shape under TP: the fused c_attn by chunks (a DTensor for its global-size forward), the tie kept."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {  # type: ignore[index]
            "attn.c_attn": FusedColwiseParallel(3, use_local_output=False), "attn.c_proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    _ends(model, mesh)
    return _data(model, mesh)


def parallelize_local(model: GPT, mesh: object) -> nn.Module:
    """Local heads: the fused qkv by chunks, its local output read as this rank's heads."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {  # type: ignore[index]
            "qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
        if isinstance(block.q_norm, nn.LayerNorm):  # a norm over each rank's own heads: its gradient summed over TP
            torch_parallelize_module(block.q_norm, mesh["TP"], SequenceParallel(sequence_dim=2,  # type: ignore[index]
                                                                                 use_local_output=True))
    _ends(model, mesh)
    return _data(model, mesh)


def parallelize_sp(model: GPT, mesh: object) -> nn.Module:
    """Sequence parallel as torchtitan does it: the residual stream is each TP rank's part of the sequence (a local
    tensor), ln_1 and ln_2 SequenceParallel, each sublayer's input gathered and its output reduce-scattered."""
    return _sp(model, mesh, norm=True)


def _sp(model: GPT, mesh: object, norm: bool) -> nn.Module:
    tp = mesh["TP"]  # type: ignore[index]
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)
    for block in model.transformer.h:
        plan = {"ln_1": SequenceParallel(), "attn": gather,
                "attn.c_attn": FusedColwiseParallel(3, use_local_output=False),
                "attn.c_proj": RowwiseParallel(output_layouts=Shard(1)),
                "mlp": gather, "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel(output_layouts=Shard(1))}
        if norm:
            plan["ln_2"] = SequenceParallel()
        torch_parallelize_module(block, tp, plan)
    # the residual stream is this rank's part of the sequence; through a DTensor, so that the backward gathers it
    # (a plain slice would give wpe this rank's part of its gradient only: vemesh check named wpe when it was)
    model.transformer.drop.register_forward_hook(
        lambda m, args, out: DTensor.from_local(out, tp, [Replicate()]).redistribute(placements=[Shard(1)]).to_local())
    model.transformer.ln_f.register_forward_pre_hook(
        lambda m, args: (DTensor.from_local(args[0], tp, [Shard(1)]).full_tensor(),))
    _ends(model, mesh)
    return _data(model, mesh)


# ---------------------------------------------------------------------------------------------- the wrong plans
def _torch_styles(model: GPT, mesh: object, fused: str, proj: str) -> nn.Module:
    """torch's ColwiseParallel on the fused Linear ``fused``, as on any Linear; the rest as the right plans."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {  # type: ignore[index]
            fused: ColwiseParallel(), proj: RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    _ends(model, mesh)
    return _data(model, mesh)


def wrong_fused_colwise_global(model: GPT, mesh: object) -> nn.Module:
    """torch's ColwiseParallel on nanoGPT's c_attn, read with global sizes: its split by n_embd finds two parts."""
    return _torch_styles(model, mesh, "attn.c_attn", "attn.c_proj")


def wrong_fused_colwise(model: GPT, mesh: object) -> nn.Module:
    """torch's ColwiseParallel on the fused qkv read as local heads: rank 0 gets all of q and half of k."""
    return _torch_styles(model, mesh, "qkv", "proj")


def wrong_untied(model: GPT, mesh: object) -> nn.Module:
    """Both tied ends sharded by torch's parallelize_module: two parameters where there was one."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {  # type: ignore[index]
            "attn.c_attn": FusedColwiseParallel(3, use_local_output=False), "attn.c_proj": RowwiseParallel()})
    _ends(model, mesh, torch_parallelize_module)
    return _data(model, mesh)


def wrong_head_norm(model: GPT, mesh: object) -> nn.Module:
    """A norm over each rank's own heads left replicated: each TP rank's gradient is its own heads' part."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {  # type: ignore[index]
            "qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    _ends(model, mesh)
    return _data(model, mesh)


def wrong_row_input(model: GPT, mesh: object) -> nn.Module:
    """The row-wise proj told that its input is replicated, while it is this rank's heads (local model)."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {  # type: ignore[index]
            "qkv": FusedColwiseParallel(3), "proj": RowwiseParallel(input_layouts=Replicate()),
            "mlp.c_fc": ColwiseParallel(), "mlp.c_proj": RowwiseParallel()})
    _ends(model, mesh)
    return _data(model, mesh)


def wrong_sp_norm(model: GPT, mesh: object) -> nn.Module:
    """ln_2 between two sequence-parallel regions left without SequenceParallel."""
    return _sp(model, mesh, norm=False)


def stale_entry(model: GPT, mesh: object) -> nn.Module:
    """The right plan, with an entry a plan written for another model keeps: ``attn.q_proj`` (nanoGPT's attention
    has one fused ``c_attn``). torch's parallelize_module warns and skips it; the run is exact."""
    for block in model.transformer.h:
        torch_parallelize_module(block, mesh["TP"], {"attn.q_proj": ColwiseParallel()})  # type: ignore[index]
    return parallelize(model, mesh)


def typo(model: GPT, mesh: object) -> nn.Module:
    """A parallelize function that raises before any step: the attribute is ``transformer``."""
    return parallelize(model.transformr, mesh)  # type: ignore[attr-defined]
