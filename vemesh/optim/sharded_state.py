"""ZeRO-1 optimizer state to and from a mesh-independent, per-parameter form.

:class:`~vemesh.optim.DistributedOptimizer` keeps its state as flat fp32 tensors over this DP
rank's slices of the buffers. A checkpoint wants instead, per parameter, each state tensor
shaped and sharded like the parameter (a DTensor with its TP placements, or a plain tensor):
the form of torch's ``get_optimizer_state_dict``, keyed by parameter name. On a
``(DP, TP) = (2, 2)`` mesh over ranks ``[[0, 1], [2, 3]]``, for a weight sharded over TP:

* :func:`sharded_state_dict`: ranks 0 and 2 (the same TP shard, DP ranks 0 and 1) each write
  the elements they own into a zeroed buffer and all-reduce it over DP, so both hold the whole
  TP shard of ``exp_avg``; ranks 1 and 3 do the same for the other shard;
* :func:`load_sharded_state_dict`: every rank gets its TP shard of each state tensor (loaded
  from whatever mesh wrote it) and keeps the elements of the slices it owns.

Scalar state (Adam's ``step``) is one 0-dim tensor per parameter.
"""

from __future__ import annotations

import bisect
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from ..ddp.grad_buffer import local_tensor

if TYPE_CHECKING:
    from .distributed_optimizer import DistributedOptimizer

__all__ = ["sharded_state_dict", "load_sharded_state_dict", "param_group_names"]


def _names(opt: DistributedOptimizer) -> list[list[str]]:
    """Per buffer, each parameter's name in buffer order (prefixed ``i.`` with several models)."""
    out = []
    for i, m in enumerate(opt.models):
        prefix = f"{i}." if len(opt.models) > 1 else ""
        name_of = {id(p): prefix + n for n, p in m.module.named_parameters()}
        out += [[name_of[id(p)] for p in b.params] for b in m.buffers]
    return out


def param_group_names(opt: DistributedOptimizer) -> list[list[str]]:
    """The names of the parameters in each param group (the same on every rank)."""
    groups: list[list[str]] = [[] for _ in opt.optimizer.param_groups]
    for shard, names in zip(opt._shards, _names(opt)):
        for p, name in zip(shard.buffer.params, names):
            if id(p) in opt._group_of:
                groups[opt._group_of[id(p)]].append(name)
    return groups


def _inner_positions(opt: DistributedOptimizer) -> list[tuple[nn.Parameter, int, int, int]]:
    """``(inner param, shard index, start in the buffer, numel)`` for each inner param with elements."""
    out = []
    for group in opt.optimizer.param_groups:
        for inner in group["params"]:
            if inner.numel() == 0:
                continue
            ptr, offset = inner.untyped_storage().data_ptr(), inner.storage_offset()
            found = [
                (si, start + offset - main.storage_offset())
                for si, shard in enumerate(opt._shards)
                for (_, start, _), main in zip(shard.runs, shard.main)
                if main.untyped_storage().data_ptr() == ptr and 0 <= offset - main.storage_offset() < main.numel()
            ]
            assert len(found) == 1, "an inner optimizer parameter is not a slice of exactly one run"
            out.append((inner, found[0][0], found[0][1], inner.numel()))
    return out


def _overlapping(ranges: tuple[tuple[int, int], ...], lo: int, hi: int) -> range:
    """Indices of the parameters whose buffer range overlaps ``[lo, hi)``."""
    starts = [s for s, _ in ranges]
    return range(max(bisect.bisect_right(starts, lo) - 1, 0), bisect.bisect_left(starts, hi))


def _like(p: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    if isinstance(p, DTensor):
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return local


def _state_keys(opt: DistributedOptimizer, positions: list) -> tuple[dict[str, torch.dtype], dict[str, torch.dtype]]:
    """Per-element and scalar state keys with their dtypes, over all DP ranks (a collective)."""
    element: dict[str, str] = {}
    scalar: dict[str, str] = {}
    problems: list[str] = []  # raised after the exchange, on every rank, so none is left waiting
    for inner, _, _, n in positions:
        for key, value in opt.optimizer.state.get(inner, {}).items():
            if torch.is_tensor(value) and value.ndim == 1 and value.numel() == n:
                element[key] = str(value.dtype).removeprefix("torch.")
            elif torch.is_tensor(value) and value.ndim == 0:
                scalar[key] = str(value.dtype).removeprefix("torch.")
            else:
                problems.append(
                    f"optimizer state {key!r} of {type(opt.optimizer).__name__} is a {type(value).__name__} of "
                    "another shape; only per-element tensors and 0-dim tensors can be saved per parameter"
                )
    if dist.get_world_size(opt._dp_group) > 1:
        gathered: list[Any] = [None] * dist.get_world_size(opt._dp_group)
        dist.all_gather_object(gathered, (element, scalar, problems[:1]), group=opt._dp_group)
        for e, s, p in gathered:
            element.update(e)
            scalar.update(s)
            problems += p
    if problems:
        raise ValueError(problems[0])
    return (
        {k: getattr(torch, v) for k, v in sorted(element.items())},
        {k: getattr(torch, v) for k, v in sorted(scalar.items())},
    )


def _scalar_table(opt: DistributedOptimizer, keys: list[str], positions: list, counts: list[int]) -> torch.Tensor:
    """``[key, parameter]``: each scalar state per parameter, -inf where it has none (max over DP)."""
    offsets = [sum(counts[:i]) for i in range(len(counts))]
    table = torch.full((len(keys), sum(counts)), -float("inf"), dtype=torch.float64)
    for inner, si, pos, n in positions:
        state = opt.optimizer.state.get(inner, {})
        for row, key in enumerate(keys):
            if key in state:
                for i in _overlapping(opt._shards[si].buffer.layout.param_ranges, pos, pos + n):
                    table[row, offsets[si] + i] = max(table[row, offsets[si] + i].item(), float(state[key]))
    if keys and dist.get_world_size(opt._dp_group) > 1:
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=opt._dp_group)
    return table


