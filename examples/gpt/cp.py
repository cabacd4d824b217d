"""Context parallelism for the GPT of ``model.py``, applied from the outside as ``tp_plan.py`` applies TP.

Each rank of ``mesh["CP"]`` holds ``1/CP`` of every sequence: one contiguous slice, or with
head-tail load balancing two chunks, ``r`` and ``2 * CP - 1 - r`` of ``2 * CP``. Two things
change in the model, and nothing in ``model.py``:

* every attention layer calls ``vemesh.parallel.context.ring_attention`` over the CP group
  (torch's ring attention), so each query still sees every earlier key of the whole sequence;
* the position embedding looks up this rank's *global* positions.

The loss of each rank is the mean over its tokens; all ranks hold as many tokens, so the mean
over the DP x CP ranks is the mean over the global batch, and gradients are averaged over the
same flattened ``dp_cp`` group.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch
from torch.distributed.device_mesh import DeviceMesh

from model import GPT, causal_attention
from vemesh.parallel.context import positions, ring_attention, shard_sequence


class _ContextParallel:
    """What :func:`apply_cp` hangs on a model: the ring, this rank's positions, and an on/off switch."""

    def __init__(self, cp_mesh: DeviceMesh, seq_len: int, load_balance: bool, device: torch.device) -> None:
        self.ring = functools.partial(ring_attention, cp_mesh=cp_mesh, load_balance=load_balance)
        self.positions = positions(seq_len, cp_mesh.get_local_rank(), cp_mesh.size(), load_balance=load_balance,
                                   device=device)
        self.on = True

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
        # dropout is refused with CP at config time, so dropout_p is 0 here
        return self.ring(q, k, v) if self.on else causal_attention(q, k, v, dropout_p)

    def position_hook(self, module: torch.nn.Module, args: tuple) -> tuple | None:
        return (self.positions,) if self.on else None  # this rank's global positions, not 0..T_local-1


def apply_cp(model: GPT, cp_mesh: DeviceMesh, seq_len: int, load_balance: bool) -> GPT:
    """Make ``model`` (a full GPT or a pipeline stage of one) run on this CP rank's part of each sequence."""
    device = next(model.parameters()).device
    cp = _ContextParallel(cp_mesh, seq_len, load_balance, device)
    for block in model.h.values():
        block.attn.attention = cp.attention
    if model.wpe is not None:
        model.wpe.register_forward_pre_hook(cp.position_hook, prepend=True)  # before TP's input hooks
    model._context_parallel = cp
    return model


def shard_batch(t: torch.Tensor, cp_mesh: DeviceMesh, load_balance: bool) -> torch.Tensor:
    """This CP rank's tokens of a ``(B, T)`` batch, cut as :func:`apply_cp` expects them."""
    return shard_sequence(t, cp_mesh.get_local_rank(), cp_mesh.size(), dim=1, load_balance=load_balance)


@contextlib.contextmanager
def without_cp(model: GPT) -> Iterator[None]:
    """Run ``model`` on whole sequences for a while (generation: every CP rank holds every weight)."""
    cp = getattr(model, "_context_parallel", None)
    if cp is None:
        yield
        return
    cp.on = False
    try:
        yield
    finally:
        cp.on = True
