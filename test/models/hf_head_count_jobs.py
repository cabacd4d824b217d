"""HF transformers' decoders whose attention reads its own head counts, as the library ships them, for ``vemesh check``.

Falcon (``parallel_attn``, the 7B's block) views its fused, head-major ``query_key_value`` by ``self.num_heads``, and
its block adds the attention's output into the MLP's in place (``mlp_output += attention_output``); OPT views q, k
and v by ``view(bsz, -1, self.num_heads, head_dim)``, so under TP the ``-1`` takes the rest and the heads fold into
the sequence, silently. ``naive`` is torch's styles as for any Linears (wrong on both); ``fixed`` adds what the
check's hints say: the head counts set to this rank's, and on Falcon a copy of the MLP's output (exact).

T5 (encoder and decoder) adds to each attention's scores a bias per head: its first self-attention of each stack
computes it from ``relative_attention_bias`` (an Embedding of buckets x ``n_heads``), and each cross-attention starts
from zeros of ``(1, self.n_heads, ...)``. ``naive_t5`` is torch's styles on q, k, v, o and the MLP: the scores of this
rank's heads meet the bias of every head, and the sum raises. ``fixed_t5`` also shards the table over TP on its heads
and sets ``n_heads`` to this rank's (exact).

XGLM's attention views q by ``self.num_heads`` and reshapes its heads' output by ``self.embed_dim``, the whole width:
``fixed`` sets both to this rank's (exact).

Bloom views its head-major ``query_key_value`` by ``self.num_heads`` too, and is handed its ALiBi bias, built once in
the model for every head (``(batch * n_head, 1, seq)``), which it adds to its scores: ``naive`` is torch's
styles; ``heads_bloom`` also sets ``num_heads`` to this rank's (the bias still has every head, and ``baddbmm``
raises); ``fixed_bloom`` also slices the bias to this rank's heads with
``vemesh.parallel.HeadwiseParallel(inputs={"alibi": 0}, heads=n_head)`` (exact). Falcon with ``alibi=True``
(``make_falcon_alibi``) hands its attention the bias and its mask as ``(batch, heads, ...)``, heads on dim 1; MPT
(``make_mpt``) fuses ``[q|k|v]`` in ``Wqkv``, counts ``n_heads`` and is handed its bias as ``position_bias`` of
``(heads, 1, seq)``.

Persimmon views its head-major ``query_key_value`` by ``self.num_heads`` and normalizes q and k per head by LayerNorms
of ``head_dim`` (``q_layernorm``, ``k_layernorm``): with the counts set, each TP rank's norm weights get its own heads'
gradient only. ``fixed_persimmon`` sets the counts and puts torch's ``SequenceParallel(sequence_dim=2)`` on the norms
(their weights replicated DTensors, whose gradients torch sums over TP): exact.

Cohere with ``use_qk_norm`` normalizes q and k by a LayerNorm of a weight per head, ``(heads, head_dim)`` (its
attention views them by ``-1`` heads): under torch's styles (``naive_cohere``) this rank's heads meet every head's
weight and the norm raises; ``fixed_cohere`` shards those weights on their heads with
``HeadwiseParallel(("weight",))`` on each norm (exact).

GPT-OSS keeps ``sinks``, one logit per head, a parameter of its attention that it concatenates to the scores: under
torch's styles on q, k, v and o (``naive_gpt_oss``) the shapes disagree and the forward raises; ``fixed_gpt_oss`` adds
``vemesh.parallel.HeadwiseParallel(("sinks",))`` on the attention, and vemesh's ``ExpertParallel`` on its experts where
the mesh has EP (exact)."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel, parallelize_module
from transformers import BloomConfig, BloomForCausalLM, CohereConfig, CohereForCausalLM, FalconConfig, \
    FalconForCausalLM, GptOssConfig, GptOssForCausalLM, MptConfig, MptForCausalLM, OPTConfig, OPTForCausalLM, \
    PersimmonConfig, PersimmonForCausalLM, StableLmConfig, StableLmForCausalLM, T5Config, T5ForConditionalGeneration, \
    XGLMConfig, XGLMForCausalLM

from vemesh.parallel import ExpertParallel, HeadwiseParallel, fully_shard

VOCAB = 128


def make_falcon() -> nn.Module:
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          multi_query=False, new_decoder_architecture=False, parallel_attn=True,
                                          bias=False, alibi=False, hidden_dropout=0.0, attention_dropout=0.0))


def make_falcon_alibi() -> nn.Module:
    return FalconForCausalLM(FalconConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          multi_query=False, new_decoder_architecture=False, parallel_attn=True,
                                          bias=False, alibi=True, hidden_dropout=0.0, attention_dropout=0.0))


def make_persimmon() -> nn.Module:
    return PersimmonForCausalLM(PersimmonConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                                num_attention_heads=4, intermediate_size=128, max_position_embeddings=64,
                                                qk_layernorm=True))


def make_cohere() -> nn.Module:
    return CohereForCausalLM(CohereConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=128, max_position_embeddings=64,
                                          use_qk_norm=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def make_stablelm() -> nn.Module:
    return StableLmForCausalLM(StableLmConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                                              num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                              max_position_embeddings=64, qk_layernorm=True, hidden_dropout=0.0,
                                              attention_dropout=0.0))


def make_mpt() -> nn.Module:
    return MptForCausalLM(MptConfig(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, expansion_ratio=2,
                                    max_seq_len=32, resid_pdrop=0.0, emb_pdrop=0.0))


def make_bloom() -> nn.Module:
    return BloomForCausalLM(BloomConfig(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4, hidden_dropout=0.0,
                                        attention_dropout=0.0))


def make_opt() -> nn.Module:
    return OPTForCausalLM(OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                                    dropout=0.0, attention_dropout=0.0))


def make_xglm() -> nn.Module:
    return XGLMForCausalLM(XGLMConfig(vocab_size=VOCAB, d_model=64, ffn_dim=128, num_layers=2, attention_heads=4,
                                      max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                      activation_dropout=0.0, pad_token_id=0))


def make_t5() -> nn.Module:
    return T5ForConditionalGeneration(T5Config(vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                               num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                                               decoder_start_token_id=0, pad_token_id=0))


def make_gpt_oss() -> nn.Module:
    return GptOssForCausalLM(GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                          num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                                          max_position_embeddings=64, attn_implementation="eager",
                                          layer_types=["sliding_attention", "full_attention"]))


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, 16))
    model(input_ids=ids, labels=ids).loss.backward()


def _layers(model: nn.Module) -> tuple[list[nn.Module], dict[str, str], str]:
    """Each decoder layer, its plan (``c``: ColwiseParallel, ``r``: RowwiseParallel) and its attention's name."""
    if isinstance(model, PersimmonForCausalLM):
        return list(model.model.layers), {"self_attn.query_key_value": "c", "self_attn.dense": "r",
                                          "mlp.dense_h_to_4h": "c", "mlp.dense_4h_to_h": "r"}, "self_attn"
    if isinstance(model, MptForCausalLM):
        return list(model.transformer.blocks), {"attn.Wqkv": "c", "attn.out_proj": "r", "ffn.up_proj": "c",
                                                "ffn.down_proj": "r"}, "attn"
    if isinstance(model, (FalconForCausalLM, BloomForCausalLM)):
        return list(model.transformer.h), {"self_attention.query_key_value": "c", "self_attention.dense": "r",
                                           "mlp.dense_h_to_4h": "c", "mlp.dense_4h_to_h": "r"}, "self_attention"
    layers = model.model.layers if isinstance(model, XGLMForCausalLM) else model.model.decoder.layers
    return list(layers), {"self_attn.q_proj": "c", "self_attn.k_proj": "c", "self_attn.v_proj": "c",
                          "self_attn.out_proj": "r", "fc1": "c", "fc2": "r"}, "self_attn"


