"""``vemesh check`` on HF transformers' Llama-family decoders under a first sequence-parallel plan: the recipe it tries.

A first sequence-parallel plan shards the outputs (torchtitan's Llama plan without what gathers the sequence back):
the embedding's ``RowwiseParallel`` and each block's ``o_proj`` and ``down_proj`` give each TP rank its part of the
sequence (``Shard(1)``), ``q``/``k``/``v`` and ``gate``/``up`` (or a fused ``gate_up_proj``) are plain
``ColwiseParallel``, and there is no ``PrepareModuleInput`` on the attention or the MLP and no ``SequenceParallel`` on
the norms (:func:`sp_ungathered`). The
step gives the whole sequence's ``position_ids``. The check names what is missing and tries the plan completed (the
sequence gathered into the modules that hold the ``ColwiseParallel`` Linears, the norms under ``SequenceParallel``),
then the gradients' recipes with it kept; each row says whether that made the check exact, and where not, how the
hint ends.

    python bench/hf_check_sp_survey.py [--models llama,qwen3,...] [--json OUT]

Each model is built small (2 layers, width 256, 8 query and 4 KV heads of 32, a vocabulary of 1024, 128 positions;
untied embeddings) from the library's own classes (:data:`MODELS`). docs/checking.md gives the count.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

SEQ, VOCAB = 128, 1024

#: name -> the prefix of the library's ``...Config`` and ``...ForCausalLM`` classes
MODELS = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3", "gemma": "Gemma",
          "gemma2": "Gemma2", "olmo": "Olmo", "olmo2": "Olmo2", "olmo3": "Olmo3", "granite": "Granite",
          "helium": "Helium", "cohere": "Cohere", "stablelm": "StableLm", "smollm3": "SmolLM3", "exaone4": "Exaone4",
          "seed_oss": "SeedOss", "glm": "Glm", "ministral": "Ministral", "apertus": "Apertus", "arcee": "Arcee"}
_EAGER = {"gemma2"}  # transformers runs their attention eagerly only


def make(name: str) -> nn.Module:
    import transformers

    prefix = MODELS[name]
    config = getattr(transformers, prefix + "Config")(
        vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=8,
        num_key_value_heads=4, head_dim=32, max_position_embeddings=SEQ, tie_word_embeddings=False, pad_token_id=0,
        attn_implementation="eager" if name in _EAGER else "sdpa")
    return getattr(transformers, prefix + "ForCausalLM")(config)


def sp_ungathered(model: nn.Module, mesh: Any) -> nn.Module:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["TP"]
    parallelize_module(model, tp, {
        "model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())})
    for layer in model.model.layers:
        plan = {f"self_attn.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
        plan.update({f"mlp.{p}": ColwiseParallel() for p in ("gate_proj", "up_proj", "gate_up_proj")
                     if hasattr(layer.mlp, p)})
        plan.update({"self_attn.o_proj": RowwiseParallel(output_layouts=Shard(1)),
                     "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1))})
        parallelize_module(layer, tp, plan)
    return model


def step(model: nn.Module, micro_batch_size: int) -> torch.Tensor:
    tokens = torch.randint(0, VOCAB, (micro_batch_size, SEQ + 1))
    logits = model(input_ids=tokens[:, :-1], position_ids=torch.arange(SEQ).unsqueeze(0)).logits
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), tokens[:, 1:].reshape(-1))
    loss.backward()
    return loss.detach()


def survey(names: list[str]) -> list[dict[str, Any]]:
    from vemesh.check import check

    rows = []
    for name in names:
        started = time.monotonic()
        result = check(f"module:{__file__}:make", f"{__file__}:sp_ungathered", f"{__file__}:step", world_size=2,
                       tp=2, model_kwargs={"name": name})
        first = result.hints[0] if result.hints else ""
        exact = first.endswith("makes the check exact") or first.endswith("below it is exact")
        tail = first.rpartition(": ")[2] if "Tried:" in first else first[:100] or result.error[:100]
        rows.append({"model": name, "verdict": result.verdict, "recipe exact": exact,
                     "gathering hint": "nothing gathers it back" in first, "hint ends": tail[-140:],
                     "seconds": round(time.monotonic() - started, 1)})
        print(f"{name:10} {result.verdict:8} recipe exact: {str(exact):5}  {tail[-110:]}  ({rows[-1]['seconds']} s)",
              flush=True)
    print(f"{sum(r['recipe exact'] for r in rows)} of {len(rows)} exact with the recipes tried", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated, of: " + ", ".join(MODELS))
    parser.add_argument("--json", help="write the rows here too")
    args = parser.parse_args()
    names = [n for n in args.models.split(",") if n]
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        parser.error(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
    rows = survey(names)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":  # each rank of the check imports this module again
    main()
