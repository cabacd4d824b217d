"""A model and its optimizer as one flat dict of tensors that any mesh can read back.

Keys and what each rank puts under them (parameter names are the unwrapped module's)::

    model.h.0.attn.q.weight                the parameter: a DTensor (TP-sharded) or a plain tensor
    optimizer.state.h.0.attn.q.weight.exp_avg   per-element state, sharded like the parameter
    optimizer.state.h.0.attn.q.weight.step      scalar state, a 0-dim tensor
    optimizer.master.h.0.attn.q.weight     fp32 master weights (ZeRO-1 with bf16/fp16 parameters)

Optimizer hyperparameters and param-group membership go to the manifest as JSON. Because
every state tensor is shaped like its parameter, a checkpoint written by a ZeRO-1
:class:`~vemesh.optim.DistributedOptimizer` on ``(DP, TP) = (2, 2)`` loads into a plain
``torch.optim.AdamW`` on one process, and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .errors import IncompatibleCheckpointError

MODEL, OPTIM_STATE, OPTIM_MASTER = "model.", "optimizer.state.", "optimizer.master."

#: A checkpoint entry as the loader sees it before reading: key -> (global shape, dtype name).
Entries = dict[str, tuple[tuple[int, ...], str]]

_MAX_PROBLEMS = 12  # differences listed in one error


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside vemesh's or torch's DistributedDataParallel."""
    from ..ddp import DistributedDataParallel

    while isinstance(model, (DistributedDataParallel, nn.parallel.DistributedDataParallel)):
        model = model.module
    return model


def _is_zero(optimizer: Any) -> bool:
    from ..optim import DistributedOptimizer

    return isinstance(optimizer, DistributedOptimizer)


def _model_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    sd = module.state_dict()
    for key, value in sd.items():
        if not torch.is_tensor(value):
            raise ValueError(f"model state entry {key!r} is a {type(value).__name__}; vemesh checkpoints hold tensors only")
    return sd


