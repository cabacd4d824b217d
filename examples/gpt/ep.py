"""Expert parallelism for the MoE layers of ``model.py``, applied from the outside as ``tp_plan.py`` applies TP.

Each rank of ``mesh["EP"]`` keeps ``E / EP`` of every MoE layer's experts (still keyed by their
global numbers, so checkpoints name each expert the same way on any EP size), and the MoE's
``dispatch`` becomes an exchange over the EP group:

1. every rank has its token slots grouped by expert number (the MoE does that);
2. one all-to-all of the slot counts tells each rank how many slots it gets from every rank for
   each of its experts;
3. an all-to-all with uneven splits sends the slots to the ranks of their experts, the
   experts run, and a second one sends the outputs back (both through torch's autograd-aware
   collective, so backward runs the same exchange the other way).

On EP = 2 with 4 experts, rank 0 holds experts 0 and 1: it keeps its own slots for them,
receives rank 1's, sends its slots for experts 2 and 3 to rank 1, and gets their outputs back.
The EP group folds over the ranks that hold different parts of the batch (DP, or DP x CP), so the
experts of a token are always reachable within its data-parallel peers.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from model import GPT, Experts


def experts_of(ep_rank: int, ep_size: int, n_experts: int) -> range:
    """The expert numbers EP rank ``ep_rank`` holds: a contiguous run of ``n_experts // ep_size``."""
    per = n_experts // ep_size
    return range(ep_rank * per, (ep_rank + 1) * per)


def source_to_expert_order(received: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups received slots from (source rank, expert) order to (expert, source).

    ``received[s, e]`` is how many slots source rank ``s`` sent for this rank's ``e``-th expert;
    they arrive source by source, each source's grouped by expert. With ``[[1, 2], [3, 0]]`` the
    arrivals are ``s0e0, s0e1, s0e1, s1e0, s1e0, s1e0`` and the result ``[0, 3, 4, 5, 1, 2]``.
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
    the opposite exchange. torch's functional collective (the one ``torch.distributed.nn`` now points to)."""
    return funcol.wait_tensor(funcol.all_to_all_single_autograd(x.contiguous(), recv, send, group))


class ExpertParallelDispatch:
    """A MoE's ``dispatch`` over ``ep_mesh``: tokens to the ranks of their experts and back."""

    def __init__(self, ep_mesh: DeviceMesh, n_experts: int) -> None:
        self.group = ep_mesh.get_group()
        self.size = ep_mesh.size()
        self.per_rank = n_experts // self.size

    def __call__(self, tokens: torch.Tensor, counts: torch.Tensor, experts: Experts) -> torch.Tensor:
        # counts (E,): this rank's slots per expert; chunk r of it goes to EP rank r
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        received = received.view(self.size, self.per_rank)  # [source, my expert]
        send = counts.view(self.size, self.per_rank).sum(1).tolist()
        recv = received.sum(1).tolist()
        arrived = _exchange(tokens, recv, send, self.group)
        order = source_to_expert_order(received)
        out = experts(arrived[order], received.sum(0))  # (arrivals, C), grouped by expert
        back = out[order.argsort()]  # in arrival order again
        return _exchange(back, send, recv, self.group)


def apply_ep(model: GPT, ep_mesh: DeviceMesh) -> GPT:
    """Keep this EP rank's experts in every MoE layer of ``model`` and exchange tokens over ``ep_mesh``.

    Every rank must have built the same full model (same seed), as for TP: each keeps its slice.
    """
    for moe in model.moe_layers():
        mine = experts_of(ep_mesh.get_local_rank(), ep_mesh.size(), moe.n_experts)
        moe.experts = Experts({k: e for k, e in moe.experts.items() if int(k) in mine})
        moe.dispatch = ExpertParallelDispatch(ep_mesh, moe.n_experts)
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every MoE layer's experts (the router is a dense parameter)."""
    return [p for m in model.modules() if hasattr(m, "experts") and hasattr(m, "dispatch")
            for p in m.experts.parameters()]


def layout_line(mesh, n_experts: int) -> str:
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
