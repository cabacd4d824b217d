"""The hints ``vemesh check`` gives where a model numbers its positions from what one rank holds.

Under CP, ``context_parallel`` cuts the sequence, and a module that computes from positions (a rotary or learned
position embedding) must get each token's position in the whole sequence (:func:`positions_hint`); under sequence
parallelism, a model that numbers its positions from the length of the hidden states it holds numbers one TP rank's
part (:func:`sequence_positions_hint`).
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vemesh.check.layouts import SIZES, output_length
from vemesh.check.recipes import Swap
from vemesh.check.result import CheckResult, _some, went_wrong
from vemesh.check.run import Spec
from vemesh.check.whole_input import Tries

__all__ = ["positions_hint", "positions_recipe", "sequence_positions_hint"]


def _mismatch(tp: int, failed: list[dict], ref: dict) -> tuple[int, int] | None:
    """(part, whole) where a run's forward raised on a tensor of a part of the sequence against one TP times as long,
    under a plan that shards the sequence; else None. The whole is the sequence's length or a TP rank's part of it
    (one TP times as long as the other, twice cut), by the one-process output of the module that shards it: not
    features that TP splits (OLMo 2's norm over a projection's whole width)."""
    went = failed[0].get("went", {}) if failed else {}
    if not went.get("sequence"):
        return None
    sizes = SIZES.search(failed[0]["message"])
    part, whole = sorted(map(int, sizes.groups())) if sizes else (0, 0)
    dim = went.get("sequence_dim", [1])[0]
    length = output_length(ref, went["sequence"][0], dim)
    if length is not None and not any(whole * tp ** k == length for k in range(3)):
        return None
    return (part, whole) if sizes and whole == part * tp else None


def sequence_positions_hint(spec: Spec, ref: dict, failed: list[dict], tries: Tries) -> tuple[list[str], int] | None:
    """Under sequence parallelism (a RowwiseParallel whose output is sharded), the forward raised where a tensor of a
    part of the sequence met one TP times as long. Where nothing gathers the sequence back before the ColwiseParallel
    Linears of the module that raised (:func:`_ungathered`), that is said and the plan completed as torchtitan's is
    tried; else, likeliest, the model made its positions (position ids, rotary tables, a causal mask) from the length
    of the hidden states it holds, each TP rank's part (Hugging Face's decoders number them from the embedding's
    output). The hints and the runs made, or None."""
    tp = spec.degrees["TP"]
    if tp == 1 or (sizes := _mismatch(tp, failed, ref)) is None:
        return None
    part, whole = sizes
    arg = ref.get("positions_arg")
    where, went = failed[0].get("module"), failed[0]["went"]
    said = (f"{'the forward of ' + where if where else 'the forward'} met a tensor of {part} positions with one of "
            f"{whole} = {part} x TP {tp}: the plan shards the sequence over TP ({went['sequence'][0]}'s "
            f"RowwiseParallel gives each TP rank {part} of the {whole})")
    numbered = ("a model that numbers its positions from the length of the hidden states it holds (Hugging Face's "
                "decoders make their position ids, rotary tables and causal mask from the embedding's output) numbers "
                "the part. Give it the whole sequence's "
                + (f"positions: model(x, {arg}=torch.arange(T).unsqueeze(0)) in the step" if arg is not None else
                   "positions where your model numbers them"))
    if (ungathered := _ungathered(where or "", went)) is None:
        return [f"{said}, and {numbered}"], 0
    holders, norms, text = ungathered
    swaps = (Swap(holders, 1, "sequence-gathered"), Swap(norms, 1, "sequence-norms"))
    trial, t_ranks, t_failed, now = tries.run(swaps)
    more: list[str] = []
    if t_ranks and trial.first_module is None and not trial.error and trial.gradients and not trial.broken_ties:
        runs, exact = tries.gradients(swaps, trial, t_ranks, more)  # the forward matched: the gradients' recipes
    else:
        runs, exact = 0, False
    if trial.exact:
        outcome = "makes the check exact"
    elif more:
        outcome = (f"every output then matches, and with the gradients' recipe{'s' * (len(more) > 1)} below "
                   + ("it is exact" if exact else "gradients still differ"))
    elif _mismatch(tp, t_failed, ref) and (masked := re.search(r" in (\w*attention\w*): ", t_failed[0]["message"])):
        outcome = (f"then {masked[1]} raised on {part} positions against {whole}: the attention adds a causal mask "
                   "that the model made from the length of the hidden states it holds, each TP rank's part (Gemma 2's "
                   "eager attention, whose position_ids do not change it). Give it the whole sequence's mask: a 4-D "
                   "attention_mask of shape (batch, 1, T, T), 0 where a query sees a key and -inf elsewhere, with the "
                   "whole sequence's positions")
    elif _mismatch(tp, t_failed, ref):
        outcome = f"then the forward raised on {part} positions against {whole} again: {numbered}"
    elif trial.first_module is not None:  # past the sequence's gathers, another cause: its own hint, once completed
        outcome = (f"the run then {went_wrong(trial, now)}, past where it raised: another cause; complete the plan as "
                   "above and check again for its hint")
    else:
        outcome = went_wrong(trial, now)
    for names in trial.broken_ties[:1]:
        outcome += (f"; and the plan broke a tie: {' and '.join(names)} are one parameter in the model as built and "
                    "several after parallelize (shard every end the same way with vemesh.parallel.parallelize_module, "
                    "or re-tie them)")
    return [f"{said}{text}. Tried: the sequence gathered into {_some(holders, 2)} and "
            f"SequenceParallel(use_local_output=True) on {_some(norms, 2) if norms else 'no norm (none found)'}: "
            f"{outcome}", *more], 1 + runs


def _ungathered(where: str, went: dict) -> tuple[tuple[str, ...], tuple[str, ...], str] | None:
    """Where nothing in the plan gathers the sharded sequence back before the ``ColwiseParallel`` Linears inside
    ``where`` (no ``PrepareModuleInput`` of a sharded input on it, above it or inside it, and none of them takes a
    sharded input): the modules that hold the plan's Linears of that kind (to gather into), the norms it leaves whole,
    and what to give them, in torchtitan's words. None where something does (the positions are then the likelier
    cause)."""
    def inside(name: str, scope: str) -> bool:
        return not scope or name == scope or name.startswith(scope + ".")

    cols = [n for n in went.get("colwise", []) if inside(n, where)]
    if not cols or any(inside(g, where) or inside(where, g) for g in went.get("gathers", [])):
        return None
    gathers = set(went.get("gathers", []))
    holders = tuple(dict.fromkeys(n.rpartition(".")[0] for n in went["colwise"] if n not in gathers))
    here = [h for h in holders if inside(h, where) or inside(where, h)]
    norms = tuple(n for n in went.get("norms", []) if not any(inside(n, h) for h in holders))  # not a head's norm
    dim = went.get("sequence_dim", [1])[0]
    return holders, norms, (
        f", and nothing gathers it back before the ColwiseParallel Linears that take the whole sequence "
        f"({', '.join(cols[:3])}{', ...' if len(cols) > 3 else ''}). torchtitan's sequence-parallel plan gathers "
        f"it on the modules that hold them: PrepareModuleInput(input_layouts=(Shard({dim}),), "
        f"desired_input_layouts=(Replicate(),)) on {' and '.join(here[:2])} (input_kwarg_layouts where the "
        "forward takes the hidden states by name), and SequenceParallel() on the norms between, in each block "
        "(use_local_output=True where a norm's output joins the plain residual stream, after the attention); "
        "or, for no sequence parallelism, no sharded output on a RowwiseParallel and no sharded input on a "
        "ColwiseParallel")


def positions_hint(spec: Spec, ref: dict, result: CheckResult) -> str | None:
    """Under CP, the first module that differs (the ones before it match, and gradients differ) holds no parameters
    or is an embedding: it computes from positions (a rotary embedding, a learned position embedding such as GPT-2's
    ``wpe``) and saw this rank's local positions, not its part of the sequence's."""
    first, cp = result.first_module, spec.degrees["CP"]
    if cp == 1 or first is None or not result.gradients:
        return None
    if first.get("scalar"):
        return _loss_hint(first["module"], cp)
    if not first["module"]:
        return None
    if (module := first["module"]) in ref.get("embeddings", ()):
        what = "is an embedding"
    elif not any(n.startswith(first["module"] + ".") for n in ref["grads"]):
        what = "holds no parameters"
    else:
        return None
    return (f"{first['module']} {what} and is the first module that differs under CP {cp}; likeliest, it computes "
            "from positions (a rotary or learned position embedding) and got this rank's local ones, where it needs "
            "each token's position in the whole sequence. "
            f"context_parallel cuts the sequence into {2 * cp} chunks (CP rank r keeps chunks r and {2 * cp - 1} - r); "
            + positions_recipe(ref.get("positions_arg"), _numbered_from((ref.get("embeddings") or {}).get(module))))


def _numbered_from(indices: Any) -> int:
    """Where a learned position embedding's indices in one process were, in every row, ``k, k + 1, ...``: ``k``
    (RoBERTa numbers from its padding index + 1), else 0."""
    if not isinstance(indices, torch.Tensor) or not indices.dim() or indices.is_floating_point() or not indices.numel():
        return 0
    rows = indices.reshape(-1, indices.shape[-1])
    start = rows[:, :1]
    if not torch.equal(rows, start + torch.arange(rows.shape[1])) or not torch.equal(start, start[:1].expand_as(start)):
        return 0
    return int(start[0, 0])


def _loss_hint(module: str, cp: int) -> str:
    """Under CP, the first output that differs is a scalar, every one before it matching: a loss the model computes
    (HF's ``labels=``), each CP rank's the mean over its own tokens. The check compares their mean over CP (the mean
    the gradients' average takes), which is one process's loss when every CP rank counts as many tokens."""
    return (f"the first output that differs is a scalar of {module or 'the root'} (a loss the model computes, as "
            f"Hugging Face's labels=), and every output before it matches: each of the CP {cp} ranks' is the mean "
            "over its own part of the sequence, and their mean (which the gradients' average over CP takes) is not "
            "one process's when the ranks count different numbers of tokens (labels of -100, padding). Divide each "
            "rank's sum of token losses by the mean count per CP rank (the sequence's count, all-reduced over "
            "mesh['CP'], over CP), or give every CP rank as many counted tokens")


def positions_recipe(arg: str | None, start: int = 0) -> str:
    """How to give the model its positions cut with the tokens: by the name its forward takes them under, else to
    the module that numbers them; numbered from ``start``, as one process's model numbers them."""
    numbers = f"torch.arange({start}, T + {start})" if start else "torch.arange(T)"
    cut = (f"cut the positions with the tokens: positions = {numbers}.expand(B, T).contiguous() in "
           "buffers=[..., positions] with buffer_seq_dims=[..., 1], "
           + (f"numbered from {start} as the model numbers them in one process, " if start else ""))
    if arg is not None:
        return cut + f"then model(x, {arg}=positions) (or a RoPE table in buffers, with its sequence dim)"
    return (cut + "then give them to the module that numbers the positions: your model's forward takes none by "
            "name (or put its RoPE table in buffers, with its sequence dim)")
