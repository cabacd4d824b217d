"""A model and its optimizer as one flat dict of tensors that any mesh can read back.

Keys and what each rank puts under them (parameter names are the unwrapped module's)::

    model.h.0.attn.q.weight                          the parameter: a DTensor (TP-sharded) or a plain tensor
    optimizer.state.h.0.attn.q.weight.exp_avg        per-element state, sharded like the parameter
    optimizer.state.h.0.attn.q.weight.step           scalar state, a 0-dim tensor
    optimizer.state.h.0.attn.q.weight.master_param   fp32 master weights (ZeRO-1 with bf16/fp16 parameters)

Optimizer hyperparameters and param-group membership go to the manifest as JSON. The optimizer
state comes from :func:`vemesh.optim.get_optimizer_state` (torch's per-parameter format, by
name) for every optimizer, so a checkpoint written by a ZeRO-1
:class:`~vemesh.optim.DistributedOptimizer` on ``(DP, TP) = (2, 2)`` loads into a plain
``torch.optim.AdamW`` on one process, and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from vemesh.parallel.optim.state import MASTER, get_optimizer_state, set_optimizer_state
from vemesh.resilience.checkpoint.errors import IncompatibleCheckpointError

MODEL, OPTIM_STATE = "model.", "optimizer.state."
_V1_MASTER = "optimizer.master."  # fp32 masters in checkpoints of vemesh 0.1

#: A checkpoint entry as the loader sees it before reading: key -> (global shape, dtype name).
Entries = dict[str, tuple[tuple[int, ...], str]]

_MAX_PROBLEMS = 12  # differences listed in one error


class _Stages:
    """Several modules seen as one model: the pipeline stages one rank holds, whose names do not overlap."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.modules = modules

    def named_parameters(self) -> Iterator[tuple[str, nn.Parameter]]:
        for m in self.modules:
            yield from m.named_parameters()

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for m in self.modules:
            for key, value in m.state_dict().items():
                if key in out:
                    raise ValueError(f"model parts share the entry {key!r}; pipeline stages must hold different parameters")
                out[key] = value
        return out