def naive(model: nn.Module, mesh: object) -> nn.Module:
    layers, plan, _ = _layers(model)
    for layer in layers:
        parallelize_module(layer, mesh["TP"], {k: ColwiseParallel() if v == "c" else RowwiseParallel()  # type: ignore[index]
                                               for k, v in plan.items()})
    return model


def fixed(model: nn.Module, mesh: object) -> nn.Module:
    tp = mesh["TP"].size()  # type: ignore[index]
    model = naive(model, mesh)
    layers, _, attention = _layers(model)
    for layer in layers:
        attn = layer.get_submodule(attention)
        # the whole model's counts, and XGLM's width of its heads (its output's reshape): this rank's are 1/tp of them
        for name in ("num_heads", "num_kv_heads", *("embed_dim",) * isinstance(model, XGLMForCausalLM)):
            if hasattr(attn, name):
                setattr(attn, name, getattr(attn, name) // tp)
        if isinstance(model, FalconForCausalLM):  # its block adds into the MLP's output in place
            layer.mlp.dense_4h_to_h.register_forward_hook(lambda module, args, out: out.clone())
    return model


def counts_only(model: nn.Module, mesh: object) -> nn.Module:
    """XGLM with its head counts set to this rank's and its width forgotten (the reshape still raises)."""
    model = naive(model, mesh)
    for layer in _layers(model)[0]:
        layer.self_attn.num_heads //= mesh["TP"].size()  # type: ignore[index]
    return model


def heads_bloom(model: nn.Module, mesh: object) -> nn.Module:
    """:func:`naive` with each attention's ``num_heads`` set to this rank's, its ALiBi bias left whole."""
    for layer in naive(model, mesh).transformer.h:
        layer.self_attention.num_heads //= mesh["TP"].size()  # type: ignore[index]
    return model


def fixed_bloom(model: nn.Module, mesh: object) -> nn.Module:
    """:func:`heads_bloom` with the ALiBi bias each attention is handed sliced to this rank's heads (exact)."""
    model = heads_bloom(model, mesh)
    for layer in model.transformer.h:
        parallelize_module(layer, mesh["TP"], {  # type: ignore[index]
            "self_attention": HeadwiseParallel(inputs={"alibi": 0}, heads=model.config.n_head)})
    return model


def fixed_persimmon(model: nn.Module, mesh: object) -> nn.Module:
    """:func:`naive` with the head counts set to this rank's and the per-head norms' gradients summed over TP."""
    for layer in naive(model, mesh).model.layers:
        layer.self_attn.num_heads //= mesh["TP"].size()  # type: ignore[index]
        parallelize_module(layer.self_attn, mesh["TP"], {  # type: ignore[index]
            n: SequenceParallel(sequence_dim=2, use_local_output=True) for n in ("q_layernorm", "k_layernorm")})
    return model


def naive_cohere(model: nn.Module, mesh: object, norms: bool = False) -> nn.Module:
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if norms:  # a weight per head: this rank's heads'
        plan.update({"self_attn.q_norm": HeadwiseParallel(("weight",)), "self_attn.k_norm": HeadwiseParallel(("weight",))})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], plan)  # type: ignore[index]
    return model


