"""A small Llama-style model that is not the example's GPT: RMSNorm, RoPE from cos/sin buffers, SwiGLU, grouped-query
SDPA, and a mixture-of-experts variant with torchtitan's grouped-experts contract.

Nothing here knows about meshes: the tests apply vemesh's parallelisms from the outside (``parallelize`` below
is the kind of function a user writes). Shapes: B batch, T positions, D dim, H heads, K KV heads, E experts.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2  # grouped-query attention: each KV head serves n_heads / n_kv_heads query heads
    hidden_dim: int = 128  # SwiGLU's inner width
    max_seq_len: int = 32
    rope_theta: float = 10000.0
    moe_experts: int = 0  # 0: dense; E: every block's feed-forward is a top-k mixture of E experts
    moe_top_k: int = 2


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin ``[T, head_dim / 2]`` of each position's rotation angles."""
    freqs = 1.0 / theta ** (torch.arange(0, head_dim, 2).float() / head_dim)
    angles = torch.outer(torch.arange(seq_len).float(), freqs)
    return angles.cos(), angles.sin()


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs of ``x [B, H, T, hd]`` by each position's angles (``cos``/``sin`` ``[T, hd / 2]``)."""
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.dim // cfg.n_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd); H local under TP
        k = self.wk(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, hd)
        v = self.wv(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, K, T, hd)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
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


class GroupedExperts(nn.Module):
    """E SwiGLU experts stacked on dim 0: ``w1 [E, H, D]``, ``w2 [E, D, H]``, ``w3 [E, H, D]`` (torchtitan's contract)."""

    def __init__(self, dim: int, hidden: int, n_experts: int) -> None:
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(n_experts, hidden, dim) * dim ** -0.5)
        self.w2 = nn.Parameter(torch.randn(n_experts, dim, hidden) * hidden ** -0.5)
        self.w3 = nn.Parameter(torch.randn(n_experts, hidden, dim) * dim ** -0.5)

    def forward(self, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """``x [T, D]`` grouped by expert, in expert order; ``num_tokens_per_expert [E]`` -> ``[T, D]``."""
        out = [F.silu(xe @ w1.t()) * (xe @ w3.t()) @ w2.t()
               for xe, w1, w2, w3 in zip(x.split(num_tokens_per_expert.tolist()), self.w1, self.w2, self.w3)]
        return torch.cat(out) if out else x


class MoE(nn.Module):
    """Top-k softmax routing over grouped experts: route, sort slots by expert, run the experts, unsort, combine."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.top_k = cfg.moe_top_k
        self.router = nn.Linear(cfg.dim, cfg.moe_experts, bias=False)
        self.experts = GroupedExperts(cfg.dim, cfg.hidden_dim, cfg.moe_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, D = x.shape
        flat = x.reshape(-1, D)  # (N, D)
        weights, chosen = F.softmax(self.router(flat), dim=-1).topk(self.top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(-1, keepdim=True)
        slots = chosen.reshape(-1)  # (N k,): each (token, choice)'s expert
        order = slots.argsort(stable=True)  # slots grouped by expert
        counts = torch.bincount(slots, minlength=self.router.out_features)  # (E,)
        out = self.experts(flat[order // self.top_k], counts)[order.argsort()]  # (N k, D), back in slot order
        return (out.view(-1, self.top_k, D) * weights.unsqueeze(-1)).sum(1).view(B, T, D)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.feed_forward = MoE(cfg) if cfg.moe_experts else FeedForward(cfg.dim, cfg.hidden_dim)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layers)})
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        cos, sin = rope_tables(cfg.dim // cfg.n_heads, cfg.max_seq_len, cfg.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)  # (T, hd / 2): context_parallel shards these
        self.register_buffer("rope_sin", sin, persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.size(1)  # this CP rank's positions inside context_parallel, which cut the tables the same way
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        # a pipeline stage cut from the model (torchtitan's way) has no embedding, or no head: it passes through
        x = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens  # (B, T, D)
        for block in self.layers.values():
            x = block(x, cos, sin)
        return self.output(self.norm(x)) if self.output is not None else x  # (B, T, V)


def make(seed: int = 0, **overrides: int) -> Llama:
    """The model every rank builds: same seed, same weights."""
    torch.manual_seed(seed)
    return Llama(LlamaConfig(**overrides))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())
