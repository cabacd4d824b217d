"""The example's mixture-of-experts bookkeeping; expert parallelism itself is the library's.

``vemesh.parallel.ExpertParallel`` (applied by ``vemesh.models.gpt.parallelize``) spreads each MoE layer's
grouped experts over ``mesh["EP"]``: EP rank ``r`` holds experts ``r * E/EP`` to ``(r + 1) * E/EP - 1`` and
tokens reach them by all-to-all. Here: that layout as a start-up line, the counts the load-balancing loss
sums over the batch's ranks, and the router's load for the metrics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


def experts_of(ep_rank: int, ep_size: int, n_experts: int) -> range:
    """The expert numbers EP rank ``ep_rank`` holds: a contiguous run of ``n_experts // ep_size``."""
    per = n_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def experts_line(mesh, n_experts: int) -> str:
    """This rank's place in the expert layout, for the start-up log."""
    ep = mesh.get_strategy_size("EP")
    mine = experts_of(mesh.lookup_rank("EP"), ep, n_experts)
    return (f"  rank {dist.get_rank()}: experts {mine.start}..{mine.stop - 1} of each MoE layer; "
            f"EP group {dist.get_process_group_ranks(mesh.get_group('EP'))} (EP rank {mesh.lookup_rank('EP')}), "
            f"EDP group {dist.get_process_group_ranks(mesh.get_group('EDP'))}")


def sum_counts(group: dist.ProcessGroup):
    """A MoE ``count``: the slot counts summed over ``group`` (the ranks that share the batch)."""
    def count(counts: torch.Tensor) -> torch.Tensor:
        total = counts.clone()
        dist.all_reduce(total, group=group)
        return total
    return count


def take_load(model: nn.Module, group: dist.ProcessGroup) -> list[list[int]]:
    """The token slots each expert of each MoE layer received since the last call, over ``group``; then clear."""
    layers = [m for m in model.modules() if hasattr(m, "load_sum")]
    if not layers:
        return []
    load = torch.stack([m.load_sum if m.load_sum is not None else torch.zeros(m.n_experts, dtype=torch.long, device=m.router.weight.device)
                        for m in layers]).to(torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(load, group=group)
    for m in layers:
        m.load_sum = None
    return load.round().long().tolist()