@torch.no_grad()
def sharded_state_dict(opt: DistributedOptimizer) -> dict[str, Any]:
    """See :meth:`DistributedOptimizer.sharded_state_dict`."""
    names = _names(opt)
    positions = _inner_positions(opt)
    element_keys, scalar_keys = _state_keys(opt, positions)
    table = _scalar_table(opt, list(scalar_keys), positions, [len(n) for n in names])
    state: dict[str, dict[str, torch.Tensor]] = {}
    masters: dict[str, torch.Tensor] = {}
    col = 0
    for si, shard in enumerate(opt._shards):
        buffer = shard.buffer
        full: dict[str, torch.Tensor] = {}  # this rank's whole local buffer, per key, after the all-reduce
        for key, dtype in element_keys.items():
            flat = full[key] = torch.zeros(buffer.layout.numel, dtype=dtype, device=buffer.data.device)
            for inner, s, pos, n in positions:
                if s == si and key in opt.optimizer.state.get(inner, {}):
                    flat[pos : pos + n] = opt.optimizer.state[inner][key]
        if shard.copy_params:
            flat = full[" master"] = torch.zeros(buffer.layout.numel, dtype=torch.float32, device=buffer.data.device)
            for (_, lo, hi), main in zip(shard.runs, shard.main):
                flat[lo:hi] = main
        if dist.get_world_size(opt._dp_group) > 1:
            for work in [dist.all_reduce(t, group=opt._dp_group, async_op=True) for t in full.values()]:
                work.wait()  # type: ignore[union-attr]
        for i, (p, (lo, hi)) in enumerate(zip(buffer.params, buffer.layout.param_ranges)):
            name, shape = names[si][i], local_tensor(p).shape
            entry = {k: _like(p, full[k][lo:hi].view(shape)) for k in element_keys}
            for row, (key, dtype) in enumerate(scalar_keys.items()):
                if table[row, col + i].item() > -float("inf"):
                    entry[key] = torch.tensor(table[row, col + i].item(), dtype=dtype)
            if entry and id(p) in opt._group_of:
                state[name] = entry
            if " master" in full:
                masters[name] = _like(p, full[" master"][lo:hi].view(shape))
        col += len(buffer.params)
    groups = [
        {**{k: v for k, v in group.items() if k != "params"}, "params": group_names}
        for group, group_names in zip(opt.optimizer.param_groups, param_group_names(opt))
    ]
    out: dict[str, Any] = {"state": state, "param_groups": groups}
    if masters:
        out["master_params"] = masters
    return out


@torch.no_grad()
def load_sharded_state_dict(opt: DistributedOptimizer, state_dict: dict[str, Any]) -> None:
    """See :meth:`DistributedOptimizer.load_sharded_state_dict`."""
    names = _names(opt)
    positions = _inner_positions(opt)
    state: dict[str, dict[str, torch.Tensor]] = state_dict["state"]
    masters: dict[str, torch.Tensor] = state_dict.get("master_params") or {}
    missing = [n for ns in names for n in ns if n not in masters] if masters else []
    if missing:
        raise KeyError(f"master_params lacks {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    inner_state: dict[int, dict[str, torch.Tensor]] = {}
    for si, shard in enumerate(opt._shards):
        buffer = shard.buffer
        ranges = buffer.layout.param_ranges
        with_state = [(i, n) for i, n in enumerate(names[si]) if n in state]
        element = sorted({k for _, n in with_state for k, v in state[n].items() if v.ndim > 0})
        full = {}
        for key in element:
            flat = full[key] = torch.zeros(buffer.layout.numel, dtype=torch.float32, device=buffer.data.device)
            for i, n in with_state:
                flat[ranges[i][0] : ranges[i][1]] = local_tensor(state[n][key]).reshape(-1)
        for inner, s, pos, n in positions:
            owners = [names[si][i] for i in _overlapping(ranges, pos, pos + n) if names[si][i] in state]
            if s != si or not owners:
                continue
            entry = {k: full[k][pos : pos + n].clone() for k in element}
            for key in {k for o in owners for k, v in state[o].items() if v.ndim == 0}:
                entry[key] = max((state[o][key] for o in owners if key in state[o]), key=float).clone()
            inner_state[id(inner)] = entry
        if masters:  # fp32 masters, or the parameter buffer itself for fp32 models
            flat = torch.zeros(buffer.layout.numel, dtype=torch.float32, device=buffer.data.device)
            for i, (lo, hi) in enumerate(ranges):
                flat[lo:hi] = local_tensor(masters[names[si][i]]).reshape(-1)
            torch._foreach_copy_(shard.main, [flat[lo:hi] for _, lo, hi in shard.runs])
    inner_sd = opt.optimizer.state_dict()
    inner_params = [p for g in opt.optimizer.param_groups for p in g["params"]]
    inner_sd["state"] = {i: inner_state[id(p)] for i, p in enumerate(inner_params) if id(p) in inner_state}
    for current, saved in zip(inner_sd["param_groups"], state_dict["param_groups"]):
        current.update({k: v for k, v in saved.items() if k != "params"})
    opt.optimizer.load_state_dict(inner_sd)
    if masters:
        opt._sync_model_params()
