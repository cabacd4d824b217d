"""Llama 3 as torchtitan trains it, written to be read: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Nothing here knows about meshes: :mod:`vemesh.models.llama3.parallelize` applies TP (with sequence parallelism and
a vocabulary-parallel loss), activation checkpointing, FSDP2 and pipeline stages from the outside. The concessions:

* attention splits heads with ``view(B, T, -1, head_dim)``: under TP each rank holds its share of the query and KV
  heads, read from the tensor;
* RoPE's ``cos``/``sin`` tables are buffers (``[T, head_dim / 2]``) that ``context_parallel`` cuts the way it cuts
  the tokens, so each CP rank rotates its tokens by their global positions; attention slices them to its input's
  length (the sequence, whatever a pipeline stage or sequence parallelism passed between blocks);
* a pipeline stage is the model with the other stages' blocks deleted and no embedding (or no norm and head):
  ``forward`` passes hidden states through what is left.

Shapes: B batch, T positions, D dim, H query heads, K KV heads, V vocabulary.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from vemesh.models.llama3.config import SIZES, Llama3Config, config_of

__all__ = ["SIZES", "Llama3", "Llama3Config", "config_of", "loss_fn"]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.size(-1),), self.weight, self.eps)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, head_dim / 2]`` of each position's rotation angles."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x [B, T, H, hd]`` by each position's angles (``cos``/``sin`` ``[T, hd / 2]``)."""
    a, b = x[..., 0::2], x[..., 1::2]
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: Llama3Config) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape  # the whole sequence (a CP rank's part of it): SP's shards are gathered before attention
        cos, sin = cos[:T], sin[:T]
        q = rotate(self.wq(x).view(B, T, -1, self.head_dim), cos, sin).transpose(1, 2)  # (B, H, T, hd)
        k = rotate(self.wk(x).view(B, T, -1, self.head_dim), cos, sin).transpose(1, 2)  # (B, K, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)  # (B, H, T, hd)
        return self.wo(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, D)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Llama3Config) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama3(nn.Module):
    def __init__(self, cfg: Llama3Config) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm: RMSNorm | None = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T, hd / 2): context_parallel cuts these
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        cos, sin = self.rope_cos, self.rope_sin  # inside context_parallel, cut as the tokens are; attention slices them
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.norm is not None:
            h = self.norm(h)
        return self.output(h) if self.output is not None else h  # (B, T, V), or hidden states between stages


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """torchtitan's loss: the cross-entropy of the fp32 logits (vocabulary-parallel under TP, in ``loss_parallel``)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(0, 1))
