"""What a user of vemesh writes for Hugging Face transformers' ``LlamaForCausalLM`` and ``Qwen3MoeForCausalLM``, as
transformers ships them: factories, parallelize functions and a step, the three things ``vemesh plan --model
module:... --parallelize ... --step ...`` runs, and that ``bench/plan_user_run.py`` runs for real
(``bench/plan_accuracy.py`` compares them).

TP is HF's own plan by module names (its config's ``base_model_tp_plan``) as torch's styles on ``mesh["TP"]``; EP is
vemesh's ``ExpertParallel`` on each MoE layer's ``mlp.experts`` (HF's fused experts, its routed contract) on
``mesh["EP"]``; data parallelism is FSDP2 on each decoder layer and the root, or vemesh DDP (ZeRO-1 is the
optimizer's; the experts' gradients are averaged over EDP, the rest over the data dims).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers as hf
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

from vemesh import VESCALE_DEVICE_MESH
from vemesh.ddp import DistributedDataParallel
from vemesh.parallel import ExpertParallel, context_parallel, fully_shard

SEQ, VOCAB = 128, 1024

#: HF Llama's ``base_model_tp_plan``, by its module names, as torch's styles.
TP_PLAN = {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
           "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
           "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()}


def make_llama() -> nn.Module:
    """HF's ``LlamaForCausalLM`` (its own ``post_init`` initialisation), 6 layers of width 256, SDPA attention."""
    return hf.LlamaForCausalLM(hf.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                              num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
                                              max_position_embeddings=SEQ, attn_implementation="sdpa"))


def make_qwen3_moe() -> nn.Module:
    """HF's ``Qwen3MoeForCausalLM``: 4 layers of width 128, 8 experts of width 64 per layer, top 2, SDPA attention.
    transformers 5 runs its experts through ``grouped_mm`` (on CPU too, in fp32)."""
    return hf.Qwen3MoeForCausalLM(hf.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=32, max_position_embeddings=SEQ, attn_implementation="sdpa"))


def _tp(model: nn.Module, mesh) -> None:
    """HF's TP plan (when the mesh has TP), and ExpertParallel on each MoE layer's experts (when it has EP)."""
    if mesh.get_strategy_size("TP") > 1:
        for layer in model.model.layers:
            parallelize_module(layer, mesh["TP"], TP_PLAN)
            if hasattr(layer.self_attn, "q_norm"):  # Qwen3's norms over each head: this rank's heads, summed over TP
                parallelize_module(layer.self_attn, mesh["TP"], {
                    "q_norm": SequenceParallel(sequence_dim=2, use_local_output=True),
                    "k_norm": SequenceParallel(sequence_dim=2, use_local_output=True)})
    if mesh.get_strategy_size("EP") > 1:
        for layer in model.model.layers:
            parallelize_module(layer.mlp.experts, mesh["EP"], ExpertParallel())


def parallelize_fsdp(model: nn.Module, mesh) -> nn.Module:
    """HF's TP plan (when the mesh has TP), EP on the experts (when it has EP), then FSDP2 on each decoder layer and
    the root."""
    _tp(model, mesh)
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:
    """HF's TP plan (when the mesh has TP), EP on the experts (when it has EP), then vemesh DDP over the mesh's data
    dims."""
    _tp(model, mesh)
    return DistributedDataParallel(model)


def parallelize_forgot_tp(model: nn.Module, mesh) -> nn.Module:
    """A parallelize function that applies no TP plan (written for DP 1, where it needs no wrapper): every TP rank
    holds the whole model."""
    return model


def parallelize_sp_fsdp(model: nn.Module, mesh) -> nn.Module:
    """TP with sequence parallelism, as torchtitan plans its Llama, by HF's module names: the residual stream and the
    norms hold each TP rank's part of the sequence, gathered before the attention and the MLP; then FSDP2 where the
    mesh has data-parallel ranks."""
    tp = mesh["TP"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "model.norm": SequenceParallel(),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            "input_layernorm": SequenceParallel(),
            "self_attn": PrepareModuleInput(input_kwarg_layouts={"hidden_states": Shard(1)},
                                            desired_input_kwarg_layouts={"hidden_states": Replicate()}),
            **{k: v for k, v in TP_PLAN.items() if k.startswith("self_attn.") and k != "self_attn.o_proj"},
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "post_attention_layernorm": SequenceParallel(),
            "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    if mesh.get_strategy_size("DP") == 1:
        return model
    for layer in model.model.layers:
        fully_shard(layer)
    return fully_shard(model)


def step_positions(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """:func:`step` with the whole sequence's positions given: under sequence parallelism HF's model would number
    them from its embedding's output, each TP rank's part of the sequence."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(input_ids=tokens[:, :-1], position_ids=torch.arange(SEQ).unsqueeze(0)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """One forward and backward of ``micro_batch_size`` sequences: HF's logits, the next-token loss."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(input_ids=tokens[:, :-1]).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()



def step_cp_without_positions(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """CP as a first try: the tokens and labels cut by ``context_parallel``, and HF's model left to number the
    positions itself, which it does from 0 on each rank: wrong RoPE angles on every rank, and training goes on."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[x, y], buffer_seq_dims=[1, 1]):
        logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
    return loss.detach()


def step_cp(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """CP on HF's model as it ships: the positions cut with the tokens, and given to the model."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    positions = torch.arange(SEQ).expand(micro_batch_size, SEQ).contiguous()
    with context_parallel(VESCALE_DEVICE_MESH["CP"], buffers=[x, y, positions], buffer_seq_dims=[1, 1, 1]):
        logits = model(input_ids=x, position_ids=positions).logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
    return loss.detach()


def parallelize_pp(model: nn.Module, mesh) -> list:
    """PP with torch's 1F1B: this PP rank's stage of HF's model as ``vemesh.parallel.DecoderStage`` cuts it (the
    model's own forward over the stage's layers, under its own names), HF's TP plan on its layers (when the mesh has
    TP), vemesh DDP where the mesh has data-parallel ranks; each given to torch's ``PipelineStage``."""
    from torch.distributed.pipelining import PipelineStage

    from vemesh.parallel import DecoderStage

    pp = mesh.get_strategy_size("PP")
    part = DecoderStage(model, mesh.lookup_rank("PP"), pp)
    if mesh.get_strategy_size("TP") > 1:
        for layer in part.model.layers:
            parallelize_module(layer, mesh["TP"], TP_PLAN)
    if mesh.get_strategy_size("DP") > 1:
        part = DistributedDataParallel(part)
    return [PipelineStage(part, mesh.lookup_rank("PP"), pp, torch.device("cpu"), group=mesh["PP"].get_group())]


def step_pp(schedule, batch_size: int) -> None:
    """A DP rank's batch through torch's pipeline schedule (it splits the batch into micro-batches)."""
    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    schedule.step(tokens[:, :-1].contiguous(), target=tokens[:, 1:].contiguous(), losses=[], return_outputs=False)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())
