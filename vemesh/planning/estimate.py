"""Before launch: what each rank of a job will hold, from the real model on the meta device.

This is the first part of ``vemesh plan --model`` (issue 21): the *static* memory per rank class,
parameters, gradients, optimizer state and fp32 master weights, for vemesh's DDP, its ZeRO-1
``DistributedOptimizer`` and torch's FSDP2, under TP, PP and EP. Activations and per-dim traffic
are not predicted yet.

How each figure is obtained:

* **The parameters** come from the real model, built on the meta device (no memory, so a 70B model
  costs nothing): ``gpt:...`` is the GPT preset (:mod:`vemesh.models.gpt`, what the GPT example trains);
  ``module:pkg.mod:factory`` is any ``nn.Module`` factory.
* **The TP shards** follow the GPT preset's tensor-parallel plan (``vemesh.models.gpt.parallelize``), read
  with torch's rules for its styles: ``ColwiseParallel`` shards a Linear's weight and bias on dim 0,
  ``RowwiseParallel`` a Linear's weight on dim 1 (its bias is replicated) and an Embedding's on dim 0;
  the rest is replicated. A dim that TP does not divide gives its first ranks one more row, as
  ``torch.chunk`` does; the figure is that largest rank's.
* **The PP stages** follow the example's ``split_layers`` and ``cut_stage``: consecutive blocks, the
  embeddings on the first stage, the last norm and the head on the last.
* **The bytes per element** are the wrappers' rules, which ``test/parallel/ddp_optim/test_estimate.py``
  checks against what the real wrappers allocate:

  ======== ============================== ============================ ============================== ===================
  mode     parameters                     gradients                    AdamW state                    fp32 masters
  ======== ============================== ============================ ============================== ===================
  ddp      N x dtype                      N x 4 (fp32 buffer), + N x 2  2 N x dtype                    none
                                          for bf16 (the ``.grad`` copy)
  zero1    N x dtype, x 2 under TP        as ddp                       2 x 4 x ceil(N_buffer / DP)     bf16: 4 x ceil(N_buffer / DP)
           (DTensors keep their storage)
  fsdp     4 x (N / DP, per parameter     4 x (N / DP), as parameters  2 x 4 x (N / DP)               none (fp32 already)
           padded on dim 0)
  ======== ============================== ============================ ============================== ===================
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import math
import os
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vemesh.layout.names import divisors, listed
from vemesh.models.gpt import model as model_module
from vemesh.models.gpt.parallelize import gpt_tp_plan
from vemesh.parallel.schedules import split_layers

__all__ = ["GPT_FIELDS", "Model", "ParamShard", "RankMemory", "build_model", "gpt_config", "load_model", "parse_size",
           "param_shards", "rank_shards", "rank_static", "stage_keys", "static_memory"]

#: The fields of ``--model gpt:...`` and the example's GPTConfig field each sets.
GPT_FIELDS = {"n_layer": "n_layer", "n_embd": "n_embd", "n_head": "n_head", "vocab": "vocab_size",
              "seq_len": "block_size", "moe_experts": "moe_experts", "moe_top_k": "moe_top_k", "moe_every": "moe_every"}
_GPT_REQUIRED = ("n_layer", "n_embd", "n_head")
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str, what: str = "a memory size") -> int:
    """``"80GiB"`` -> 85899345920 bytes; ``"80GB"`` -> 80e9. A size without a unit, of an unknown unit, or of less
    than a byte (zero, negative) raises ``ValueError``."""
    units = ", ".join(u.replace("I", "i") for u in _UNITS)
    match = re.fullmatch(r"\s*([-+]?[0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", str(text))
    if not match:
        raise ValueError(f"{what} {text!r} is not a size: a number then one of {units} (e.g. 80GiB)")
    if not match.group(2):
        raise ValueError(f"{what} {text!r} needs a unit: a number then one of {units} (e.g. 80GiB)")
    unit = match.group(2).upper()
    if unit not in _UNITS:
        raise ValueError(f"{what} {text!r}: unknown unit {match.group(2)!r}; valid: {units}")
    size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ValueError(f"{what} {text!r}: a size must be at least 1 byte (e.g. 80GiB)")
    return size


@functools.lru_cache(maxsize=32)
def _load_file(file: Path, mtime_ns: int, size: int) -> Any:
    """The module of a file path, run once while the file is unchanged (as ``import`` runs a module once): the
    factory, parallelize function and step named from one file share its classes, and a search's meshes reuse them."""
    spec = importlib.util.spec_from_file_location(file.stem, file)
    assert spec is not None and spec.loader is not None
    loaded = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(file.stem, loaded)
    spec.loader.exec_module(loaded)
    return loaded