def fixed_cohere(model: nn.Module, mesh: object) -> nn.Module:
    return naive_cohere(model, mesh, norms=True)


def naive_stablelm(model: nn.Module, mesh: object, norms: bool = False) -> nn.Module:
    """torch's styles on q, k, v, o and the MLP, with the head counts set to this rank's; ``norms``: the LayerNorm
    per head of ``q_layernorm`` and ``k_layernorm`` taken per head too (``HeadwiseParallel(modules=("norms",))``)."""
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.gate_proj": ColwiseParallel(),
                 "mlp.up_proj": ColwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    if norms:
        plan.update({f"self_attn.{n}": HeadwiseParallel(modules=("norms",)) for n in ("q_layernorm", "k_layernorm")})
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], plan)  # type: ignore[index]
        layer.self_attn.num_heads //= mesh["TP"].size()  # type: ignore[index]
        layer.self_attn.num_key_value_heads //= mesh["TP"].size()  # type: ignore[index]
    return model


def fixed_stablelm(model: nn.Module, mesh: object) -> nn.Module:
    return naive_stablelm(model, mesh, norms=True)


def naive_t5(model: nn.Module, mesh: object, tables: bool = False) -> nn.Module:
    for module in model.modules():
        if type(module).__name__ == "T5Attention":
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel()}
            if tables and module.has_relative_attention_bias:  # a column per head: this rank's heads
                plan["relative_attention_bias"] = ColwiseParallel()
            parallelize_module(module, mesh["TP"], plan)  # type: ignore[index]
        elif type(module).__name__ == "T5DenseActDense":
            parallelize_module(module, mesh["TP"], {"wi": ColwiseParallel(), "wo": RowwiseParallel()})  # type: ignore[index]
    return model


def fixed_t5(model: nn.Module, mesh: object) -> nn.Module:
    tp = mesh["TP"].size()  # type: ignore[index]
    model = naive_t5(model, mesh, tables=True)
    for module in model.modules():
        if type(module).__name__ == "T5Attention":
            module.n_heads //= tp  # the cross-attention's zeros of (1, n_heads, ...): this rank's heads
    return model


def naive_gpt_oss(model: nn.Module, mesh: object, sinks: bool = False) -> nn.Module:
    plan = {f"self_attn.{n}": ColwiseParallel() for n in ("q_proj", "k_proj", "v_proj")}
    plan["self_attn.o_proj"] = RowwiseParallel()
    if sinks:  # one logit per head: this rank's heads'
        plan["self_attn"] = HeadwiseParallel(("sinks",))
    for layer in model.model.layers:
        parallelize_module(layer, mesh["TP"], plan)  # type: ignore[index]
    return model


def fixed_gpt_oss(model: nn.Module, mesh: object) -> nn.Module:
    """:func:`naive_gpt_oss` with the sinks sharded, its experts over EP where the mesh has EP (GPT-OSS's experts
    take the routed contract under their own argument names), and FSDP2 where it has DP."""
    model = naive_gpt_oss(model, mesh, sinks=True)
    if mesh.get_strategy_size("EP") > 1:  # type: ignore[attr-defined]
        for layer in model.model.layers:
            parallelize_module(layer.mlp.experts, mesh["EP"], ExpertParallel())  # type: ignore[index]
    if mesh.get_strategy_size("DP") > 1:  # type: ignore[attr-defined]
        for layer in model.model.layers:
            fully_shard(layer)
        model = fully_shard(model)
    return model
