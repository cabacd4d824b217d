"""Optimizer state per parameter: torch's format for the ZeRO-1 optimizer, and by name for any optimizer.

:class:`~vemesh.optim.DistributedOptimizer` keeps its state as flat fp32 tensors over this DP
rank's slices. Its ``state_dict()`` is torch's per-parameter format instead, each state tensor
shaped and sharded like its parameter (a DTensor with its TP placements, or a plain tensor). On a
``(DP, TP) = (2, 2)`` mesh over ranks ``[[0, 1], [2, 3]]``, for a weight sharded over TP:

* :func:`gather_state_dict`: ranks 0 and 2 (the same TP shard, DP ranks 0 and 1) each write the
  elements they own into a zeroed buffer and all-reduce it over DP, so both hold the whole TP
  shard of ``exp_avg``; ranks 1 and 3 do the same for the other shard;
* :func:`scatter_state_dict`: every rank takes its TP shard of each state tensor and keeps the
  elements of the slices it owns.

:func:`get_optimizer_state` and :func:`set_optimizer_state` key that format by parameter name
(like torch's ``get_optimizer_state_dict``), for any optimizer whose ``state_dict()`` is
torch's, so :mod:`vemesh.checkpoint` treats ZeRO-1 and ``torch.optim.AdamW`` the same way.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor

from vemesh.parallel.ddp.distributed_data_parallel import DistributedDataParallel
from vemesh.parallel.ddp.grad_buffer import local_tensor
from vemesh.parallel.optim.param_buffer import ParamShard

__all__ = ["gather_state_dict", "scatter_state_dict", "local_state", "load_local_state", "get_optimizer_state", "set_optimizer_state", "MASTER"]

#: The state key holding fp32 master weights of bf16/fp16 parameters.
MASTER = "master_param"


class DistributedOptimizer(Protocol):
    """What this module reads of :class:`vemesh.optim.DistributedOptimizer` (named so, without importing it)."""

    models: list[DistributedDataParallel]
    optimizer: torch.optim.Optimizer
    param_groups: list[dict[str, Any]]
    shards: list[ParamShard]
    inner_at: Sequence[tuple[torch.nn.Parameter, int, int]]
    dp_group: dist.ProcessGroup

    def _start_gather(self) -> None: ...

    def _wait_gather(self) -> None: ...


def local_state(opt: DistributedOptimizer) -> dict[str, Any]:
    """The inner optimizer's state over this rank's slices, and the fp32 masters of bf16/fp16 models."""
    return {"inner": opt.optimizer.state_dict(),
            "masters": [m for shard in opt.shards if shard.copy_params for m in shard.main]}


@torch.no_grad()
def load_local_state(opt: DistributedOptimizer, state: dict[str, Any]) -> None:
    """Undo :func:`local_state` on the same rank of another replica, after the model weights were loaded."""
    for shard in opt.shards:
        shard.reload()
    masters = [m for shard in opt.shards if shard.copy_params for m in shard.main]
    if len(masters) != len(state["masters"]) or any(a.shape != b.shape for a, b in zip(masters, state["masters"])):
        raise ValueError("the local optimizer state comes from a rank with another layout of its shards; "
                         "every replica must run the same mesh, model and precision")
    if masters:
        torch._foreach_copy_(masters, list(state["masters"]))
    opt.optimizer.load_state_dict(state["inner"])


def _like(p: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


def _overlapping(ranges: tuple[tuple[int, int], ...], lo: int, hi: int) -> range:
    """Indices of the parameters whose buffer range overlaps ``[lo, hi)``."""
    starts = [s for s, _ in ranges]
    return range(max(bisect.bisect_right(starts, lo) - 1, 0), bisect.bisect_left(starts, hi))


def _group_index(opt: DistributedOptimizer) -> dict[int, int]:
    """``id(model parameter) -> its index over param_groups``, as in torch's state dicts."""
    return {id(p): i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])}


