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


def make_qwen3() -> nn.Module:
    """HF's ``Qwen3ForCausalLM``: 2 layers of width 256, a norm over each head's queries and keys, SDPA attention."""
    return hf.Qwen3ForCausalLM(hf.Qwen3Config(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                              num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                              head_dim=32, max_position_embeddings=SEQ, attn_implementation="sdpa"))


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


def parallelize_fsdp_bf16(model: nn.Module, mesh) -> nn.Module:
    """As :func:`parallelize_fsdp`, with torchtitan's mixed precision: FSDP2 computes in bf16 and reduces in fp32."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _tp(model, mesh)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    return fully_shard(model, mp_policy=policy)


def parallelize_ddp(model: nn.Module, mesh) -> nn.Module:
    """HF's TP plan (when the mesh has TP), EP on the experts (when it has EP), then vemesh DDP over the mesh's data
    dims."""
    _tp(model, mesh)
    return DistributedDataParallel(model)


def parallelize_forgot_tp(model: nn.Module, mesh) -> nn.Module:
    """A parallelize function that applies no TP plan (written for DP 1, where it needs no wrapper): every TP rank
    holds the whole model."""
    return model


def parallelize_hf_checkpointed(model: nn.Module, mesh) -> nn.Module:
    """HF's own activation checkpointing of each decoder layer (which turns its cache off), nothing else (one rank)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def parallelize_torch_checkpointed(model: nn.Module, mesh) -> nn.Module:
    """Each decoder layer in torch's ``checkpoint_wrapper`` (as torchtitan wraps its blocks and
    ``apply_activation_checkpointing`` wraps a model's), not HF's own checkpointing: HF's cache stays as the step
    asks (one rank)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)
    return model


def parallelize_tp_selective(model: nn.Module, mesh) -> nn.Module:
    """HF's TP plan, each decoder layer in torch's ``checkpoint_wrapper`` under a per-op selective policy (the
    matmuls' and the attention's outputs kept, the rest recomputed), as torchtitan's ``selective-op`` wraps its
    blocks. With HF's KV cache on, the recompute's keys are longer than the forward's (the cache grew) and HF's SDPA
    path slices them: torch's selective checkpoint raises in the backward, in any run of it (torch 2.13)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

    kept = {torch.ops.aten.mm.default, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}

    def policy(ctx, op, *args, **kwargs):  # type: ignore[no-untyped-def]
        return CheckpointPolicy.MUST_SAVE if op in kept else CheckpointPolicy.PREFER_RECOMPUTE

    _tp(model, mesh)
    for i, layer in enumerate(model.model.layers):
        model.model.layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False,
                                                   context_fn=lambda: create_selective_checkpoint_contexts(policy))
    return model


def make_cohere(layers: int = 2) -> nn.Module:
    """HF's ``CohereForCausalLM``: its attention and MLP side by side in each block (both read the block's input and
    are added to it), 2 layers of width 256, SDPA attention."""
    return hf.CohereForCausalLM(hf.CohereConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688,
                                                num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=4,
                                                max_position_embeddings=SEQ, pad_token_id=0,
                                                attn_implementation="sdpa"))


def make_cohere_deep() -> nn.Module:
    """:func:`make_cohere` with 8 layers (a plan traces 3 and 4 of them and adds the rest by difference)."""
    return make_cohere(8)


def parallelize_tp_checkpointed(model: nn.Module, mesh, early_stop: bool = True) -> nn.Module:
    """HF's TP plan under HF's own activation checkpointing of each decoder layer (torch's non-reentrant checkpoint,
    which stops its recompute at the last tensor the backward needs, unless ``early_stop`` is False)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False,
                                                                       "early_stop": early_stop})
    _tp(model, mesh)
    return model


def parallelize_tp_checkpointed_whole(model: nn.Module, mesh) -> nn.Module:
    """:func:`parallelize_tp_checkpointed`, each block recomputed whole (``early_stop=False``)."""
    return parallelize_tp_checkpointed(model, mesh, early_stop=False)


def parallelize_tp(model: nn.Module, mesh) -> nn.Module:
    """HF's TP plan alone (TP the whole mesh: nothing to average)."""
    _tp(model, mesh)
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


