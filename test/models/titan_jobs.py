"""torchtitan's own ``MoE`` module (the ``torchtitan`` package, 0.3.0: the ``titan`` extra) in a model of a user's:
an embedding, blocks of ``RMSNorm`` and torchtitan's ``MoE`` (router, routed experts, shared experts, the
load-balancing buffers) with a residual, a norm and a head; and torchtitan's own ``Llama3Model`` with the SDPA
attention torchtitan ships (:func:`make_llama3`: its language models take flex or varlen attention, and torch 2.13's
``flex_attention`` has no backward on CPU).

What a user writes for it, the three things ``vemesh plan --model module:... --parallelize ... --step ...`` runs
(``bench/plan_accuracy.py`` plans them and runs them for real): a factory, parallelize functions (vemesh's
``ExpertParallel`` on each ``MoE``'s grouped experts, vemesh DDP or FSDP2 on the rest) and a step.
``test/parallel/library_models/test_torchtitan_models.py`` trains it against one process.
"""

from __future__ import annotations

import types
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import parallelize_module

from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import ExpertParallel, ExpertTensorParallel, fully_shard

#: The planner's job: 2 blocks of 8 experts (top 2) of width 256, sequences of 128, a vocabulary of 512.
BENCH = dict(vocab=512, dim=256, hidden=256, experts=8, top_k=2, n_layers=2, seq=128)


def titan_moe(dim: int, hidden: int, experts: int, top_k: int) -> nn.Module:
    """torchtitan 0.3.0's ``MoE``, built by its own config helpers and initialised by its ``init_states``
    (softmax router, normalised top-k weights, a shared SwiGLU expert, auxiliary-loss-free load balancing)."""
    # here, not at the top: the module is importable (and its docstring readable) without the titan extra
    from torchtitan.models.common.config_utils import (make_ffn_config, make_moe_config, make_routed_experts_config,
                                                       make_router_config)

    init = {"weight": partial(nn.init.normal_, std=0.02), "bias": nn.init.zeros_}
    config = make_moe_config(
        num_experts=experts, load_balance_coeff=1e-2,
        router=make_router_config(dim=dim, num_experts=experts, gate_param_init=init, top_k=top_k,
                                  score_func="softmax", route_norm=True),
        routed_experts=make_routed_experts_config(dim=dim, hidden_dim=hidden, num_experts=experts, top_k=top_k,
                                                  param_init=dict.fromkeys(["w1_EFD", "w2_EDF", "w3_EFD"],
                                                                           init["weight"]),
                                                  comm_backend="standard"),
        shared_experts=make_ffn_config(dim=dim, hidden_dim=hidden, w1_param_init=init, w2w3_param_init=init))
    moe = config.build()
    moe.init_states()  # torchtitan's modules are built empty and initialised here
    return moe


class Block(nn.Module):
    def __init__(self, dim: int, moe: nn.Module) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.moe = moe

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.moe(self.norm(h))


