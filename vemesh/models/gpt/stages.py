"""Pipeline stages of the GPT: which blocks each stage holds, which PP rank holds each stage, and the cut.

A stage is the full ``GPT`` with the blocks of the other stages removed (torchtitan's way): the first stage
keeps ``wte``/``wpe``, the last ``ln_f``/``lm_head``, and every parameter keeps its full-model name
(``h.3.attn.q.weight`` stays that on whichever stage holds block 3), so a checkpoint saved with PP=2 loads
with PP=1 or PP=4. Stages go to PP ranks as torch's schedule requires: the looped schedules
(``interleaved-1f1b``, ``interleaved-zb``) place them round-robin (with PP=2, PP rank 0 holds stages 0
and 2), the V-shaped ones (``zbv``, ``dualpipev``) fold the pipeline back (PP rank 0 holds stages 0 and 3,
so the last stage and the loss sit on PP rank 0).
"""

from __future__ import annotations

import copy
from typing import Any

from torch import nn

from vemesh.models.gpt.model import GPT
from vemesh.parallel.schedules import (MULTI_STAGE, SCHEDULES, V_SHAPED, ZERO_BUBBLE, split_layers, stage_indices,
                                       stage_owner, stages_per_rank)

__all__ = ["MULTI_STAGE", "SCHEDULES", "V_SHAPED", "ZERO_BUBBLE", "copy_stage", "cut_stage", "split_layers", "stage_indices",
           "stage_kinds", "stage_owner", "stages_per_rank"]


def stage_kinds(n_blocks: int, pp_rank: int, pp: int, schedule: str, wrapped: Any = None) -> tuple:
    """What the stages of PP rank ``pp_rank`` hold when a model of ``n_blocks`` blocks is cut as the presets cut it
    (:func:`cut_stage`, :func:`split_layers`), without building it: for each stage, whether it is the first and the
    last, and for each of its blocks ``wrapped(i)`` of its number in the whole model (how the preset wraps block
    ``i``; None: every block alike). Two PP ranks of equal kinds hold alike stages.

    >>> stage_kinds(5, 1, 2, "1f1b")
    ((False, True, (None, None)),)
    """
    n_stages = pp * stages_per_rank(schedule)
    layers = split_layers(n_blocks, n_stages)
    return tuple((s == 0, s == n_stages - 1, tuple(wrapped(i) if wrapped else None for i in layers[s]))
                 for s in stage_indices(pp_rank, pp, schedule))


def cut_stage(model: GPT, stage: int, n_stages: int) -> GPT:
    """A copy of ``model`` holding only stage ``stage``'s blocks (and the embeddings or head at the ends)."""
    return copy_stage(model, "h", {str(i) for i in split_layers(len(model.h), n_stages)[stage]},
                      ("wte", "wpe") * (stage != 0) + ("ln_f", "lm_head") * (stage != n_stages - 1))


def copy_stage(model: nn.Module, container: str, keep: set[str], dropped: tuple[str, ...]) -> nn.Module:
    """A deep copy of ``model`` with only the blocks of its ``ModuleDict`` ``container`` named in ``keep``, and the
    submodules named in ``dropped`` set to None. What is left out is never copied: a copy of the whole model, cut
    after, held every block twice for a moment (and took, on fake tensors, what the whole model's copy takes)."""
    blocks = getattr(model, container)
    memo: dict[int, Any] = {id(m): None for key, m in blocks.items() if key not in keep}
    memo.update({id(m): None for name in dropped if (m := getattr(model, name)) is not None})
    part = copy.deepcopy(model, memo)
    kept = getattr(part, container)
    for key in [key for key, m in kept.items() if m is None]:
        del kept[key]
    return part