def load_object(module: str, name: str, flag: str) -> Any:
    """``name`` from ``module``: a dotted module importable from the current directory (which goes first on
    ``sys.path``, as ``python -m`` puts it) or a file path (``./mymodel.py``, ``models/llama.py``; its directory goes
    first on ``sys.path``, as ``python models/llama.py`` puts it, so that it imports the files beside it).

    Raises:
        ValueError: one line naming the module, the directory searched, and the fix.
    """
    here = os.getcwd()
    try:
        if module.endswith(".py") or os.sep in module or "/" in module:
            file = Path(module).expanduser().resolve()
            if not file.is_file():
                raise ValueError(f"{flag}: no file {file} (the path is taken from the current directory {here})")
            if str(file.parent) not in sys.path:  # its own imports of files beside it, as ``python FILE`` finds them
                sys.path.insert(0, str(file.parent))
            stat = file.stat()
            loaded = _load_file(file, stat.st_mtime_ns, stat.st_size)
        else:
            if here not in sys.path and "" not in sys.path:
                sys.path.insert(0, here)
            try:
                loaded = importlib.import_module(module)
            except ModuleNotFoundError as e:
                if e.name is None or not module.startswith(e.name):
                    raise  # the module was found, but something it imports was not
                raise ValueError(
                    f"{flag}: no module named {e.name!r} in the current directory {here} or on sys.path; run vemesh "
                    f"from the folder that holds {module.split('.')[0]}.py, or give its file path (./{module.replace('.', '/')}.py) "
                    "in place of the module"
                ) from None
    except ValueError:
        raise
    except Exception as e:
        raise ValueError(f"{flag}: importing {module} failed: {type(e).__name__}: {e}") from e
    if not hasattr(loaded, name):
        public = sorted(n for n in vars(loaded) if not n.startswith("_") and callable(getattr(loaded, n)))
        raise ValueError(f"{flag}: {module} has no {name!r}; its callables are {public}")
    return getattr(loaded, name)


def _gpt_config(body: str) -> dict[str, int]:
    fields: dict[str, int] = {}
    for item in filter(None, body.split(",")):
        key, eq, value = item.partition("=")
        key = key.strip()
        if key not in GPT_FIELDS:
            raise ValueError(f"--model gpt:{body}: unknown field {key!r}; valid fields: {', '.join(GPT_FIELDS)}")
        if not eq or not value.strip().isdigit() or int(value) < (0 if key == "moe_experts" else 1):
            raise ValueError(f"--model gpt:{body}: {key} needs a positive integer, as {key}=8; got {item!r}")
        fields[key] = int(value)
    missing = [k for k in _GPT_REQUIRED if k not in fields]
    if missing:
        raise ValueError(f"--model gpt:{body}: missing {', '.join(missing)} (vocab defaults to 256, seq_len to 1024)")
    return fields


@functools.lru_cache(maxsize=32)
def gpt_config(spec: str) -> Any:
    """The example's ``GPTConfig`` of ``--model gpt:...`` (vocab 256 and seq_len 1024 unless given, no dropout)."""
    body = str(spec).partition(":")[2]
    config = {"vocab_size": 256, "block_size": 1024, "dropout": 0.0}
    config.update({GPT_FIELDS[k]: v for k, v in _gpt_config(body).items()})
    try:
        return model_module.GPTConfig(**config)
    except Exception as e:
        raise ValueError(f"--model {spec}: the GPT example refuses this configuration: "
                         f"{e or type(e).__name__}") from e


def build_model(spec: str) -> tuple[nn.Module, str]:
    """The model ``spec`` names, on the meta device, and its kind (``"gpt"`` or ``"module"``).

    ``gpt:n_layer=48,n_embd=6144,n_head=48,vocab=50304,seq_len=4096`` (MoE fields too) builds the example's
    GPT; ``module:package.module:factory`` calls ``factory()``. Errors name the bad value in one line.
    """
    kind, _, body = str(spec).partition(":")
    if kind == "gpt":
        cfg = gpt_config(spec)
        try:
            with torch.device("meta"):
                return model_module.GPT(cfg), "gpt"
        except Exception as e:
            raise ValueError(f"--model {spec}: the GPT example refuses this configuration: "
                             f"{e or type(e).__name__}") from e
    if kind == "module":
        path, colon, attr = body.rpartition(":")
        if not colon or not path or not attr:
            raise ValueError(f"--model {spec!r}: expected module:package.module:factory")
        factory: Callable[[], Any] = load_object(path, attr, f"--model {spec}")
        try:
            with torch.device("meta"):
                model = factory()
        except Exception as e:
            raise ValueError(f"--model {spec}: {path}:{attr}() failed: {type(e).__name__}: {e}") from e
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {spec}: {attr}() returned a {type(model).__name__}, not an nn.Module")
        return model, "module"
    raise ValueError(f"--model {spec!r}: expected gpt:FIELD=N,... or module:package.module:factory")


