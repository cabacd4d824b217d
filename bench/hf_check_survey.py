"""``vemesh check`` on HF transformers' decoders under torch's plain TP styles: the verdict, and the recipe it offers.

Each model is built small (2 layers, width 64, 4 heads, a vocabulary of 128) from the library's own code, and
parallelized the way a user first writes it: torch's ``ColwiseParallel`` on every Linear named as a q, k, v, gate, up
or fused projection, ``RowwiseParallel`` on every output or down projection (:func:`naive`). The check runs it at TP
2 against one process and says whether it is exact, and where it is not, what it tried: each row gives the verdict,
whether a recipe the hints name made the check exact, and the styles and settings those hints name.

    python bench/hf_check_survey.py [--models bloom,mpt,...] [--json OUT]

Which models and configurations: :data:`CONFIGS` (``*_qk``: the model's q/k norm switched on; ``falcon_alibi``: Falcon
with ALiBi). The table in docs/checking.md ("HF decoders under torch's plain styles") was made by it.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

import torch
from torch import nn

VOCAB = 128
_COLUMN = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|fc1|fc_in|dense_h_to_4h|query_key_value|qkv_proj|"
                     r"Wqkv|gate_up_proj|c_attn|c_fc)$")
_ROW = re.compile(r"(o_proj|down_proj|fc2|fc_out|out_proj|dense_4h_to_h|attention\.dense|self_attention\.dense|"
                  r"self_attn\.dense|c_proj)$")
_BASE = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
             max_position_embeddings=64)
_GPT2ISH = dict(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
                attn_pdrop=0.0)

#: name -> (config class, model class, the config's arguments)
CONFIGS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "apertus": ("ApertusConfig", "ApertusForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16)),
    "bitnet": ("BitNetConfig", "BitNetForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16)),
    "bloom": ("BloomConfig", "BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                                                      hidden_dropout=0.0, attention_dropout=0.0)),
    "codegen": ("CodeGenConfig", "CodeGenForCausalLM", dict(_GPT2ISH, rotary_dim=8)),
    "cohere": ("CohereConfig", "CohereForCausalLM", dict(_BASE, num_key_value_heads=2, pad_token_id=0)),
    "cohere_qk": ("CohereConfig", "CohereForCausalLM", dict(_BASE, num_key_value_heads=2, pad_token_id=0,
                                                            use_qk_norm=True)),
    "falcon_alibi": ("FalconConfig", "FalconForCausalLM", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=False,
        new_decoder_architecture=False, parallel_attn=True, bias=False, alibi=True, hidden_dropout=0.0,
        attention_dropout=0.0)),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16,
                                                             sliding_window=8)),
    "glm": ("GlmConfig", "GlmForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16, pad_token_id=0)),
    "gpt_bigcode": ("GPTBigCodeConfig", "GPTBigCodeForCausalLM", dict(_GPT2ISH, multi_query=False)),
    "gptj": ("GPTJConfig", "GPTJForCausalLM", dict(_GPT2ISH, rotary_dim=8)),
    "granite": ("GraniteConfig", "GraniteForCausalLM", dict(_BASE, num_key_value_heads=2)),
    "helium": ("HeliumConfig", "HeliumForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16)),
    "laguna": ("LagunaConfig", "LagunaForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16, num_experts=4,
                                                         num_experts_per_tok=2, moe_intermediate_size=32,
                                                         shared_expert_intermediate_size=32)),
    "mistral4": ("Mistral4Config", "Mistral4ForCausalLM", dict(
        _BASE, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
        v_head_dim=16, n_routed_experts=4, n_group=1, topk_group=1, num_experts_per_tok=2, moe_intermediate_size=32,
        pad_token_id=0)),
    "mpt": ("MptConfig", "MptForCausalLM", dict(vocab_size=VOCAB, d_model=64, n_layers=2, n_heads=4, expansion_ratio=2,
                                                max_seq_len=32, resid_pdrop=0.0, emb_pdrop=0.0)),
    "olmo": ("OlmoConfig", "OlmoForCausalLM", dict(_BASE)),
    "persimmon": ("PersimmonConfig", "PersimmonForCausalLM", dict(_BASE, qk_layernorm=True)),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_BASE, resid_pdrop=0.0, embd_pdrop=0.0, attention_dropout=0.0)),
    "seed_oss": ("SeedOssConfig", "SeedOssForCausalLM", dict(_BASE, num_key_value_heads=2, head_dim=16)),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", dict(_BASE, num_key_value_heads=4, hidden_dropout=0.0,
                                                              attention_dropout=0.0)),
    "stablelm_qk": ("StableLmConfig", "StableLmForCausalLM", dict(_BASE, num_key_value_heads=4, qk_layernorm=True,
                                                                  hidden_dropout=0.0, attention_dropout=0.0)),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", dict(_BASE, num_key_value_heads=2)),
    "xglm": ("XGLMConfig", "XGLMForCausalLM", dict(vocab_size=VOCAB, d_model=64, ffn_dim=128, num_layers=2,
                                                   attention_heads=4, max_position_embeddings=64, dropout=0.0,
                                                   attention_dropout=0.0, activation_dropout=0.0, pad_token_id=0)),
}


def make(name: str) -> nn.Module:
    """The model of :data:`CONFIGS` ``name``, from the library's own classes."""
    import transformers

    config, model, kwargs = CONFIGS[name]
    return getattr(transformers, model)(getattr(transformers, config)(**kwargs))


