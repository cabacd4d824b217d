"""The hints ``vemesh check`` gives where a model numbers its positions from what one rank holds.

Under CP, ``context_parallel`` cuts the sequence, and a module that computes from positions (a rotary or learned
position embedding) must get each token's position in the whole sequence (:func:`positions_hint`); under sequence
parallelism, a model that numbers its positions from the length of the hidden states it holds numbers one TP rank's
part (:func:`sequence_positions_hint`).
"""

from __future__ import annotations

import re

from vemesh.check.result import CheckResult
from vemesh.check.run import Spec

__all__ = ["positions_hint", "positions_recipe", "sequence_positions_hint"]


def sequence_positions_hint(spec: Spec, ref: dict, failed: list[dict]) -> str | None:
    """Under sequence parallelism (a RowwiseParallel whose output is sharded), the forward raised where a tensor of a
    part of the sequence met one TP times as long: likeliest, the model made its positions (position ids, rotary
    tables, a causal mask) from the length of the hidden states it holds, each TP rank's part (Hugging Face's
    decoders number them from the embedding's output)."""
    tp = spec.degrees["TP"]
    if tp == 1 or not failed or not failed[0].get("went", {}).get("sequence"):
        return None
    sizes = re.search(r"size of tensor a \((\d+)\) must match the size of tensor b \((\d+)\)", failed[0]["message"])
    if sizes is None:
        return None
    part, whole = sorted(map(int, sizes.groups()))
    if whole != part * tp:
        return None
    arg = ref.get("positions_arg")
    where, went = failed[0].get("module"), failed[0]["went"]
    said = (f"{'the forward of ' + where if where else 'the forward'} met a tensor of {part} positions with one of "
            f"{whole} = {part} x TP {tp}: the plan shards the sequence over TP ({went['sequence'][0]}'s "
            f"RowwiseParallel gives each TP rank {part} of the {whole})")
    if (ungathered := _ungathered(where or "", went)) is not None:
        return said + ungathered
    return (said + ", and a model that numbers its positions "
            "from the length of the hidden states it holds (Hugging Face's decoders make their position ids, rotary "
            "tables and causal mask from the embedding's output) numbers the part. Give it the whole sequence's "
            + (f"positions: model(x, {arg}=torch.arange(T).unsqueeze(0)) in the step" if arg is not None else
               "positions where your model numbers them"))


def _ungathered(where: str, went: dict) -> str | None:
    """Where nothing in the plan gathers the sharded sequence back before the ``ColwiseParallel`` Linears inside
    ``where`` (no ``PrepareModuleInput`` of a sharded input on it, above it or inside it, and none of them takes a
    sharded input): what to give them, in torchtitan's words. None where something does (then the positions are the
    likelier cause)."""
    def inside(name: str, scope: str) -> bool:
        return not scope or name == scope or name.startswith(scope + ".")

    cols = [n for n in went.get("colwise", []) if inside(n, where)]
    if not cols or any(inside(g, where) or inside(where, g) for g in went.get("gathers", [])):
        return None
    holders = list(dict.fromkeys(n.rpartition(".")[0] for n in cols))
    return (f", and nothing gathers it back before the ColwiseParallel Linears that take the whole sequence "
            f"({', '.join(cols[:3])}{', ...' if len(cols) > 3 else ''}). torchtitan's sequence-parallel plan gathers "
            f"it on the modules that hold them: PrepareModuleInput(input_layouts=(Shard(1),), "
            f"desired_input_layouts=(Replicate(),)) on {' and '.join(holders[:2])} (input_kwarg_layouts where the "
            "forward takes the hidden states by name), and SequenceParallel() on the norms between, in each block; "
            "or, for no sequence parallelism, no sharded output on a RowwiseParallel and no sharded input on a "
            "ColwiseParallel")


def positions_hint(spec: Spec, ref: dict, result: CheckResult) -> str | None:
    """Under CP, the first module that differs (the ones before it match, and gradients differ) holds no parameters
    or is an embedding: it computes from positions (a rotary embedding, a learned position embedding such as GPT-2's
    ``wpe``) and saw this rank's local positions, not its part of the sequence's."""
    first, cp = result.first_module, spec.degrees["CP"]
    if cp == 1 or first is None or not first["module"] or not result.gradients:
        return None
    if first["module"] in ref.get("embeddings", ()):
        what = "is an embedding"
    elif not any(n.startswith(first["module"] + ".") for n in ref["grads"]):
        what = "holds no parameters"
    else:
        return None
    return (f"{first['module']} {what} and is the first module that differs under CP {cp}; likeliest, it computes "
            "from positions (a rotary or learned position embedding) and got this rank's local ones, where it needs "
            "each token's position in the whole sequence. "
            f"context_parallel cuts the sequence into {2 * cp} chunks (CP rank r keeps chunks r and {2 * cp - 1} - r); "
            + positions_recipe(ref.get("positions_arg")))


def positions_recipe(arg: str | None) -> str:
    """How to give the model its positions cut with the tokens: by the name its forward takes them under, else to
    the module that numbers them."""
    cut = ("cut the positions with the tokens: positions = torch.arange(T).expand(B, T).contiguous() in "
           "buffers=[..., positions] with buffer_seq_dims=[..., 1], ")
    if arg is not None:
        return cut + f"then model(x, {arg}=positions) (or a RoPE table in buffers, with its sequence dim)"
    return (cut + "then give them to the module that numbers the positions: your model's forward takes none by "
            "name (or put its RoPE table in buffers, with its sequence dim)")