@dataclass(frozen=True)
class ParamShard:
    """One parameter as the planner sees it."""

    name: str
    shape: tuple[int, ...]
    tp_dim: int | None  #: the dim TP shards (None: replicated over TP)
    stage_key: str  #: "first", "last", "block:<i>"
    expert: int | None  #: the expert number of an MoE expert's parameter


def _tp_rules(model: nn.Module, kind: str) -> dict[str, int | None]:
    """Parameter name -> the dim TP shards, from the example's plan read with torch's rules."""
    if kind != "gpt":
        return {}

    plan = gpt_tp_plan(model.h.keys())  # the experts stay whole under TP (EP spreads them)
    modules = dict(model.named_modules())
    out: dict[str, int | None] = {}
    for mod_name, style in plan.items():
        module = modules.get(mod_name)
        if module is None:
            continue
        style_name = type(style).__name__
        for p_name, _ in module.named_parameters(recurse=False):
            dim = None
            if style_name == "ColwiseParallel":
                dim = 0 if isinstance(module, nn.Linear) else 1
            elif style_name == "RowwiseParallel":
                dim = (1 if p_name == "weight" else None) if isinstance(module, nn.Linear) else 0
            out[f"{mod_name}.{p_name}"] = dim
    return out


def param_shards(model: nn.Module, kind: str) -> list[ParamShard]:
    """Every trainable parameter with its TP dim, its place in the pipeline and its expert number."""
    rules = _tp_rules(model, kind)
    out = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        m = re.match(r"h\.(\d+)\.", name)
        stage = f"block:{m.group(1)}" if m and kind == "gpt" else ("first" if name.startswith(("wte", "wpe")) else "last")
        if re.search(r"\.experts\.(w1|w2|b1|b2)$", name):  # grouped experts: one row per expert, stacked on dim 0
            out += [ParamShard(f"{name}[{e}]", tuple(p.shape[1:]), None, stage, e) for e in range(p.shape[0])]
        else:
            out.append(ParamShard(name, tuple(p.shape), rules.get(name), stage, None))
    return out


def local_numel(shape: tuple[int, ...], dim: int | None, n: int) -> int:
    if dim is None or n == 1:
        return math.prod(shape)
    return math.prod(shape) // shape[dim] * -(-shape[dim] // n)


