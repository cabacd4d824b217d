"""The routing of fake tokens, which have no values: how many slots each expert and each EP rank gets in a plan.

A traced micro-batch runs on fake tensors, so a router's choices are unknown. The planner decides them:

* ``torch.bincount(slots, minlength=E)``, as a mixture of experts counts its slots per expert, answers an equal
  count per expert (a real tensor, so ``.tolist()`` and ``split`` work);
* :func:`vemesh.parallel.experts.exchange.dispatch` sends an equal share to every EP rank, and the traced rank
  (the busiest) receives ``load_factor`` times the balanced share: ``F = 1`` is the balance the load-balancing
  loss aims at; a run's measured ``expert_load`` (the busiest EP rank's slots over the mean) is the ``F`` that
  reproduces it. The exchange then runs as in a run: the counts' all-to-all, the tokens', the regrouping by
  expert, and the way back.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist

import vemesh.parallel.experts.exchange as exchange
import vemesh.parallel.experts.style as style

__all__ = ["check_load_factor", "routing", "spread"]


def check_load_factor(value: object) -> float:
    """``value`` as a load factor, or a one-line ``ValueError`` naming it."""
    try:
        factor = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        factor = float("nan")
    if not factor >= 1.0 or factor == float("inf"):
        raise ValueError(f"the MoE load factor must be a number >= 1 (the busiest EP rank's slots over the balanced "
                         f"share; 1 is balanced); got {value!r}")
    return factor


def spread(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` counts as equal as can be, the first ones one larger: ``spread(7, 3) == [3, 2, 2]``."""
    return [total // parts + (i < total % parts) for i in range(parts)]


@contextmanager
def routing(load_factor: float = 1.0) -> Iterator[dict[str, bool]]:
    """Inside: balanced expert counts, and the traced EP rank receives ``load_factor`` x its balanced share.

    Yields a dict whose ``"used"`` turns true when a mixture of experts counted its slots or exchanged tokens
    (so a plan can say what it assumed).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    factor = check_load_factor(load_factor)
    real_bincount, real_dispatch = torch.bincount, style.dispatch
    seen = {"used": False}

    def bincount(slots: torch.Tensor, weights: torch.Tensor | None = None, minlength: int = 0) -> torch.Tensor:
        if not minlength or weights is not None:
            return real_bincount(slots, weights, minlength)
        seen["used"] = True
        with unset_fake_temporarily():
            return torch.tensor(spread(slots.numel(), minlength), dtype=torch.long)

    def dispatch(tokens: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup):  # type: ignore[no-untyped-def]
        seen["used"] = True
        size, experts = dist.get_world_size(group), counts.numel()
        if experts % size:
            raise ValueError(f"{experts} experts do not split over EP {size}: each EP rank holds E / EP of them")
        dist.all_to_all_single(torch.empty_like(counts), counts, group=group)  # the counts go first, as in a run
        send = spread(tokens.size(0), size)
        arriving = round(factor * tokens.size(0))  # the busiest rank: F x the balanced share of slots
        with unset_fake_temporarily():
            received = torch.tensor([spread(n, experts // size) for n in spread(arriving, size)], dtype=torch.long)
            order = exchange.source_to_expert_order(received)
            recv, local = received.sum(1).tolist(), received.sum(0)
        arrived = exchange._exchange(tokens, recv, send, group)
        return arrived[order], local, exchange.Dispatched(send, recv, order)

    torch.bincount, style.dispatch = bincount, dispatch  # type: ignore[assignment]
    try:
        yield seen
    finally:
        torch.bincount, style.dispatch = real_bincount, real_dispatch  # type: ignore[assignment]