def _state_keys(opt: DistributedOptimizer) -> tuple[dict[str, torch.dtype], list[str]]:
    """Per-element keys (with dtypes) and scalar keys of the inner state, over all DP ranks (a collective)."""
    element: dict[str, str] = {}
    scalar: set[str] = set()
    problems: list[str] = []  # raised after the exchange, on every rank, so none is left waiting
    for inner, _, _ in opt.inner_at:
        for key, value in opt.optimizer.state.get(inner, {}).items():
            if torch.is_tensor(value) and value.ndim == 1 and value.numel() == inner.numel():
                element[key] = str(value.dtype).removeprefix("torch.")
            elif torch.is_tensor(value) and value.ndim == 0:
                scalar.add(key)
            else:
                problems.append(
                    f"optimizer state {key!r} of {type(opt.optimizer).__name__} is a {type(value).__name__} of another "
                    "shape; only per-element tensors and 0-dim tensors can be stated per parameter"
                )
    if dist.get_world_size(opt.dp_group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(opt.dp_group)
        dist.all_gather_object(gathered, (element, sorted(scalar), problems[:1]), group=opt.dp_group)
        for e, s, p in gathered:
            element.update(e)
            scalar.update(s)
            problems += p
    if problems:
        raise ValueError(problems[0])
    return {k: getattr(torch, v) for k, v in sorted(element.items())}, sorted(scalar)


@torch.no_grad()
def gather_state_dict(opt: DistributedOptimizer) -> dict[str, Any]:
    """See :meth:`DistributedOptimizer.state_dict`."""
    index = _group_index(opt)
    element_keys, scalar_keys = _state_keys(opt)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for si, shard in enumerate(opt.shards):  # each over its own group (the DP group, or the EDP group for experts)
        group = shard.group
        column = {id(p): c for c, p in enumerate(shard.params)}
        # scalars (Adam's step): [key, parameter], -inf where a rank has none; the max over the group wins
        table = torch.full((len(scalar_keys), len(shard.params)), -float("inf"), dtype=torch.float64)
        for inner, s, pos in opt.inner_at:
            if s != si:
                continue
            inner_state = opt.optimizer.state.get(inner, {})
            for row, key in enumerate(scalar_keys):
                if key in inner_state:
                    for i in _overlapping(shard.grad_buffer.layout.param_ranges, pos, pos + inner.numel()):
                        c = column[id(shard.params[i])]
                        table[row, c] = max(table[row, c].item(), float(inner_state[key]))
        if scalar_keys and dist.get_world_size(group) > 1:
            dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        numel = shard.grad_buffer.layout.numel
        device = shard.param_data.device
        full = {key: torch.zeros(numel, dtype=dtype, device=device) for key, dtype in element_keys.items()}
        for inner, s, pos in opt.inner_at:
            if s == si:
                for key, value in opt.optimizer.state.get(inner, {}).items():
                    if key in full:
                        full[key][pos : pos + inner.numel()] = value
        if shard.copy_params:
            full[MASTER] = torch.zeros(numel, dtype=torch.float32, device=device)
            for (_, lo, hi), main in zip(shard.runs, shard.main):
                full[MASTER][lo:hi] = main
        if dist.get_world_size(group) > 1:
            for work in [dist.all_reduce(t, group=group, async_op=True) for t in full.values()]:
                work.wait()  # type: ignore[union-attr]
        for p, (lo, hi) in zip(shard.params, shard.grad_buffer.layout.param_ranges):
            if id(p) not in index:
                continue
            shape = local_tensor(p).shape
            entry = {k: _like(p, full[k][lo:hi].view(shape).clone()) for k in element_keys}
            for row, key in enumerate(scalar_keys):
                value = table[row, column[id(p)]].item()
                if value > -float("inf"):
                    entry[key] = torch.tensor(value, dtype=torch.float32)
            if entry:  # no state before the first step, as torch
                if MASTER in full:
                    entry[MASTER] = _like(p, full[MASTER][lo:hi].view(shape).clone())
                state[index[id(p)]] = entry
    groups, start = [], 0
    for g in opt.param_groups:
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": list(range(start, start + len(g["params"])))})
        start += len(g["params"])
    return {"state": state, "param_groups": groups}


def _local_values(p: torch.Tensor, value: torch.Tensor, what: str) -> torch.Tensor:
    """This rank's elements of a state tensor for parameter ``p``, flat (a full tensor is sharded like ``p``)."""
    if isinstance(p, DTensor) and not isinstance(value, DTensor):
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{what} has shape {tuple(value.shape)}, the parameter {tuple(p.shape)}")
        value = distribute_tensor(value.to(p.device), p.device_mesh, p.placements, src_data_rank=None)
    local = local_tensor(value)
    if local.numel() != local_tensor(p).numel():
        raise ValueError(f"{what} has {local.numel()} local elements, the parameter {local_tensor(p).numel()}")
    return local.reshape(-1)


@torch.no_grad()
def scatter_state_dict(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """See :meth:`DistributedOptimizer.load_state_dict`."""
    saved_groups = state_dict["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(f"loaded state dict has {len(saved_groups)} param groups, this optimizer has {len(opt.param_groups)}")
    for gid, (saved, now) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(saved["params"]) != len(now["params"]):
            raise ValueError(
                f"loaded state dict's param group {gid} has {len(saved['params'])} parameters, this optimizer's has "
                f"{len(now['params'])}"
            )
    saved_state = state_dict["state"]
    by_param: dict[int, dict[str, torch.Tensor]] = {}
    names = {id(p): n for m in opt.models for n, p in m.module.named_parameters()}
    for saved, now in zip(saved_groups, opt.param_groups):
        for pid, p in zip(saved["params"], now["params"]):
            if pid in saved_state:
                by_param[id(p)] = saved_state[pid]
    inner_state: dict[int, dict[str, torch.Tensor]] = {}
    masters_loaded = False
    for si, shard in enumerate(opt.shards):
        ranges = shard.grad_buffer.layout.param_ranges
        device = shard.param_data.device
        with_state = [(i, p) for i, p in enumerate(shard.params) if id(p) in by_param]
        element = sorted({k for _, p in with_state for k, v in by_param[id(p)].items() if v.ndim > 0 and k != MASTER})
        full = {}
        for key in element + ([MASTER] if shard.copy_params else []):
            flat = full[key] = torch.zeros(shard.grad_buffer.layout.numel, dtype=torch.float32, device=device)
            for i, p in with_state:
                if key in by_param[id(p)]:
                    flat[ranges[i][0] : ranges[i][1]] = _local_values(p, by_param[id(p)][key], f"state {key!r} of {names[id(p)]!r}")
        for inner, s, pos in opt.inner_at:
            owners = [shard.params[i] for i in _overlapping(ranges, pos, pos + inner.numel()) if id(shard.params[i]) in by_param]
            if s != si or not owners:
                continue
            entry = {k: full[k][pos : pos + inner.numel()].clone() for k in element}
            for key in {k for o in owners for k, v in by_param[id(o)].items() if v.ndim == 0}:
                entry[key] = max((by_param[id(o)][key] for o in owners if key in by_param[id(o)]), key=float).clone()
            inner_state[id(inner)] = entry
        if MASTER in full and with_state and all(MASTER in by_param[id(p)] for _, p in with_state):
            torch._foreach_copy_(shard.main, [full[MASTER][lo:hi] for _, lo, hi in shard.runs])
            masters_loaded = True
        else:
            shard.reload()  # the fp32 copies start from the model's current weights
    inner_sd = opt.optimizer.state_dict()
    inner_params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    inner_sd["state"] = {i: inner_state[id(p)] for i, p in enumerate(inner_params) if id(p) in inner_state}
    for current, outer, saved in zip(inner_sd["param_groups"], opt.param_groups, saved_groups):
        hyper = {k: v for k, v in saved.items() if k != "params"}
        current.update(hyper)
        outer.update(hyper)
    opt.optimizer.load_state_dict(inner_sd)
    if masters_loaded:  # the masters are the weights: gather them into the models
        opt._start_gather()
        opt._wait_gather()


def _names_by_index(module: nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    name_of = {id(p): n for n, p in module.named_parameters()}
    names = []
    for gid, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(f"optimizer param group {gid} holds a tensor of shape {tuple(p.shape)} that is not a model parameter")
            names.append(name_of[id(p)])
    return names


def get_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` keyed by parameter name (a collective for ZeRO-1).

    Returns:
        ``{"state": {name: {key: tensor}}, "param_groups": [{..., "params": [names]}]}``; every
        state tensor is shaped (and sharded) like its parameter, or 0-dim.
    """
    names = _names_by_index(module, optimizer)
    sd = optimizer.state_dict()
    state = {names[i]: dict(entry) for i, entry in sd["state"].items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [names[i] for i in g["params"]]} for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def set_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer, osd: dict[str, Any]) -> None:
    """Load :func:`get_optimizer_state`'s form into ``optimizer``, matching parameters by name.

    Hyperparameters come from ``osd["param_groups"]`` (group by group); parameter membership
    stays this optimizer's own.
    """
    names = _names_by_index(module, optimizer)
    index = {n: i for i, n in enumerate(names)}
    groups, start = [], 0
    for now, saved in zip(optimizer.param_groups, osd["param_groups"]):
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(start, start + len(now["params"])))})
        start += len(now["params"])
    keep_master = getattr(optimizer, "_loads_master_params", False)  # other optimizers would keep it as stale state
    state = {index[n]: {k: v for k, v in entry.items() if keep_master or k != MASTER} for n, entry in osd["state"].items() if n in index}
    optimizer.load_state_dict({"state": state, "param_groups": groups})
