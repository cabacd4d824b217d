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

from vemesh.models.gpt.model import GPT
from vemesh.parallel.schedules import (MULTI_STAGE, SCHEDULES, V_SHAPED, ZERO_BUBBLE, stage_indices, stage_owner,
                                       stages_per_rank)

__all__ = ["MULTI_STAGE", "SCHEDULES", "V_SHAPED", "ZERO_BUBBLE", "cut_stage", "split_layers", "stage_indices",
           "stage_owner", "stages_per_rank"]


def split_layers(n_layer: int, n_stages: int) -> list[list[int]]:
    """Consecutive blocks per stage, as even as possible (earlier stages take the remainder).

    >>> split_layers(5, 2)
    [[0, 1, 2], [3, 4]]
    """
    if n_stages > n_layer:
        raise ValueError(f"{n_stages} pipeline stages cannot split {n_layer} layers (each stage needs at least one)")
    base, extra = divmod(n_layer, n_stages)
    out, start = [], 0
    for s in range(n_stages):
        n = base + (s < extra)
        out.append(list(range(start, start + n)))
        start += n
    return out


def cut_stage(model: GPT, stage: int, n_stages: int) -> GPT:
    """A copy of ``model`` holding only stage ``stage``'s blocks (and the embeddings or head at the ends)."""
    layers = {str(i) for i in split_layers(len(model.h), n_stages)[stage]}
    part = copy.deepcopy(model)
    for key in list(part.h.keys()):
        if key not in layers:
            del part.h[key]
    if stage != 0:
        part.wte = part.wpe = None
    if stage != n_stages - 1:
        part.ln_f = part.lm_head = None
    return part
