"""What the tests that compare a parallel run with one process share: the data-parallel wrapping, the optimizer,
the loss averaged over the data ranks, the whole parameters, and the comparison."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.optim import DistributedOptimizer
from vemesh.parallel import fully_shard


def wrap(model: torch.nn.Module, blocks: Iterable[torch.nn.Module], how: str) -> torch.nn.Module:
    """vemesh DDP with no group (the mesh's data dims, experts over EDP), or FSDP2 on each block and the root."""
    if how == "ddp":
        return DDP(model)
    for block in blocks:
        fully_shard(block)
    return fully_shard(model)


def optimizer(model: torch.nn.Module, which: str, **adamw: Any) -> torch.optim.Optimizer:
    """vemesh's ZeRO-1 over the DDP model (``"zero1"``), or torch's AdamW."""
    if which == "zero1":
        return DistributedOptimizer(torch.optim.AdamW, models=[model], **adamw)
    return torch.optim.AdamW(model.parameters(), **adamw)


def one_process(model: torch.nn.Module, batches: Iterable[tuple[torch.Tensor, torch.Tensor]], loss_of: Any,
                before_step: Any = None, **adamw: Any) -> list[float]:
    """The reference: ``model`` trained in one process with torch's AdamW on each whole batch; each step's loss.
    ``before_step(model)`` runs between backward and the optimizer's step (a MoE's load balancing)."""
    opt = torch.optim.AdamW(model.parameters(), **adamw)
    losses = []
    for x, y in batches:
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        if before_step is not None:
            before_step(model)
        opt.step()
        losses.append(loss.item())
    return losses


def data_parallel_steps(model: torch.nn.Module, opt: torch.optim.Optimizer, mesh: Any, dims: Any, batches: Any,
                        loss_of: Any, steps: int, before_step: Any = None) -> list[float]:
    """``steps`` steps of this DP rank's share of each global batch (``batches(step)``), the loss averaged over the
    gradient's data dims each step. ``before_step(group)`` runs between backward and the optimizer's step."""
    rows = mesh.lookup_rank("DP")
    data = mesh.get_group(dims.grad_dim) if dims.grad_dim else None
    losses = []
    for step in range(steps):
        opt.zero_grad()
        x, y = (t.chunk(dims.dp)[rows].clone() for t in batches(step))
        loss = loss_of(model, x, y)
        loss.backward()
        if before_step is not None:
            before_step(data)
        opt.step()
        losses.append(mean_over(loss, data))
    return losses


def mean_over(loss: torch.Tensor, group: dist.ProcessGroup | None) -> float:
    """The loss averaged over ``group`` (the ranks holding equal shares of the global batch)."""
    total = loss.detach().clone()
    if group is not None:
        dist.all_reduce(total, group=group)
        total /= dist.get_world_size(group)
    return total.item()


def whole_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole (a DTensor's full tensor), by its name in the unwrapped model."""
    return {n.removeprefix("module."): (p.full_tensor() if isinstance(p, DTensor) else p).detach()
            for n, p in model.named_parameters()}


def compare(got: dict[str, Any], ref: tuple[list[float], dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The largest difference of any step's loss and of any final parameter from the one-process run."""
    losses, params = ref
    assert set(got["params"]) == set(params), sorted(set(got["params"]) ^ set(params))
    diffs = {n: (got["params"][n] - p).abs().max().item() for n, p in params.items()}
    worst = max(diffs, key=diffs.__getitem__)
    return {"loss_diff": max(abs(a - b) for a, b in zip(got["losses"], losses)), "param_diff": diffs[worst],
            "worst": worst, "losses": got["losses"], "ref": losses}
