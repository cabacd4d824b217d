"""A module's own per-head parameters sharded over TP: each rank's forward reads its own heads' slice.

torch's ``ColwiseParallel`` splits a projection's heads over TP; a parameter with a value per head that is no
Linear's weight stays whole. HF's GPT-OSS keeps ``sinks``, one logit per head (``nn.Parameter(num_attention_heads)``),
and concatenates them to this rank's attention scores: under TP the shapes disagree and the forward raises
(``Expected size 2 but got size 4``). Mamba2's ``A_log``, ``D`` and ``dt_bias`` are the same kind.

:class:`HeadwiseParallel` is a torch ``ParallelStyle`` for them: on the module that holds them, each named parameter
becomes a DTensor sharded over the plan's (TP) mesh along ``dim``, so that its checkpoint and ``full_tensor()`` are the
whole model's, and the optimizer steps this rank's heads. During the module's forward the attribute reads as this
rank's slice, a plain tensor (``to_local()``, whose gradient flows back into the DTensor), as FSDP2 swaps in its
unsharded parameters; after the forward (also one that raises) the DTensor is put back. Heads are split as
``ColwiseParallel`` splits a projection's rows: rank ``r`` holds block ``r`` of ``TP`` contiguous blocks.

Some attentions are handed a tensor with a value per head rather than holding one. HF's Bloom builds its ALiBi bias
once in the model, of every head (``(batch * n_head, 1, seq)``), and hands it to each attention, which adds it to the
scores of its own heads: under TP, with ``num_heads`` set to this rank's, the sizes disagree and ``baddbmm`` raises.
``HeadwiseParallel(inputs={"alibi": 0}, heads=n_head)`` slices each named input to this rank's heads before the
forward: along ``dim`` its size is a multiple ``k * heads`` (``k`` groups of every head, heads inner, as
``reshape(batch * heads, ...)`` folds them), and rank ``r`` keeps block ``r`` of each group's heads. A wrong
``heads`` would slice every input to a size the forward takes, and train silently wrong: at its first forward the
module's own head counts (:func:`own_head_counts`: ``num_heads``, ``n_heads``, ...), this rank's or the whole model's,
must include ``heads`` or ``heads / TP``, or the forward raises naming them.

Some attentions hold a module per head. HF's StableLM with ``qk_layernorm`` keeps a ``ModuleList`` of one LayerNorm per
head and zips it with the heads it is handed: under TP, this rank's heads meet the first heads' norms, and nothing
raises. ``HeadwiseParallel(modules=("norms",))`` makes each of those modules' parameters a DTensor replicated over TP,
so that every rank holds the whole model's and its checkpoint is one; during the forward the list reads as this rank's
block of modules, their parameters this rank's rows of the stacked weights (gathered over TP in the backward, so that
every rank's copy gets each head's gradient from the rank that ran it).
"""

from __future__ import annotations

import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from vemesh.layout.names import divisors
from vemesh.parallel.tp_split import one_tp_dim

__all__ = ["HeadwiseParallel", "counts_heads", "own_head_counts"]

#: an attribute named with one of these counts something else than heads (``head_dim``, ``num_key_value_groups``)
_NOT_COUNTS = ("dim", "size", "group", "scal", "mask", "bias")


def counts_heads(attr: str) -> bool:
    """An attribute so named counts heads: ``head`` in it (``num_heads``, ``n_head``, ``num_kv_heads``), not a size,
    a dim or a group count."""
    return "head" in attr.lower() and not any(w in attr.lower() for w in _NOT_COUNTS)


def own_head_counts(module: nn.Module) -> dict[str, int]:
    """The module's own integer attributes that count heads (:func:`counts_heads`), of 2 or more."""
    return {k: v for k, v in vars(module).items() if counts_heads(k) and type(v) is int and v > 1}