def unwrap(model: nn.Module | Sequence[nn.Module]) -> Any:
    """The user's module inside vemesh's or torch's DistributedDataParallel (or the stages of a list)."""
    if isinstance(model, Sequence):
        return _Stages([unwrap(m) for m in model])
    while isinstance(model, nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def _union_over_ranks(names: list[list[str]]) -> list[list[str]]:
    """Per list, the names every rank holds taken together: pipeline stages hold different parameters."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return names
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, names)
    return [sorted(set().union(*(g[i] for g in gathered))) for i in range(len(names))]


def _model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    sd = module.state_dict()
    for key, value in sd.items():
        if not torch.is_tensor(value):
            raise ValueError(f"model state entry {key!r} is a {type(value).__name__}; vemesh checkpoints hold tensors only")
    return sd


# ----------------------------------------------------------------------- saving
def _algorithm(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer that defines the update: the inner one of a ZeRO-1 optimizer, else itself."""
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


def optimizer_state(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"state": {name: {key: tensor}}, "param_groups": [...]}``, checked to hold tensors shaped like the parameters."""
    osd = get_optimizer_state(module, optimizer)
    params = dict(module.named_parameters())
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            if not torch.is_tensor(value) or (value.ndim and value.shape != params[name].shape):
                raise ValueError(
                    f"optimizer state {key!r} of parameter {name!r} is a {type(value).__name__} of another shape; "
                    "vemesh checkpoints hold per-element tensors and scalars only"
                )
    return osd


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if torch.is_tensor(value) and value.numel() == 1:
        return value.item()
    if isinstance(value, (list, tuple)):
        items = [_jsonable(v) for v in value]
        return None if any(i is None and v is not None for i, v in zip(items, value)) else items
    return None


def save_state(model: nn.Module, optimizer: Any | None) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """The tensors to hand to DCP and the optimizer's JSON description for the manifest."""
    module = unwrap(model)
    tensors = {MODEL + k: v for k, v in _model_tensors(module).items()}
    if optimizer is None:
        return tensors, None
    osd = optimizer_state(module, optimizer)
    for name, entry in osd["state"].items():
        for key, value in entry.items():
            tensors[f"{OPTIM_STATE}{name}.{key}"] = value
    groups = [_json_group(g) for g in osd["param_groups"]]
    for group, names in zip(groups, _union_over_ranks([g["params"] for g in groups])):
        group["params"] = names  # the manifest (written by rank 0) lists every stage's parameters
    return tensors, {"class": type(_algorithm(optimizer)).__name__, "param_groups": groups}


def _json_group(group: dict[str, Any]) -> dict[str, Any]:
    """A param group's hyperparameters that JSON can hold (others are left out), and its parameter names."""
    out = {}
    for key, value in group.items():
        converted = _jsonable(value)
        if key != "params" and (converted is not None or value is None):
            out[key] = converted
    return {**out, "params": list(group["params"])}


# ---------------------------------------------------------------------- loading
def _group_names(module: nn.Module, optimizer: Any) -> list[list[str]]:
    name_of = {id(p): n for n, p in module.named_parameters()}
    return [[name_of.get(id(p), "?") for p in g["params"]] for g in optimizer.param_groups]


def _alloc_like(p: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Zeros shaped and sharded like ``p`` on this rank."""
    if isinstance(p, DTensor):
        local = torch.zeros(p._local_tensor.shape, dtype=dtype, device=p._local_tensor.device)
        return DTensor.from_local(local, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
    return torch.zeros(p.shape, dtype=dtype, device=p.device)


def _merge_hyperparameters(current: dict[str, Any], saved: dict[str, Any]) -> dict[str, Any]:
    """``saved``'s hyperparameters in the types of ``current`` (JSON lists back to tuples, tensors kept tensors)."""
    out = {}
    for key, value in saved.items():
        if key == "params" or key not in current:
            continue
        now = current[key]
        if isinstance(now, tuple) and isinstance(value, list):
            value = tuple(value)
        elif torch.is_tensor(now):
            value = torch.tensor(value, dtype=now.dtype, device=now.device)
        out[key] = value
    return out


def _shape(t: Any) -> str:
    return str(tuple(t))


def load_state(
    model: nn.Module, optimizer: Any | None, entries: Entries, optim_meta: dict[str, Any] | None, where: str, strict: bool
) -> tuple[dict[str, torch.Tensor], Callable[[], None]]:
    """The tensors for DCP to load into, and a function that applies the optimizer state afterwards.

    Every rank runs the same checks on the same ``entries`` and model shapes, so every rank
    raises the same :class:`IncompatibleCheckpointError` (listing every difference) or none does.
    """
    module = unwrap(model)
    params = dict(module.named_parameters())
    problems: list[str] = []
    template: dict[str, torch.Tensor] = {}
    for name, tensor in _model_tensors(module).items():
        kind = "parameter" if name in params else "buffer"
        if MODEL + name not in entries:
            if strict:
                problems.append(f"{kind} {name!r} of the model is not in the checkpoint")
            continue
        saved = entries[MODEL + name][0]
        if tuple(saved) != tuple(tensor.shape):
            problems.append(f"{kind} {name!r} has shape {_shape(saved)} in the checkpoint but {_shape(tensor.shape)} in the model")
        template[MODEL + name] = tensor
    model_keys = {MODEL + n for n in _union_over_ranks([list(module.state_dict())])[0]}  # every stage's
    unexpected = sorted(k[len(MODEL):] for k in entries if k.startswith(MODEL) and k not in model_keys)
    if unexpected and strict:
        problems.append(f"the checkpoint has {len(unexpected)} entries the model lacks: {_few(unexpected)}")

    finish: Callable[[], None] = lambda: None  # noqa: E731
    if optimizer is not None:
        finish = _optimizer_template(module, optimizer, params, model_keys, entries, optim_meta, strict, template, problems)
    problems = _union_over_ranks([problems])[0]  # pipeline stages check different parameters: all raise, or none
    if problems:
        shown = problems[:_MAX_PROBLEMS] + ([f"... and {len(problems) - _MAX_PROBLEMS} more"] if len(problems) > _MAX_PROBLEMS else [])
        raise IncompatibleCheckpointError(
            f"checkpoint '{where}' does not fit the {'model and optimizer' if optimizer is not None else 'model'}:\n  "
            + "\n  ".join(shown)
        )
    return template, finish


def _few(names: list[str], n: int = 5) -> str:
    return ", ".join(repr(x) for x in names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def _optimizer_template(
    module: nn.Module,
    optimizer: Any,
    params: dict[str, nn.Parameter],
    model_keys: set[str],
    entries: Entries,
    optim_meta: dict[str, Any] | None,
    strict: bool,
    template: dict[str, torch.Tensor],
    problems: list[str],
) -> Callable[[], None]:
    local_groups = _group_names(module, optimizer)
    current_groups = _union_over_ranks(local_groups)  # every pipeline stage's, as the manifest lists them
    if optim_meta is None:
        problems.append("it was saved without optimizer state; pass optimizer=None to load the model only")
        return lambda: None
    algorithm = type(_algorithm(optimizer)).__name__
    if strict and optim_meta.get("class") != algorithm:
        problems.append(f"its optimizer is {optim_meta.get('class')}, not {algorithm}")
    saved_groups = optim_meta["param_groups"]
    if len(saved_groups) != len(current_groups):
        problems.append(f"its optimizer has {len(saved_groups)} param groups, this one has {len(current_groups)}")
    elif strict:
        for gid, (saved, now) in enumerate(zip(saved_groups, current_groups)):
            if set(saved["params"]) != set(now):
                diff = sorted(set(saved["params"]) ^ set(now))
                problems.append(f"optimizer param group {gid} differs in parameters {_few(diff)}")

    state_keys: dict[str, list[tuple[str, str]]] = {}  # name -> [(state key, checkpoint key)]
    for key, (shape, dtype) in entries.items():
        if key.startswith(OPTIM_STATE):
            name, _, skey = key[len(OPTIM_STATE):].rpartition(".")
        elif key.startswith(_V1_MASTER):  # written by vemesh 0.1 before masters became a state key
            name, skey = key[len(_V1_MASTER):], MASTER
        else:
            continue
        if name not in params:
            if strict and MODEL + name not in model_keys:  # else another pipeline stage holds it
                problems.append(f"the checkpoint has optimizer state {skey!r} for {name!r}, which the model lacks")
            continue
        if tuple(shape) not in ((), tuple(params[name].shape)):
            if tuple(entries.get(MODEL + name, ((),))[0]) == tuple(params[name].shape):  # else reported above
                problems.append(f"optimizer state {skey!r} of {name!r} has shape {_shape(shape)}, the parameter {_shape(params[name].shape)}")
            continue
        state_keys.setdefault(name, []).append((skey, key))
        p = params[name]
        template[key] = torch.zeros((), dtype=getattr(torch, dtype)) if not shape else _alloc_like(p, getattr(torch, dtype))
    if state_keys and strict:
        missing = sorted(n for g in local_groups for n in g if n not in state_keys)
        if missing:
            problems.append(f"the checkpoint has no optimizer state for {_few(missing)}")

    def finish() -> None:
        groups = [
            {**_merge_hyperparameters(now, saved), "params": saved["params"]}
            for now, saved in zip(optimizer.param_groups, saved_groups)
        ]
        state = {n: {skey: template[key] for skey, key in keys} for n, keys in state_keys.items()}
        set_optimizer_state(module, optimizer, {"state": state, "param_groups": groups})

    return finish