class TitanMoELM(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, experts: int, top_k: int, n_layers: int, seq: int) -> None:
        super().__init__()
        self.vocab, self.seq = vocab, seq
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, titan_moe(dim, hidden, experts, top_k)) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def fp32_grouped_mm(self: nn.Module, *, A: torch.Tensor, B_t: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """torchtitan's ``GroupedExperts._grouped_mm`` seam computing in fp32. Its forward still casts the tokens and
    weights to bf16 before the seam, so the weights' gradients are rounded to bf16 at those casts: under EP each data
    rank's share of an expert's gradient is rounded before the shares are summed, not the sum once."""
    return torch._grouped_mm(A.float(), B_t.float(), offs=offs)


def fp32_forward(self: nn.Module, x_RD: torch.Tensor, num_tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
    """``GroupedExperts.forward`` as torchtitan 0.3.0 writes it, without its casts to bf16: the same SwiGLU through
    the same ``_grouped_mm`` seam, on fp32 operands, so nothing is rounded beyond fp32."""
    offs = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
    h = F.silu(self._grouped_mm(A=x_RD, B_t=self.w1_EFD.transpose(-2, -1), offs=offs))
    h = h * self._grouped_mm(A=x_RD, B_t=self.w3_EFD.transpose(-2, -1), offs=offs)
    return self._grouped_mm(A=h, B_t=self.w2_EDF.transpose(-2, -1), offs=offs)


def blocks(model: nn.Module) -> list[nn.Module]:
    """A model's blocks in order: ``TitanMoELM``'s list, or a torchtitan ``Decoder``'s ``layers`` dict."""
    layers = model.layers
    return list(layers.values()) if isinstance(layers, nn.ModuleDict) else list(layers)


def shard_blocks_and_root(model: nn.Module) -> nn.Module:
    """FSDP2 (vemesh's, experts on EDP) on each block, then on the root, as torchtitan shards."""
    for block in blocks(model):
        fully_shard(block)
    return fully_shard(model)


def experts_in(model: nn.Module, precision: str) -> None:
    """``precision``: ``"bf16"`` leaves torchtitan's experts as shipped, ``"fp32-seam"`` overrides their
    ``_grouped_mm`` seam to compute in fp32, ``"fp32"`` their forward too (no casts to bf16)."""
    if precision not in ("bf16", "fp32-seam", "fp32"):
        raise ValueError(f"precision must be one of 'bf16', 'fp32-seam', 'fp32'; got {precision!r}")
    for layer in blocks(model):
        experts = layer.moe.routed_experts.inner_experts
        if precision != "bf16":
            experts._grouped_mm = types.MethodType(fp32_grouped_mm, experts)
        if precision == "fp32":
            experts.forward = types.MethodType(fp32_forward, experts)


def balance_experts(model: nn.Module, group) -> None:
    """torchtitan's auxiliary-loss-free load balancing (its trainer's optimizer-step pre-hook), before each
    ``opt.step()``: the routed-token counts summed over the data ranks (``group``; None in one process), each
    expert's bias moved towards the mean count, the counts cleared."""
    for layer in blocks(model):
        moe = layer.moe
        counts = moe.tokens_per_expert_E
        if group is not None:
            dist.all_reduce(counts, group=group)
        with torch.no_grad():
            delta = moe.load_balance_coeff * torch.sign(counts.mean() - counts)
            moe.expert_bias_E.add_(delta - delta.mean())
        counts.zero_()


def expert_parallel(model: nn.Module, mesh) -> None:
    """The documented call: vemesh's ``ExpertParallel`` on each ``MoE``'s grouped experts over ``mesh["EP"]``, or
    ``ExpertTensorParallel`` over ``mesh["EP", "TP"]`` when the mesh has TP too."""
    for layer in blocks(model):
        experts = layer.moe.routed_experts.inner_experts
        if mesh.get_strategy_size("TP") > 1:
            parallelize_module(experts, mesh["EP", "TP"], ExpertTensorParallel())
        elif mesh.get_strategy_size("EP") > 1:
            parallelize_module(experts, mesh["EP"], ExpertParallel())


def make_moe() -> TitanMoELM:
    """The planner's job (:data:`BENCH`), its experts in bf16 as shipped."""
    torch.manual_seed(0)
    return TitanMoELM(**BENCH)


def parallelize_ddp(model: TitanMoELM, mesh) -> nn.Module:
    """EP on the experts, vemesh DDP over the mesh's data dims (experts over EDP; ZeRO-1 is the optimizer's)."""
    expert_parallel(model, mesh)
    return DistributedDataParallel(model)


def parallelize_fsdp(model: TitanMoELM, mesh) -> nn.Module:
    """EP on the experts, FSDP2 on each block and the root."""
    expert_parallel(model, mesh)
    return shard_blocks_and_root(model)


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """One forward and backward of ``micro_batch_size`` random sequences (the load balancing belongs before the
    optimizer step, which the planner does not trace: it moves no bytes of the model's)."""
    core = model.module if isinstance(model, DistributedDataParallel) else model
    tokens = torch.randint(0, core.vocab, (micro_batch_size, core.seq + 1))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


# ---- torchtitan's Llama3 ----------------------------------------------------------------------------------------

#: TP by torchtitan 0.3.0's module names: the fused ``wqkv`` is laid out as ``(n_kv_heads, R, head_dim, dim)``, so
#: torch's column-wise split of its rows gives each TP rank whole KV groups (their query heads, key and value), and
#: torchtitan's attention reshapes with ``-1`` heads.
LLAMA3_TP = {"attention.qkv_linear.wqkv": "colwise", "attention.wo": "rowwise", "feed_forward.w1": "colwise",
             "feed_forward.w3": "colwise", "feed_forward.w2": "rowwise"}
LLAMA3_SEQ = 128


def make_llama3() -> nn.Module:
    """torchtitan 0.3.0's ``Llama3Model``, its ``debugmodel`` (6 blocks of width 256, 16 heads, a vocabulary of
    2048) built by its own config and initialised by its ``init_states`` (``trunc_normal_``), with the attention
    torchtitan ships as ``ScaledDotProductAttention`` in place of flex attention: torch 2.13's ``flex_attention``
    has no backward on CPU, and a causal sequence with no document mask is the same attention."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"]("flex")
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()  # torchtitan's modules are built empty and initialised here (on meta: nothing)
    return model


def tp_by_names(model: nn.Module, mesh, plan: dict[str, str]) -> None:
    """TP of each block by torchtitan's module names (when the mesh has TP): ``plan`` maps a name to ``colwise``,
    ``rowwise``, or ``heads`` (replicated weights over inputs sharded on the head dim, dim 2)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    if mesh.get_strategy_size("TP") > 1:
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel,
                  "heads": partial(SequenceParallel, sequence_dim=2, use_local_output=True)}
        for block in blocks(model):
            parallelize_module(block, mesh["TP"], {name: styles[s]() for name, s in plan.items()})


def _llama3_tp(model: nn.Module, mesh) -> None:
    tp_by_names(model, mesh, LLAMA3_TP)


def parallelize_llama3_fsdp(model: nn.Module, mesh) -> nn.Module:
    """TP by module names (when the mesh has TP), then FSDP2 on each block and the root."""
    _llama3_tp(model, mesh)
    return shard_blocks_and_root(model)


def parallelize_llama3_ddp(model: nn.Module, mesh) -> nn.Module:
    """TP by module names (when the mesh has TP), then vemesh DDP over the mesh's data dims (ZeRO-1 is the
    optimizer's)."""
    _llama3_tp(model, mesh)
    return DistributedDataParallel(model)


def make_qwen3_moe() -> nn.Module:
    """torchtitan 0.3.0's ``Qwen3Model`` with MoE blocks, its ``debugmodel_moe`` config (width 256, 16 query and 8 KV
    heads of 128 with q/k norms, a vocabulary of 2048, softmax routing with normalised top-k weights and
    auxiliary-loss-free load balancing) with 2 blocks of 8 experts of width 128 (top 2) in place of 8 blocks of 64
    experts of width 768 (top 8), built by torchtitan's own block builder, initialised by its ``init_states``, and
    the SDPA attention it ships in place of flex attention, as :func:`make_llama3`."""
    import torchtitan.models.qwen3 as qwen3
    from torchtitan.models.common.attention import ScaledDotProductAttention

    config = qwen3.qwen3_configs["debugmodel_moe"]("flex")
    config.layers = qwen3._build_qwen3_moe_layers(
        n_layers=2, dim=256, n_heads=16, n_kv_heads=8, head_dim=128, moe_hidden_dim=128, num_experts=8, top_k=2,
        attn_backend="flex", moe_comm_backend="standard", rope=config.layers[0].attention.rope)
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    model = config.build()
    model.init_states()
    return model


#: TP of a Qwen3 block's attention by torchtitan's module names (its fused ``wqkv`` is laid out by KV group). Its
#: q/k norms act on each TP rank's own heads: as torchtitan shards them, their weights replicated over TP and their
#: inputs sharded on the head dim (dim 2), so that each weight's gradient is summed over the TP ranks' heads (left
#: plain, each TP rank would step its norms with the gradient of its own heads only)
QWEN3_TP = {"attention.qkv_linear.wqkv": "colwise", "attention.wo": "rowwise", "attention.q_norm": "heads",
            "attention.k_norm": "heads"}


def _qwen3_model_parallel(model: nn.Module, mesh) -> None:
    """TP on the attention by module names (when the mesh has TP), and EP on the experts: ``ExpertParallel`` over
    ``mesh["EP"]``, or expert TP (``ExpertTensorParallel`` over ``mesh["EP", "TP"]``) when the mesh has TP too."""
    tp_by_names(model, mesh, QWEN3_TP)
    expert_parallel(model, mesh)


def parallelize_qwen3_fsdp(model: nn.Module, mesh) -> nn.Module:
    """TP on the attention, EP on the experts, FSDP2 on each block and the root (experts over EDP)."""
    _qwen3_model_parallel(model, mesh)
    return shard_blocks_and_root(model)


def parallelize_qwen3_ddp(model: nn.Module, mesh) -> nn.Module:
    """TP on the attention, EP on the experts, vemesh DDP over the data dims (experts over EDP; ZeRO-1 is the
    optimizer's)."""
    _qwen3_model_parallel(model, mesh)
    return DistributedDataParallel(model)


def step_llama3(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """One forward and backward of ``micro_batch_size`` random sequences of :data:`LLAMA3_SEQ` tokens, for
    torchtitan's decoders of a 2048-token vocabulary (Llama3's and Qwen3's debug models)."""
    tokens = torch.randint(0, 2048, (micro_batch_size, LLAMA3_SEQ + 1))
    logits = model(tokens[:, :-1])
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def _step_llama3_cp(model: nn.Module, micro_batch_size: int, positions_cut: bool) -> torch.Tensor:
    from vemesh import VESCALE_DEVICE_MESH
    from vemesh.parallel import context_parallel

    tokens = torch.randint(0, 2048, (micro_batch_size, LLAMA3_SEQ + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(LLAMA3_SEQ).expand(micro_batch_size, LLAMA3_SEQ).contiguous()
    buffers = [x, y, positions] if positions_cut else [x, y]
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=buffers, buffer_seq_dims=[1] * len(buffers)):
        logits = model(x, positions=positions) if positions_cut else model(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), y.reshape(-1))
        loss.backward()
    return loss.detach()


def step_llama3_cp(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """:func:`step_llama3` under CP with vemesh's ``context_parallel``: the tokens, the labels and the positions cut
    along the sequence, and the positions given to the model (torchtitan's decoders take them as ``positions``)."""
    return _step_llama3_cp(model, micro_batch_size, True)


def step_llama3_cp_without_positions(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """The same, the positions left to the model: its RoPE numbers each CP rank's tokens from 0."""
    return _step_llama3_cp(model, micro_batch_size, False)
