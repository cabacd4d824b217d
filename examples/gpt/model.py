"""A small GPT-2 style decoder, written to be read (after nanoGPT's model.py).

Nothing here knows about meshes or ranks: tensor parallelism is applied from the
outside by ``tp_plan.py``, context parallelism by ``cp.py``. The concessions to them:
attention splits heads with ``view(B, T, -1, head_dim)`` (under TP each rank holds
``n_head // tp`` heads, so the head count is read from the tensor, not the config), and
each attention layer calls its ``attention`` attribute, plain causal SDPA unless CP
swaps in ring attention.

With ``moe_experts`` > 0, the MLP of every ``moe_every``-th block is a mixture of experts
(:class:`MoE`): a top-k softmax router and E expert MLPs, no token ever dropped. Expert
parallelism is applied from the outside too (``ep.py``), through the MoE's ``dispatch``.

Shapes: B = batch, T = sequence length, C = n_embd, V = vocab_size, H = heads, N = tokens
(B x T), E = experts, k = experts per token.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


@dataclass
class GPTConfig:
    vocab_size: int = 256  # byte-level tokens
    block_size: int = 64  # longest sequence the position table covers
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 192
    dropout: float = 0.0
    bias: bool = True
    moe_experts: int = 0  # 0: every block has a dense MLP; E: mixture-of-experts blocks with E experts each
    moe_top_k: int = 2  # experts per token
    moe_every: int = 1  # with moe_experts: blocks 0, N, 2N, ... get the MoE, the others keep the MLP


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """(B, H, T, hd) queries, keys and values -> (B, H, T, hd): torch's causal SDPA."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        # Separate q/k/v projections (not one fused c_attn) so that a column-wise
        # split over TP hands each rank whole heads of q, k and v.
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout
        self.attention = causal_attention  # a plain attribute, not a module: CP replaces it with ring attention

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        # Under TP, q/k/v hold only this rank's heads: (B, T, C // tp).
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        y = self.attention(q, k, v, self.dropout if self.training else 0.0)  # (B, H, T, hd)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)  # (B, T, H * hd)
        return self.resid_dropout(self.c_proj(y))  # (B, T, C)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.gelu(self.c_fc(x))  # (B, T, 4C), or (B, T, 4C // tp) under TP
        return self.dropout(self.c_proj(x))  # (B, T, C)


class Experts(nn.ModuleDict):
    """Expert MLPs keyed by expert number; called on tokens grouped by expert, in key order.

    ``experts(tokens, counts)``: ``tokens`` (n, C) hold ``counts[i]`` rows for the i-th expert held
    here; the result (n, C) is in the same order. (A module with a forward, so that FSDP2 can shard
    the experts on their own.)
    """

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        runs = tokens.split(counts.tolist())
        return torch.cat([expert(run) for expert, run in zip(self.values(), runs)]) if runs else tokens