def parallelize_sp_ungathered(model: nn.Module, mesh) -> nn.Module:
    """:func:`parallelize_sp_fsdp`'s sharded outputs without what gathers the sequence back: no PrepareModuleInput
    on the attention and the MLP, no SequenceParallel on the norms (a first sequence-parallel plan)."""
    tp = mesh["TP"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.model.layers:
        parallelize_module(layer, tp, {
            **{k: v for k, v in TP_PLAN.items() if k.startswith("self_attn.") and k != "self_attn.o_proj"},
            "self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
    return model


def step_without_cache(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """:func:`step` with HF's KV cache off (``use_cache=False``): a training step keeps no keys and values of its own."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(input_ids=tokens[:, :-1], use_cache=False).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def step_positions(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """:func:`step` with the whole sequence's positions given: under sequence parallelism HF's model would number
    them from its embedding's output, each TP rank's part of the sequence."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(input_ids=tokens[:, :-1], position_ids=torch.arange(SEQ).unsqueeze(0)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def step_causal_mask(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    """:func:`step_positions` with the whole sequence's causal mask given too, 4-D (``(batch, 1, T, T)``, 0 where a
    query sees a key, -inf elsewhere): a model whose eager attention adds a mask it made from the length of the
    hidden states it holds (Gemma 2) gets the whole one."""
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    mask = torch.full((SEQ, SEQ), float("-inf")).triu(1)[None, None].expand(micro_batch_size, 1, SEQ, SEQ)
    logits = model(input_ids=tokens[:, :-1], position_ids=torch.arange(SEQ).unsqueeze(0), attention_mask=mask).logits
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


def step_pp_clipped(schedule, batch_size: int) -> None:
    """:func:`step_pp`, then torch's own ``clip_grad_norm_`` over this PP rank's stage (``max_norm`` 0.01, which
    clips): it takes the stage's norm alone."""
    step_pp(schedule, batch_size)
    torch.nn.utils.clip_grad_norm_(schedule._stage.submod.parameters(), 0.01)


def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1), target.flatten())


def make_llama_eager() -> nn.Module:
    """:func:`make_llama` with HF's eager attention (its own matmuls and softmax, masked by the mask it is given)."""
    model = make_llama()
    model.config._attn_implementation = "eager"
    return model


class OwnStage(nn.Module):
    """A pipeline stage module as users write one by hand for HF's Llama, under the model's own names: the embedding
    on the first stage, its layers (each given the rotary positions), the norm and head on the last. It passes its
    layers no attention mask, which under SDPA is causal by itself and under eager attention attends to every token;
    ``norm=False`` forgets the final norm as well."""

    def __init__(self, model: nn.Module, stage: int, n_stages: int, norm: bool = True) -> None:
        super().__init__()
        from vemesh.parallel.schedules import split_layers

        base, last = model.model, stage == n_stages - 1
        self.model = nn.Module()
        self.model.embed_tokens = base.embed_tokens if stage == 0 else None
        self.model.layers = nn.ModuleDict({str(i): base.layers[i]
                                           for i in split_layers(len(base.layers), n_stages)[stage]})
        self.model.rotary_emb = base.rotary_emb
        self.model.norm = base.norm if last and norm else None
        self.lm_head = model.lm_head if last else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.model.embed_tokens(x) if self.model.embed_tokens is not None else x
        positions = self.model.rotary_emb(h, torch.arange(h.shape[1]).unsqueeze(0))
        for layer in self.model.layers.values():
            h = layer(h, position_embeddings=positions)
        if self.model.norm is not None:
            h = self.model.norm(h)
        return self.lm_head(h) if self.lm_head is not None else h


def _own_stages(model: nn.Module, mesh, norm: bool) -> list:
    from torch.distributed.pipelining import PipelineStage

    pp, rank = mesh.get_strategy_size("PP"), mesh.lookup_rank("PP")
    return [PipelineStage(OwnStage(model, rank, pp, norm), rank, pp, torch.device("cpu"), group=mesh["PP"].get_group())]


def parallelize_pp_own_stage(model: nn.Module, mesh) -> list:
    """PP with a hand-written stage module (:class:`OwnStage`)."""
    return _own_stages(model, mesh, True)


def parallelize_pp_own_stage_without_norm(model: nn.Module, mesh) -> list:
    """PP with a hand-written stage module that forgets the final norm."""
    return _own_stages(model, mesh, False)


#: this process's stage wrappers from :func:`parallelize_pp_zbv`, for :func:`step_pp_zbv`
_WRAPPERS: list[nn.Module] = []


def parallelize_pp_zbv(model: nn.Module, mesh) -> list:
    """PP with torch's ZBV schedule: this PP rank's two stages of the V (``DecoderStage``), each in vemesh DDP."""
    from torch.distributed.pipelining import PipelineStage

    from vemesh.parallel import DecoderStage
    from vemesh.parallel.schedules import stage_indices

    pp, rank = mesh.get_strategy_size("PP"), mesh.lookup_rank("PP")
    stages = [PipelineStage(DistributedDataParallel(DecoderStage(model, s, 2 * pp)), s, 2 * pp, torch.device("cpu"),
                            group=mesh["PP"].get_group()) for s in stage_indices(rank, pp, "zbv")]
    _WRAPPERS[:] = [s.submod for s in stages]
    return stages


def step_pp_zbv(schedule, batch_size: int) -> None:
    """:func:`step_pp` through ``vemesh.parallel.schedules.run_schedule``, which averages DDP's gradients after the
    zero-bubble schedule's hand-added weight gradients."""
    from vemesh.parallel.schedules import run_schedule

    tokens = torch.randint(0, VOCAB, (batch_size, SEQ + 1))
    run_schedule(schedule, "zbv", _WRAPPERS, tokens[:, :-1].contiguous(), target=tokens[:, 1:].contiguous(),
                 losses=[], return_outputs=False)


def make_llama_tied() -> nn.Module:
    """:func:`make_llama` whose head is its embedding (``tie_word_embeddings=True``: Llama 3.2 1B's, Qwen2.5's small
    sizes')."""
    model = make_llama()
    model.lm_head.weight = model.model.embed_tokens.weight
    model.config.tie_word_embeddings = True
    return model