# ----------------------------------------------------------------------- saving
def _plain_optimizer_state(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    name_of = {id(p): n for n, p in module.named_parameters()}
    state: dict[str, dict[str, torch.Tensor]] = {}
    groups = []
    for gid, group in enumerate(optimizer.param_groups):
        names = []
        for p in group["params"]:
            if id(p) not in name_of:
                raise ValueError(f"optimizer param group {gid} holds a tensor of shape {tuple(p.shape)} that is not a model parameter")
            name = name_of[id(p)]
            names.append(name)
            for key, value in optimizer.state.get(p, {}).items():
                if not torch.is_tensor(value) or (value.ndim and value.shape != p.shape):
                    raise ValueError(
                        f"optimizer state {key!r} of parameter {name!r} is a {type(value).__name__} of another shape; "
                        "vemesh checkpoints hold per-element tensors and scalars only"
                    )
                state.setdefault(name, {})[key] = value
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": names})
    return {"state": state, "param_groups": groups}


def optimizer_state(module: nn.Module, optimizer: Any) -> dict[str, Any]:
    """``{"state": {name: {key: tensor}}, "param_groups": [...], "master_params"?: {...}}`` (collective for ZeRO-1)."""
    if _is_zero(optimizer):
        return optimizer.sharded_state_dict()
    return _plain_optimizer_state(module, optimizer)


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
    for name, value in osd.get("master_params", {}).items():
        tensors[OPTIM_MASTER + name] = value
    inner = optimizer.optimizer if _is_zero(optimizer) else optimizer
    return tensors, {"class": type(inner).__name__, "param_groups": [_json_group(g) for g in osd["param_groups"]]}


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
    if _is_zero(optimizer):
        from ..optim.sharded_state import param_group_names

        return param_group_names(optimizer)
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
    model_keys = {MODEL + n for n in module.state_dict()}
    unexpected = sorted(k[len(MODEL):] for k in entries if k.startswith(MODEL) and k not in model_keys)
    if unexpected and strict:
        problems.append(f"the checkpoint has {len(unexpected)} entries the model lacks: {_few(unexpected)}")

    finish: Callable[[], None] = lambda: None  # noqa: E731
    if optimizer is not None:
        finish = _optimizer_template(module, optimizer, params, entries, optim_meta, strict, template, problems)
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
    entries: Entries,
    optim_meta: dict[str, Any] | None,
    strict: bool,
    template: dict[str, torch.Tensor],
    problems: list[str],
) -> Callable[[], None]:
    current_groups = _group_names(module, optimizer)
    if optim_meta is None:
        problems.append("it was saved without optimizer state; pass optimizer=None to load the model only")
        return lambda: None
    inner = optimizer.optimizer if _is_zero(optimizer) else optimizer
    if strict and optim_meta.get("class") != type(inner).__name__:
        problems.append(f"its optimizer is {optim_meta.get('class')}, not {type(inner).__name__}")
    saved_groups = optim_meta["param_groups"]
    if len(saved_groups) != len(current_groups):
        problems.append(f"its optimizer has {len(saved_groups)} param groups, this one has {len(current_groups)}")
    elif strict:
        for gid, (saved, now) in enumerate(zip(saved_groups, current_groups)):
            if set(saved["params"]) != set(now):
                diff = sorted(set(saved["params"]) ^ set(now))
                problems.append(f"optimizer param group {gid} differs in parameters {_few(diff)}")

    state_keys: dict[str, list[str]] = {}
    for key, (shape, dtype) in entries.items():
        if not key.startswith(OPTIM_STATE):
            continue
        name, _, skey = key[len(OPTIM_STATE):].rpartition(".")
        if name not in params:
            if strict:
                problems.append(f"the checkpoint has optimizer state {skey!r} for {name!r}, which the model lacks")
            continue
        if tuple(shape) not in ((), tuple(params[name].shape)):
            if tuple(entries.get(MODEL + name, ((),))[0]) == tuple(params[name].shape):  # else reported above
                problems.append(f"optimizer state {skey!r} of {name!r} has shape {_shape(shape)}, the parameter {_shape(params[name].shape)}")
            continue
        state_keys.setdefault(name, []).append(skey)
        p = params[name]
        template[key] = torch.zeros((), dtype=getattr(torch, dtype)) if not shape else _alloc_like(p, getattr(torch, dtype))
    if state_keys and strict:
        missing = sorted(n for g in current_groups for n in g if n not in state_keys)
        if missing:
            problems.append(f"the checkpoint has no optimizer state for {_few(missing)}")
    # fp32 master weights (saved by ZeRO-1 from bf16/fp16 models) are loaded into a ZeRO-1 optimizer,
    # which takes them over the model's (rounded) weights; other optimizers keep none
    masters = [n for n in params if OPTIM_MASTER + n in entries] if _is_zero(optimizer) else []
    if len(masters) != len(params):
        masters = []
    for name in masters:
        template[OPTIM_MASTER + name] = _alloc_like(params[name], torch.float32)

    def finish() -> None:
        groups = [
            {**_merge_hyperparameters(now, saved), "params": saved["params"]}
            for now, saved in zip(optimizer.param_groups, saved_groups)
        ]
        osd: dict[str, Any] = {
            "state": {n: {k: template[f"{OPTIM_STATE}{n}.{k}"] for k in keys} for n, keys in state_keys.items()},
            "param_groups": groups,
        }
        if _is_zero(optimizer):
            optimizer.reload_model_params()  # the weights were loaded in place; refresh its copies
            if masters:
                osd["master_params"] = {n: template[OPTIM_MASTER + n] for n in masters}
            optimizer.load_sharded_state_dict(osd)
        else:
            _load_plain(optimizer, params, osd)

    return finish


def _load_plain(optimizer: torch.optim.Optimizer, params: dict[str, nn.Parameter], osd: dict[str, Any]) -> None:
    name_of = {id(p): n for n, p in params.items()}
    sd = optimizer.state_dict()
    state = {}
    index = 0
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = name_of.get(id(p))
            if name in osd["state"]:
                state[index] = dict(osd["state"][name])
            index += 1
    for current, saved in zip(sd["param_groups"], osd["param_groups"]):
        current.update({k: v for k, v in saved.items() if k != "params"})
    sd["state"] = state
    optimizer.load_state_dict(sd)