def local_dispatch(tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
    """Every expert is here: run them. Expert parallelism (``ep.py``) swaps in an all-to-all exchange."""
    return experts(tokens, counts)


class MoE(nn.Module):
    """A mixture of experts in place of the MLP: a top-k softmax router over E expert MLPs.

    Each token goes to its k most likely experts, and its output is their outputs weighted by the
    router's probabilities, renormalized over the k (Mixtral). There is no capacity limit, so no
    token is ever dropped and the result does not depend on how tokens are grouped into batches.

    After each forward the module keeps ``load`` (E,), the token slots each expert received (and
    in training mode adds them to ``load_sum``, which the training loop reads and clears), and in
    training mode ``aux_loss``, Switch Transformer's load-balancing loss ``E * sum_i f_i * P_i`` (f_i: the share of
    token slots routed to expert i; P_i: the mean router probability of expert i). ``count`` (a
    function, identity by default) may sum the slot counts over the ranks that share the batch, so
    that f_i is the share over the whole batch.

    ``dispatch(tokens, counts, experts)`` runs the experts on tokens grouped by expert number; it is
    :func:`local_dispatch` unless expert parallelism replaces it, and ``experts`` then holds only this
    rank's experts (still keyed by their global numbers).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_experts, self.top_k = config.moe_experts, config.moe_top_k
        self.router = nn.Linear(config.n_embd, config.moe_experts, bias=False)
        self.experts = Experts({str(i): MLP(config) for i in range(config.moe_experts)})
        self.dispatch = local_dispatch  # a plain attribute, not a module: EP replaces it
        self.count = lambda counts: counts  # EP (or DP) replaces it with a sum over the batch's ranks
        self.load: torch.Tensor | None = None
        self.load_sum: torch.Tensor | None = None  # summed over training forwards until the loop reads and clears it
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        flat = x.reshape(-1, C)  # (N, C)
        probs = F.softmax(self.router(flat).float(), dim=-1)  # (N, E), fp32
        weights, chosen = probs.topk(self.top_k, dim=-1)  # (N, k)
        weights = (weights / weights.sum(dim=-1, keepdim=True)).to(x.dtype)  # (N, k)
        slots = chosen.reshape(-1)  # (N * k,): the expert of each (token, choice)
        order = slots.argsort(stable=True)  # slots grouped by expert, tokens in order within each
        counts = torch.bincount(slots, minlength=self.n_experts)  # (E,)
        out = self.dispatch(flat[order // self.top_k], counts, self.experts)  # (N * k, C), grouped by expert
        y = out[order.argsort()]  # (N * k, C), back in (token, choice) order
        y = (y.view(-1, self.top_k, C) * weights.unsqueeze(-1)).sum(dim=1)  # (N, C)
        self.load = counts.detach()
        if self.training:  # eval and sampling need neither the load sum nor the balance loss (nor its collective)
            self.load_sum = counts.detach() if self.load_sum is None else self.load_sum + counts.detach()
            share = self.count(counts.to(torch.float32))  # slots per expert over the batch's ranks: f_i up to a factor
            self.aux_loss = self.n_experts * (share / share.sum() * probs.mean(dim=0)).sum()
        return y.view(B, T, C)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, moe: bool = False):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MoE(config) if moe else MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embeddings
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embeddings
        self.drop = nn.Dropout(config.dropout)
        # Keyed by layer number, so that a pipeline stage that keeps only some blocks (and
        # drops wte/wpe or ln_f/lm_head, setting them to None) keeps the full model's names.
        self.h = nn.ModuleDict({
            str(i): Block(config, moe=config.moe_experts > 0 and i % config.moe_every == 0) for i in range(config.n_layer)
        })
        #: Activation checkpointing: keep only each block's input for backward and recompute the rest there
        #: (torch.utils.checkpoint, non-reentrant). A plain attribute, so parameter names do not change.
        self.checkpoint_blocks = False
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        # Not tied to wte (nanoGPT ties them): under TP the two would need the
        # same sharding, and at V=256 the saving is small.
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        self.apply(self._init_weights)
        # GPT-2: scale the residual projections by 1/sqrt(2 * n_layer).
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def moe_layers(self) -> list[MoE]:
        """The mixture-of-experts layers present (none for a dense model, or a stage without them)."""
        return [m for m in self.modules() if isinstance(m, MoE)]

    def aux_loss(self) -> torch.Tensor | float:
        """The sum of the MoE layers' load-balancing losses from the last forward (0.0 without MoE)."""
        return sum((m.aux_loss for m in self.moe_layers() if m.aux_loss is not None), 0.0)

    def num_params(self) -> int:
        # DTensor parameters report their global numel, so this is the same
        # before and after tensor parallelism.
        return sum(p.numel() for p in self.parameters())

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids (B, T) -> logits (B, T, V).

        A pipeline stage without ``wte`` takes hidden states (B, T, C) instead of token ids,
        and one without ``lm_head`` returns hidden states instead of logits.
        """
        x = idx
        if self.wte is not None:
            B, T = idx.size()
            assert T <= self.config.block_size, f"sequence of {T} > block_size {self.config.block_size}"
            pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
            x = self.drop(self.wte(idx) + self.wpe(pos))  # (B, T, C)
        for block in self.h.values():
            if self.checkpoint_blocks and torch.is_grad_enabled():
                x = checkpoint(block, x, use_reentrant=False)  # (B, T, C), recomputed in backward
            else:
                x = block(x)  # (B, T, C)
        if self.lm_head is None:
            return x  # (B, T, C)
        x = self.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, V)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        max_new_tokens: int,
        *,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Extend ``idx`` (B, T) by ``max_new_tokens`` sampled tokens.

        Sampling draws from ``generator``: give every rank a generator with the
        same seed and every rank picks the same tokens, so a tensor-parallel
        model stays in lockstep.
        """
        for _ in range(max_new_tokens):
            idx_cond = idx[:, -self.config.block_size :]  # (B, t), t <= block_size
            t = idx_cond.size(1)
            # Pad on the right to a fixed length. Attention is causal, so the
            # padding never changes the logits at position t - 1; a fixed shape
            # suits sequence parallelism (T must split evenly over TP ranks).
            idx_cond = F.pad(idx_cond, (0, self.config.block_size - t))  # (B, block_size)
            logits = self(idx_cond)[:, t - 1, :]  # (B, V)
            idx_next = sample_next(logits, temperature=temperature, top_k=top_k, generator=generator)  # (B, 1)
            idx = torch.cat((idx, idx_next), dim=1)  # (B, T + 1)
        return idx


def sample_next(
    logits: torch.Tensor, *, temperature: float = 0.8, top_k: int | None = 40, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Draw the next token (B, 1) from the last position's logits (B, V), keeping the ``top_k`` most likely."""
    logits = logits.float() / temperature
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        logits[logits < v[:, [-1]]] = -float("inf")
    probs = F.softmax(logits, dim=-1)  # (B, V)
    return torch.multinomial(probs, num_samples=1, generator=generator)  # (B, 1)