def step(model: nn.Module, micro_batch_size: int) -> None:
    ids = torch.randint(0, VOCAB, (micro_batch_size, 16))
    model(input_ids=ids, labels=ids).loss.backward()


def naive(model: nn.Module, mesh: Any) -> nn.Module:
    """torch's plain styles by the Linears' names, as a first TP plan is written (the head left whole)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for name, module in list(model.named_modules()):
        if isinstance(module, nn.Linear) and "lm_head" not in name:
            style = ColwiseParallel() if _COLUMN.search(name) else RowwiseParallel() if _ROW.search(name) else None
            if style is not None:
                parallelize_module(model, mesh["TP"], {name: style})
    return model


#: what a hint names, as the table gives it
_NAMED = re.compile(r"FusedColwiseParallel\(\d\)|HeadwiseParallel\((?:[^()]|\([^()]*\))*\)|SequenceParallel\(sequence_dim=\d|"
                    r"ColwiseParallel\(output_layouts=Replicate\(\)\)|module\.\w+ //= tp|out\.clone\(\)|"
                    r"(?<!Fused)ColwiseParallel\(\)(?= on )|SumGradOverTP\(start=\d+\)")


def survey(names: list[str]) -> list[dict[str, Any]]:
    from vemesh.check import check

    rows = []
    for name in names:
        started = time.monotonic()
        result = check(f"module:{__file__}:make", f"{__file__}:naive", f"{__file__}:step", world_size=2, tp=2,
                       model_kwargs={"name": name})
        said = " ".join(result.hints)
        named = list(dict.fromkeys(m.replace("SequenceParallel(sequence_dim=", "SequenceParallel(dim ") + (
            ")" if m.startswith("SequenceParallel") else "") for m in _NAMED.findall(said)))
        verdict = result.verdict + (" (nothing split over TP)" if result.tp_whole_model else "")
        rows.append({"model": name, "verdict": verdict, "recipe exact": "makes the check exact" in said,
                     "hints name": named, "seconds": round(time.monotonic() - started, 1)})
        print(f"{name:14} {verdict:8} recipe exact: {str(rows[-1]['recipe exact']):5}  "
              f"{'; '.join(named) or '-'}  ({rows[-1]['seconds']} s)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(CONFIGS), help="comma-separated, of: " + ", ".join(CONFIGS))
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(CONFIGS)}")
    rows = survey(names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":  # each rank of the check imports this module again
    main()