class HeadwiseParallel(ParallelStyle):
    """The module's own parameters ``params`` (their names on it) sharded over the TP mesh along ``dim``, each rank's
    forward reading its own slice as a plain tensor; and the tensors its forward is handed as ``inputs`` (argument
    name: its heads dim, of ``heads`` heads), each sliced to this rank's heads; and its ModuleLists of a module per
    head, ``modules``, each rank running its own heads' modules. For per-head parameters beside ColwiseParallel
    projections, as GPT-OSS's attention sinks, Bloom's ALiBi bias, and StableLM's LayerNorm per head::

        parallelize_module(layer, mesh["TP"], {
            "self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "self_attn": HeadwiseParallel(("sinks",)),  # one logit per head: this rank's heads'
        })
        parallelize_module(layer, mesh["TP"], {  # Bloom: (batch * n_head, 1, seq), this rank's heads of each
            "self_attention": HeadwiseParallel(inputs={"alibi": 0}, heads=config.n_head)})
        parallelize_module(layer, mesh["TP"], {  # StableLM's qk_layernorm: a LayerNorm per head in a ModuleList
            "self_attn.q_layernorm": HeadwiseParallel(modules=("norms",)),
            "self_attn.k_layernorm": HeadwiseParallel(modules=("norms",))})
    """

    def __init__(self, params: Sequence[str] = (), dim: int = 0, *, inputs: Mapping[str, int] | None = None,
                 heads: int | None = None, modules: Sequence[str] = ()) -> None:
        super().__init__()
        if isinstance(modules, str) or not all(isinstance(m, str) and m for m in modules):
            raise ValueError(f"HeadwiseParallel(modules={modules!r}): modules must be a sequence of the names of the "
                             "module's ModuleLists that hold a module per head, e.g. ('norms',)")
        if isinstance(params, str) or not all(isinstance(p, str) and p for p in params) or \
                not (params or inputs or modules):
            raise ValueError(f"HeadwiseParallel(params={params!r}): params must be a non-empty sequence of the "
                             "module's parameter names, e.g. ('sinks',), or give the per-head inputs of its forward "
                             "(inputs={'alibi': 0}, heads=N), or its ModuleLists of a module per head "
                             "(modules=('norms',))")
        if type(dim) is not int:
            raise ValueError(f"HeadwiseParallel(dim={dim!r}): dim must be an int, the parameters' heads dim")
        given = dict(inputs) if isinstance(inputs, Mapping) else {}
        if inputs is not None and not (given and all(isinstance(k, str) and k and type(v) is int
                                                     for k, v in given.items())):
            raise ValueError(f"HeadwiseParallel(inputs={inputs!r}): inputs must map each argument name of the "
                             "module's forward to its heads dim, e.g. {'alibi': 0}")
        if (heads is not None or given) and not (type(heads) is int and heads > 1 and given):
            raise ValueError(f"HeadwiseParallel(inputs={inputs!r}, heads={heads!r}): heads is the whole model's count "
                             "of heads in the inputs, an int of 2 or more, given with inputs")
        self.params, self.dim, self.inputs, self.heads = tuple(params), dim, given, heads
        self.modules = tuple(modules)

    def __repr__(self) -> str:
        said = [f"{self.params!r}, dim={self.dim}"] if self.params else []
        said += [f"inputs={self.inputs!r}, heads={self.heads}"] if self.inputs else []
        said += [f"modules={self.modules!r}"] if self.modules else []
        return f"HeadwiseParallel({', '.join(said)})"

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        one_tp_dim(repr(self), device_mesh)
        own = dict(module.named_parameters(recurse=False))
        for name in self.params:
            if name not in own:
                raise ValueError(f"{self!r} on {type(module).__name__}: it has no parameter {name!r} of its own; its "
                                 f"parameters: {sorted(own) or 'none'}")
            p, tp, where = own[name], device_mesh.size(), f"{self!r} on {type(module).__name__}.{name}"
            if isinstance(p, DTensor):
                raise ValueError(f"{where}: it is a DTensor already ({p.placements}); give it one style")
            if not -p.dim() <= self.dim < p.dim():
                raise ValueError(f"{where} of shape {tuple(p.shape)}: dim {self.dim} is not one of its dims")
            if p.shape[self.dim] % tp:
                heads = p.shape[self.dim]
                raise ValueError(f"{where} of shape {tuple(p.shape)}: TP {tp} does not divide its {heads} heads on dim "
                                 f"{self.dim}; choose TP from {', '.join(str(d) for d in divisors(heads))}")
            # from src_data_rank's values (rank 0's, as torch's styles; None: each rank's own), as ColwiseParallel does
            whole = distribute_tensor(p.detach(), device_mesh, [Shard(self.dim)], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(whole, requires_grad=p.requires_grad))
        if self.params:
            module.register_forward_pre_hook(self._local)
            module.register_forward_hook(self._restore, always_call=True)
        if self.inputs:
            self._slice_inputs(module, device_mesh)
        if self.modules:
            self._per_head_modules(module, device_mesh)
        return module

    def _per_head_modules(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """Each ModuleList of :attr:`modules` on ``module``: its modules' parameters replicated over TP, and during the
        forward the list this rank's block, its parameters this rank's rows of the stacked weights."""
        tp, rank, where = device_mesh.size(), device_mesh.get_local_rank(), f"{self!r} on {type(module).__name__}"
        names: dict[str, list[str]] = {}
        for name in self.modules:
            held = module._modules.get(name)
            if not isinstance(held, nn.ModuleList):
                lists = sorted(n for n, c in module.named_children() if isinstance(c, nn.ModuleList))
                raise ValueError(f"{where}: it has no ModuleList {name!r} of its own; its ModuleLists: "
                                 f"{', '.join(lists) or 'none'}")
            kinds = {tuple((n, tuple(p.shape), p.dtype) for n, p in c.named_parameters()) for c in held}
            own = [n for n, _ in held[0].named_parameters(recurse=False)] if len(held) else []
            if len(held) < 2 or len(kinds) != 1 or not own or len(own) != len(next(iter(kinds))):
                raise ValueError(f"{where}.{name}: its {len(held)} modules must be 2 or more alike, one a head, each "
                                 "holding parameters of its own (a norm per head)")
            if len(held) % tp:
                raise ValueError(f"{where}.{name}: TP {tp} does not divide its {len(held)} heads; choose TP from "
                                 f"{', '.join(str(d) for d in divisors(len(held)))}")
            for child in held:
                for n in own:
                    p = child._parameters[n]
                    if isinstance(p, DTensor):
                        raise ValueError(f"{where}.{name}: {n} is a DTensor already ({p.placements}); give it one "
                                         "style")
                    whole = distribute_tensor(p.detach(), device_mesh, [Replicate()], src_data_rank=self.src_data_rank)
                    child.register_parameter(n, nn.Parameter(whole, requires_grad=p.requires_grad))
            names[name] = own

        def local(_: nn.Module, args: Any) -> None:
            kept = []
            for name, own in names.items():
                whole = module._modules[name]
                k = len(whole) // tp
                block = list(whole)[rank * k:(rank + 1) * k]
                for n in own:  # this rank's rows of the stacked weights; the backward gathers their gradient
                    rows = torch.stack([c._parameters[n] for c in whole]).redistribute(
                        device_mesh, [Shard(0)]).to_local()
                    kept += [(c, n, c._parameters[n]) for c in block]
                    for j, c in enumerate(block):
                        c._parameters[n] = rows[j]
                kept.append((module, name, whole))
                module._modules[name] = nn.ModuleList(block)
            module.__dict__.setdefault("_vemesh_headwise_modules", []).append(kept)

        def restore(_: nn.Module, args: Any, out: Any) -> Any:
            stack = module.__dict__.get("_vemesh_headwise_modules")
            for owner, n, value in (stack.pop() if stack else ()):
                (owner._modules if owner is module else owner._parameters)[n] = value
            return out

        module.register_forward_pre_hook(local)
        module.register_forward_hook(restore, always_call=True)

    def _slice_inputs(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        """A pre-hook on ``module`` that hands its forward this rank's heads of each of :attr:`inputs`."""
        tp, rank, heads, where = device_mesh.size(), device_mesh.get_local_rank(), self.heads, \
            f"{self!r} on {type(module).__name__}"
        assert heads is not None
        if heads % tp:
            raise ValueError(f"{where}: TP {tp} does not divide its {heads} heads; choose TP from "
                             f"{', '.join(str(d) for d in divisors(heads))}")
        try:  # the forward's arguments (a bound method's, without self)
            known = dict(inspect.signature(module.forward).parameters)
        except (TypeError, ValueError):  # not to be inspected: keyword arguments alone are found
            known = {}
        names = [n for n, a in known.items() if a.kind in (a.POSITIONAL_ONLY, a.POSITIONAL_OR_KEYWORD)]
        missing = [n for n in self.inputs if known and n not in known]
        if missing and not any(a.kind == a.VAR_KEYWORD for a in known.values()):
            raise ValueError(f"{where}: its forward takes no argument {missing[0]!r}; its arguments: "
                             f"{', '.join(known)}")

        places = {n: i for i, n in enumerate(names)}  # each argument's place, found once, not at every forward
        checked: list[bool] = []

        def local(_: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if not checked:  # at the first forward: the counts the user set after parallelize_module are set by then
                _check_heads(module, heads, tp, where)
                checked.append(True)
            args, kwargs = list(args), dict(kwargs)
            for name, dim in self.inputs.items():
                at = places[name] if places.get(name, len(args)) < len(args) else None
                t = args[at] if at is not None else kwargs.get(name)
                if t is None:  # not given (an optional input): no heads to slice
                    continue
                t = _this_ranks(t, dim, heads, rank, tp, f"{where}: input {name!r}")
                if at is not None:
                    args[at] = t
                else:
                    kwargs[name] = t
            return tuple(args), kwargs

        module.register_forward_pre_hook(local, with_kwargs=True)

    def _local(self, module: nn.Module, args: Any) -> None:
        held = {}
        for name in self.params:
            held[name] = module._parameters[name]
            module._parameters[name] = held[name].to_local()  # type: ignore[union-attr]
        module.__dict__.setdefault("_vemesh_headwise", []).append(held)

    def _restore(self, module: nn.Module, args: Any, out: Any) -> Any:
        stack = module.__dict__.get("_vemesh_headwise")
        if stack:
            module._parameters.update(stack.pop())
        return out


def _check_heads(module: nn.Module, heads: int, tp: int, where: str) -> None:
    """``heads`` is one of the module's own head counts, or TP times one (a count set to this rank's); a module that
    counts no heads is taken at its word."""
    counts = own_head_counts(module)
    if counts and not any(heads in (v, v * tp) for v in counts.values()):
        said = ", ".join(f"{k}={v}" for k, v in counts.items())
        choices = ", ".join(str(n) for n in sorted({n for v in counts.values() for n in (v, v * tp)}))
        raise ValueError(f"{where}: heads={heads} is none of the module's own head counts ({said}), nor TP {tp} times "
                         f"one; give heads= the whole model's count of heads in the inputs: one of {choices}")


def _this_ranks(t: Any, dim: int, heads: int, rank: int, tp: int, where: str) -> torch.Tensor:
    """Of ``t``, whose ``dim`` holds ``k * heads`` values (``k`` groups of every head, heads inner), rank ``rank``'s
    block of each group's heads: ``k * heads / tp`` values."""
    if isinstance(t, DTensor) or not isinstance(t, torch.Tensor):
        kind = f"a DTensor ({t.placements}), whose placements say which heads each rank holds" \
            if isinstance(t, DTensor) else type(t).__name__
        raise ValueError(f"{where} is {kind}: HeadwiseParallel slices a plain tensor of every head")
    if not -t.dim() <= dim < t.dim():
        raise ValueError(f"{where} of shape {tuple(t.shape)}: dim {dim} is not one of its dims")
    dim %= t.dim()
    n, local = t.shape[dim], heads // tp
    if n % heads:
        raise ValueError(f"{where} of shape {tuple(t.shape)}: its dim {dim} holds {n}, not a multiple of its {heads} "
                         "heads (one value per head, or groups of every head folded in, as batch * heads)")
    grouped = t.reshape(*t.shape[:dim], n // heads, heads, *t.shape[dim + 1:])
    return grouped.narrow(dim + 1, rank * local, local).reshape(*t.shape[:dim], n // heads * local, *t.shape[dim + 1:])
