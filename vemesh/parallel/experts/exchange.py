"""The token exchange of expert parallelism: tokens to the ranks of their experts and back, over the EP group.

Each rank holds ``E / EP`` experts, a contiguous run (EP rank ``r`` holds experts ``r * E/EP`` to ``(r + 1) * E/EP - 1``,
as Megatron numbers them). Its tokens arrive grouped by expert number, with the count per expert. Then:

1. one all-to-all of the counts tells each rank how many tokens it gets from every rank for each of its experts;
2. an all-to-all with uneven splits sends each token to the rank of its expert;
3. the arrivals, ordered by source and then expert, are regrouped by expert (:func:`source_to_expert_order`);
   the local experts run; the results go back in arrival order, and a second all-to-all returns them.

Both token exchanges go through torch's autograd-aware functional all-to-all, so backward runs the same
exchange the other way. On EP = 2 with 4 experts, rank 0 holds experts 0 and 1: it keeps its own tokens for
them, receives rank 1's, and sends its tokens for experts 2 and 3 to rank 1, which sends back their outputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

__all__ = ["Dispatched", "combine", "dispatch", "source_to_expert_order"]


def source_to_expert_order(received: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups received tokens from (source rank, expert) order to (expert, source).

    ``received[s, e]`` is how many tokens source rank ``s`` sent for this rank's ``e``-th expert; they arrive
    source by source, each source's grouped by expert. With ``[[1, 2], [3, 0]]`` the arrivals are
    ``s0e0, s0e1, s0e1, s1e0, s1e0, s1e0`` and the result ``[0, 3, 4, 5, 1, 2]``.
    """
    flat = received.reshape(-1)
    starts = (flat.cumsum(0) - flat).view_as(received)  # where block (s, e) begins among the arrivals
    lengths = received.t().reshape(-1)  # blocks in (expert, source) order
    block_starts = starts.t().reshape(-1)
    offsets = torch.arange(int(lengths.sum()), device=received.device)
    offsets = offsets - torch.repeat_interleave(lengths.cumsum(0) - lengths, lengths)
    return torch.repeat_interleave(block_starts, lengths) + offsets


def _exchange(x: torch.Tensor, recv: list[int], send: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Rows of ``x`` to the group's ranks (``send[r]`` to rank r), ``recv[r]`` rows back from each; autograd runs
    the opposite exchange (torch's functional collective, the one ``torch.distributed.nn`` points to)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group))


@dataclass(frozen=True)
class Dispatched:
    """What :func:`combine` needs to send a dispatch's results back."""

    send: list[int]
    recv: list[int]
    order: torch.Tensor


def dispatch(tokens: torch.Tensor, counts: torch.Tensor, group: dist.ProcessGroup) -> tuple[torch.Tensor, torch.Tensor, Dispatched]:
    """This rank's tokens (grouped by expert, ``counts[e]`` for expert ``e`` of all ``E``) to the ranks of their experts.

    Returns:
        The tokens for this rank's experts grouped by local expert, the count per local expert, and the plan back.
    """
    size = dist.get_world_size(group)
    if counts.numel() % size:
        raise ValueError(f"{counts.numel()} experts do not split over EP {size}: each EP rank holds E / EP of them")
    received = torch.empty_like(counts)
    dist.all_to_all_single(received, counts, group=group)
    received = received.view(size, -1)  # [source rank, my expert]
    send = counts.view(size, -1).sum(1).tolist()
    recv = received.sum(1).tolist()
    arrived = _exchange(tokens, recv, send, group)
    order = source_to_expert_order(received)
    return arrived[order], received.sum(0), Dispatched(send, recv, order)


def combine(out: torch.Tensor, plan: Dispatched, group: dist.ProcessGroup) -> torch.Tensor:
    """The results of :func:`dispatch`'s tokens, back to the ranks they came from, in their original order."""
    return _exchange(out[plan.order.argsort()], plan.send, plan.recv, group)
