"""A small GPT-2 style decoder, written to be read (after nanoGPT's model.py): vemesh's GPT preset.

Nothing here knows about meshes or ranks (no vemesh import): tensor parallelism, context and expert
parallelism are applied from the outside by :mod:`vemesh.models.gpt.parallelize`. The concessions to them:

* attention splits heads with ``view(B, T, -1, head_dim)`` (under TP each rank holds ``n_head // tp``
  heads, so the head count is read from the tensor, not the config) and calls torch's causal SDPA, which
  ``vemesh.parallel.context_parallel`` turns into ring attention over the CP group;
* positions come from the ``pos`` buffer (``0 .. block_size - 1``), which ``context_parallel`` cuts
  the way it cuts the tokens, so each CP rank embeds its tokens' global positions;
* the experts of a mixture-of-experts layer are one :class:`GroupedExperts` module, parameters stacked
  over experts on dim 0, the contract ``vemesh.parallel.ExpertParallel`` shards over EP.

With ``moe_experts`` > 0, the MLP of every ``moe_every``-th block is a mixture of experts
(:class:`MoE`): a top-k softmax router and E expert MLPs, no token ever dropped.

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


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_head < 1 or config.n_embd % config.n_head:
            heads = [h for h in range(1, config.n_embd + 1) if config.n_embd % h == 0]  # this file imports no vemesh
            raise ValueError(f"n_head {config.n_head} does not divide n_embd {config.n_embd}: each head takes "
                             f"n_embd / n_head channels; choose n_head from {', '.join(map(str, heads))}")
        # Separate q/k/v projections (not one fused c_attn) so that a column-wise
        # split over TP hands each rank whole heads of q, k and v.
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.head_dim = config.n_embd // config.n_head
        self.dropout = config.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        # Under TP, q/k/v hold only this rank's heads: (B, T, C // tp).
        q = self.q(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = self.k(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        v = self.v(x).view(B, T, -1, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0,
                                           is_causal=True)  # (B, H, T, hd)
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


class GroupedExperts(nn.Module):
    """E expert MLPs with their parameters stacked on dim 0: ``w1 [E, 4C, C]``, ``b1 [E, 4C]``, ``w2 [E, C, 4C]``,
    ``b2 [E, C]`` (torchtitan's grouped-experts contract, the one ``vemesh.parallel.ExpertParallel`` shards).

    ``experts(tokens, counts)``: ``tokens`` (n, C) hold ``counts[i]`` rows for the i-th expert held here, in
    expert order; the result (n, C) is in the same order. Each expert is built as an :class:`MLP` (same
    random draws) and stacked, so a model with grouped experts starts from the weights E MLPs would have.
    """

    def __init__(self, config: GPTConfig, n_experts: int):
        super().__init__()
        mlps = [MLP(config) for _ in range(n_experts)]
        self.w1 = nn.Parameter(torch.stack([m.c_fc.weight.detach() for m in mlps]))  # (E, 4C, C)
        self.w2 = nn.Parameter(torch.stack([m.c_proj.weight.detach() for m in mlps]))  # (E, C, 4C)
        self.b1 = nn.Parameter(torch.stack([m.c_fc.bias.detach() for m in mlps])) if config.bias else None  # (E, 4C)
        self.b2 = nn.Parameter(torch.stack([m.c_proj.bias.detach() for m in mlps])) if config.bias else None  # (E, C)
        self.dropout = config.dropout

    def forward(self, tokens: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        outs = []
        for e, run in enumerate(tokens.split(counts.tolist())):
            h = F.gelu(F.linear(run, self.w1[e], None if self.b1 is None else self.b1[e]))  # (n_e, 4C)
            out = F.linear(h, self.w2[e], None if self.b2 is None else self.b2[e])  # (n_e, C)
            outs.append(F.dropout(out, self.dropout, self.training))
        return torch.cat(outs) if outs else tokens


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

    Under expert parallelism ``experts`` holds this rank's experts and exchanges tokens with its EP peers.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_experts, self.top_k = config.moe_experts, config.moe_top_k
        self.router = nn.Linear(config.n_embd, config.moe_experts, bias=False)
        self.experts = GroupedExperts(config, config.moe_experts)
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
        out = self.experts(flat[order // self.top_k], counts)  # (N * k, C), grouped by expert
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
        # the positions embedded: context parallelism cuts this buffer as it cuts the tokens
        self.register_buffer("pos", torch.arange(config.block_size), persistent=False)
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
            elif name.endswith("experts.w2"):  # each expert's c_proj
                with torch.no_grad():
                    for e in range(p.size(0)):
                        nn.init.normal_(p[e], mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        elif isinstance(module, GroupedExperts):  # as E MLPs would be, one expert after another
            with torch.no_grad():
                for e in range(module.w1.size(0)):
                    nn.init.normal_(module.w1[e], mean=0.0, std=0.02)
                    nn.init.normal_(module.w2[e], mean=0.0, std=0.02)
            for b in (module.b1, module.b2):
                if b is not None:
                    nn.init.zeros_(b)

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
            if T > self.config.block_size:
                raise ValueError(f"a sequence of {T} tokens is longer than block_size {self.config.block_size}, "
                                 f"the positions the model embeds: give at most {self.config.block_size} tokens, "
                                 "or a model of a larger block_size")
            pos = self.pos[:T]  # (T,): 0..T-1, or this CP rank's global positions inside context_parallel
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