def fsdp_local(params: list[ParamShard], over: int, tp: int) -> int:
    """Elements of FSDP2's local shards over ``over`` ranks: the TP shard, dim 0 padded to a multiple of ``over``."""
    total = 0
    for p in params:
        shape = list(p.shape)
        if p.tp_dim is not None and tp > 1:
            shape[p.tp_dim] = -(-shape[p.tp_dim] // tp)
        total += -(-shape[0] // over) * math.prod(shape[1:])
    return total


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank of a class holds before its first forward (activations not included)."""

    rank_class: str
    params: int
    grads: int
    optimizer: int
    masters: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + self.masters


@dataclass(frozen=True)
class Model:
    """What the planner keeps of a model: its parameters as :class:`ParamShard` rows and its shape."""

    spec: str
    kind: str
    shards: tuple[ParamShard, ...]
    n_layer: int
    config: tuple[tuple[str, int], ...]  #: the GPTConfig fields (empty for a module factory)

    @property
    def experts(self) -> int:
        return max((s.expert for s in self.shards if s.expert is not None), default=-1) + 1


@functools.lru_cache(maxsize=8)
def load_model(spec: str) -> Model:
    """:func:`build_model` once per spec, kept as :class:`Model` (a 70B GPT takes a few seconds on meta)."""
    model, kind = build_model(spec)
    config: tuple[tuple[str, int], ...] = ()
    if kind == "gpt":
        c = model.config
        config = tuple(sorted((k, getattr(c, k)) for k in ("vocab_size", "block_size", "n_head", "n_embd", "bias",
                                                             "moe_experts", "moe_top_k", "moe_every")))
    return Model(spec, kind, tuple(param_shards(model, kind)), len(getattr(model, "h", [])), config)


def stage_keys(model: Model, n_stages: int) -> list[set[str]]:
    """The :attr:`ParamShard.stage_key` values of each of ``n_stages`` pipeline stages (the example's cut)."""
    if n_stages == 1:
        return [{"first", "last", *[f"block:{i}" for i in range(model.n_layer)]}]
    if model.kind != "gpt":
        raise ValueError("PP > 1 needs the GPT example's stage cut (--model gpt:...); a module factory has no stages")

    layers = split_layers(model.n_layer, n_stages)
    keys = [{f"block:{i}" for i in blocks} for blocks in layers]
    keys[0].add("first")
    keys[-1].add("last")
    return keys


def rank_shards(model: Model, keys: set[str], ep: int) -> list[ParamShard]:
    """The parameters a rank holding the stages' ``keys`` has: theirs, and of the experts, its EP rank's share (the
    first ``experts / ep``, as every EP rank holds as many)."""
    return [p for p in model.shards if p.stage_key in keys and (p.expert is None or p.expert < model.experts // ep)]


def rank_static(model: Model, keys: set[str], name: str, *, dp: int, tp: int, ep: int, dtype: str,
                dp_mode: str) -> RankMemory:
    """The static bytes of a rank holding the parameters of ``keys`` (see the module docstring's table)."""
    width = 2 if dtype == "bf16" else 4
    mine = rank_shards(model, keys, ep)
    dense = [p for p in mine if p.expert is None]
    expert = [p for p in mine if p.expert is not None]
    n = sum(local_numel(p.shape, p.tp_dim, tp) for p in mine)
    if dp_mode == "fsdp":
        local = fsdp_local(dense, dp, tp) + fsdp_local(expert, dp // ep, tp)
        return RankMemory(name, 4 * local, 4 * local, 8 * local, 0)
    dt = n if tp > 1 and model.kind == "gpt" else 0  # under TP every GPT parameter is a DTensor, copied by ZeRO-1
    grads = 4 * n + (2 * n if width == 2 else 0)
    if dp_mode == "ddp":
        return RankMemory(name, width * n, grads, 2 * width * n, 0)
    owned = -(-sum(local_numel(p.shape, p.tp_dim, tp) for p in dense) // dp)
    owned += -(-sum(local_numel(p.shape, p.tp_dim, tp) for p in expert) // (dp // ep)) if expert else 0
    return RankMemory(name, width * (n + dt), grads, 8 * owned, 4 * owned if width == 2 else 0)


def check_degrees(model: Model, *, dp: int, tp: int, pp: int, ep: int, dtype: str, dp_mode: str) -> None:
    """One-line ``ValueError`` for a dtype, a mode or degrees that the planner cannot take for ``model``."""
    if dtype not in ("fp32", "bf16"):
        raise ValueError(f"dtype must be fp32 or bf16; got {dtype!r}")
    if dp_mode not in ("ddp", "zero1", "fsdp"):
        raise ValueError(f"dp_mode must be ddp, zero1 or fsdp; got {dp_mode!r}")
    for what, value in (("dp", dp), ("tp", tp), ("pp", pp), ("ep", ep)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what} must be a positive integer; got {value!r}")
    if model.kind != "gpt" and tp > 1:
        raise ValueError("TP > 1 needs a tensor-parallel plan; the planner knows the GPT example's (--model gpt:...)")
    if dp % ep:
        raise ValueError(f"EP {ep} must divide the DP degree {dp} (EP folds over the data-parallel ranks); choose EP "
                         f"from {listed(divisors(dp), 64)}")
    if model.experts and model.experts % ep:
        fits = [e for e in divisors(dp) if model.experts % e == 0]
        raise ValueError(f"EP {ep} does not divide the {model.experts} experts: each EP rank holds experts / EP of "
                         f"them; choose EP from {', '.join(map(str, fits))} (dividing both the experts and DP {dp})")


def static_memory(spec: str, *, dp: int = 1, tp: int = 1, pp: int = 1, ep: int = 1, dtype: str = "fp32",
                  dp_mode: str = "zero1") -> list[RankMemory]:
    """Parameters, gradients, AdamW state and fp32 masters per rank, one row per PP stage.

    Args:
        spec: ``--model``'s value (see :func:`build_model`).
        dp: the data-parallel degree the optimizer shards over (DP x CP with context parallelism).
        tp, pp, ep: the tensor, pipeline and expert degrees (EP folds over the DP ranks).
        dtype: ``fp32`` or ``bf16`` (the parameters' dtype; FSDP2 keeps fp32 shards and computes in it).
        dp_mode: ``ddp`` (vemesh DDP + torch AdamW), ``zero1`` (+ ``DistributedOptimizer``) or ``fsdp`` (FSDP2).
    """
    model = load_model(spec)
    check_degrees(model, dp=dp, tp=tp, pp=pp, ep=ep, dtype=dtype, dp_mode=dp_mode)
    return [rank_static(model, keys, f"PP stage {s}" if pp > 1 else "every rank", dp=dp, tp=tp, ep=ep, dtype=dtype,
                        dp_mode=dp_mode)
            for s, keys in enumerate(stage_keys(model, pp))]
