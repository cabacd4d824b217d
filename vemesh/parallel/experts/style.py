"""``ExpertParallel``: a torch ``ParallelStyle`` that spreads an experts module over the EP group.

The experts module's parameters are stacked over the ``E`` experts on dim 0, and its ``forward`` follows one of two
contracts, told apart by its signature:

* **grouped** (torchtitan's, and vemesh's test MoE): ``forward(x, num_tokens_per_expert)`` takes ``x [T, D]``
  grouped by expert, in expert order, with the count per expert ``[E]``, and returns ``[T, D]`` in the same order
  (``w1 [E, H, D]``, ``w2 [E, D, H]``, ``w3 [E, H, D]``, biases ``[E, ...]`` too);
* **routed** (Hugging Face transformers 5's experts: ``MixtralExperts``, ``Qwen3MoeExperts`` and the other classes
  its ``use_experts_implementation`` decorates; GPT-OSS's ``GptOssExperts``, whose arguments are named
  ``router_indices`` and ``routing_weights``): ``forward(hidden_states, top_k_index, top_k_weights)`` takes the
  tokens ``[N, D]`` in their own order with each token's ``k`` experts and router weights ``[N, k]``, returns the
  weighted sum ``[N, D]``, and the module's ``num_experts`` is ``E`` (``gate_up_proj [E, 2I, D]``,
  ``down_proj [E, D, I]``). Each (token, choice) slot travels to its expert's rank, the module's own forward runs
  there on its ``E/EP`` experts (each slot with weight 1), and the router weights are applied where the token lives.

``parallelize_module(moe.experts, VESCALE_DEVICE_MESH["EP"], ExpertParallel())``:

* every parameter becomes a DTensor ``Shard(0)`` on the EP mesh: EP rank ``r`` keeps experts ``r * E/EP`` to
  ``(r + 1) * E/EP - 1`` (so checkpoints and ``clip_grad_norm_`` see the whole expert tensors);
* ``forward`` is wrapped with the token exchange (:mod:`~vemesh.parallel.experts.exchange`): the module's own
  forward runs on this rank's experts, with their local weights, on the tokens all EP ranks routed to them.

What the MoE block around it must do (as ``test/models/llama.py``'s ``MoE`` does): route each token to its top-k
experts, sort the (token, choice) slots by expert (a stable sort keeps tokens in order), count them per expert,
call the experts on the sorted slots, unsort, and combine the k outputs of each token with the router's weights.
Every EP rank must build the same full experts (same seed) before sharding, as for TP.

Gradients: the experts of one EP rank differ from its EP peers', so they are averaged over EDP (the data ranks
holding the same experts), and scaled by the data-parallel size: each expert saw the tokens of all its EP
peers, so this is the gradient of the mean loss over the global batch. vemesh's DDP (and ZeRO-1) finds these
parameters and the mesh's ``EDP`` by itself; :func:`vemesh.parallel.fully_shard` does the same for FSDP2.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle

from vemesh.mesh.views import check_view
from vemesh.parallel.experts.exchange import combine, dispatch

__all__ = ["EXPERT", "ExpertParallel", "ExpertTensorParallel", "TITAN_TP_DIMS", "is_expert", "expert_modules"]

#: torchtitan's grouped experts, split over TP as Megatron splits an MLP: ``w1``/``w3`` ``[E, H, D]`` by their hidden
#: rows (dim 1, column-parallel), ``w2 [E, D, H]`` by its hidden columns (dim 2, row-parallel); ``b1``/``b3``
#: ``[E, H]`` with their rows. torchtitan 0.3.0 names them by their dims: ``w1_EFD``/``w3_EFD`` ``[E, F, D]`` and
#: ``w2_EDF [E, D, F]``. Any other parameter (``b2 [E, D]``) is added to the output, whole on every TP rank.
TITAN_TP_DIMS: dict[str, int] = {"w1": 1, "w3": 1, "w2": 2, "b1": 1, "b3": 1, "w1_EFD": 1, "w3_EFD": 1, "w2_EDF": 2}

#: The attribute ExpertParallel sets on each parameter it shards, and on the module it wraps.
EXPERT = "_vemesh_expert_parallel"


def is_expert(p: torch.Tensor) -> bool:
    """Whether ``p`` is a parameter :class:`ExpertParallel` sharded over EP."""
    return bool(getattr(p, EXPERT, False))


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The modules of ``model`` that :class:`ExpertParallel` wraps."""
    return [m for m in model.modules() if getattr(m, EXPERT, False)]


@contextlib.contextmanager
def _local_weights(module: nn.Module, change: Any = None) -> Iterator[None]:
    """The module's DTensor parameters as their local shards for one forward (differentiable: ``to_local``), each
    passed through ``change(name, tensor)`` when given."""
    held = dict(module._parameters)
    try:
        for name, p in held.items():
            if isinstance(p, DTensor):
                local = p.to_local()
                module._parameters[name] = change(name, local) if change is not None else local  # type: ignore[assignment]
        yield
    finally:
        module._parameters.update(held)


class ExpertParallel(ParallelStyle):
    """Shard a grouped-experts module's experts over the 1-D EP mesh and exchange tokens with the EP peers."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 1:
            raise ValueError(f"ExpertParallel needs the 1-D EP mesh, VESCALE_DEVICE_MESH['EP']; got {device_mesh!r:.100}")
        check_view(device_mesh, "the EP mesh")
        params = _check_grouped(module, device_mesh.size(), "ExpertParallel")
        routed = _contract(module, "ExpertParallel") == "routed"
        for name, p in params:
            shard = nn.Parameter(distribute_tensor(p.detach(), device_mesh, [Shard(0)]), requires_grad=p.requires_grad)
            setattr(shard, EXPERT, True)
            module.register_parameter(name, shard)
        setattr(module, EXPERT, True)
        forward = _routed_forward if routed else _forward
        module.forward = functools.partial(forward, module, module.forward, device_mesh.get_group())  # type: ignore[method-assign]
        return module


class ExpertTensorParallel(ParallelStyle):
    """Experts over EP, and each expert split over TP inside its EP rank (Megatron's expert-TP, torchtitan's
    ``ExpertTensorParallel``), on the 2-D mesh ``VESCALE_DEVICE_MESH["EP", "TP"]``.

    Args:
        tp_dims: for each parameter name, the dim split over TP (default :data:`TITAN_TP_DIMS`). Parameters not
            named are added to the experts' output (an output bias): each TP rank adds ``1/TP`` of it, so the sum
            over TP adds it once, and its gradient is the whole one on every TP rank.

    The tokens are the same on the TP ranks of an EP rank (the router sees the whole hidden state, as in TP
    without sequence parallelism): they travel over the EP group of their TP coordinate, each TP rank runs its
    slice of every local expert, and the partial outputs are summed over TP before they go back (the input's
    gradient is summed over TP in backward). Gradients of the expert shards average over EDP, as with
    :class:`ExpertParallel`; vemesh's DDP, ZeRO-1 and :func:`vemesh.parallel.fully_shard` find them the same way.
    """

    def __init__(self, tp_dims: dict[str, int] | None = None) -> None:
        super().__init__()
        self.given = tp_dims is not None  # the default names what torchtitan's experts may have; a given one is exact
        self.tp_dims = dict(TITAN_TP_DIMS if tp_dims is None else tp_dims)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(device_mesh, DeviceMesh) or device_mesh.ndim != 2:
            raise ValueError("ExpertTensorParallel needs the 2-D mesh of EP and TP, VESCALE_DEVICE_MESH['EP', 'TP']; "
                             f"got {device_mesh!r:.100}")
        check_view(device_mesh, "the EP x TP mesh")
        params = _check_grouped(module, device_mesh.size(0), "ExpertTensorParallel")
        if _contract(module, "ExpertTensorParallel") == "routed":
            raise ValueError(f"ExpertTensorParallel takes the grouped contract (forward(x, num_tokens_per_expert), "
                             f"torchtitan's w1/w2/w3); {type(module).__name__} has the routed one (forward(hidden_states, "
                             "top_k_index, top_k_weights)), whose fused gate_up_proj holds gate and up one after the "
                             "other on dim 1, so no TP split of it is column-parallel; use ExpertParallel on mesh['EP']")
        tp = device_mesh.size(1)
        unknown = sorted(set(self.tp_dims) - {n for n, _ in params})
        if unknown and self.given:
            raise ValueError(f"ExpertTensorParallel: tp_dims names {unknown}, which {type(module).__name__} does not "
                             f"have; its parameters are {[n for n, _ in params]}")
        for name, p in params:
            dim = self.tp_dims.get(name)
            if dim is not None and (not 0 < dim < p.dim() or p.size(dim) % tp):
                raise ValueError(f"ExpertTensorParallel: {name} {tuple(p.shape)} cannot split dim {dim} over TP {tp}")
            place = [Shard(0), Shard(dim) if dim is not None else Replicate()]
            shard = nn.Parameter(distribute_tensor(p.detach(), device_mesh, place), requires_grad=p.requires_grad)
            setattr(shard, EXPERT, True)
            module.register_parameter(name, shard)
        setattr(module, EXPERT, True)
        whole = {n for n, _ in params if n not in self.tp_dims}  # output biases: 1/TP of them on each TP rank
        groups = (device_mesh.get_group(0), device_mesh.get_group(1))
        module.forward = functools.partial(_tp_forward, module, module.forward, groups, whole)  # type: ignore[method-assign]
        return module


def _check_grouped(module: nn.Module, ep: int, style_name: str) -> list[tuple[str, nn.Parameter]]:
    """The module's parameters, checked to be a grouped-experts module whose expert count EP divides."""
    if getattr(module, EXPERT, False):
        raise ValueError(f"{type(module).__name__} is already expert-parallel; apply {style_name} once")
    params = list(module.named_parameters(recurse=False))
    holding = [n for n, c in module.named_children() if any(True for _ in c.parameters())]
    if not params or holding:
        raise ValueError(
            f"{style_name} takes an experts module: parameters stacked over experts on dim 0 and no submodule "
            f"with parameters (an activation is fine); {type(module).__name__} has {len(params)} parameters"
            f"{' and submodules with parameters: ' + ', '.join(holding) if holding else ''}"
        )
    experts = {p.size(0) for _, p in params}
    if len(experts) != 1 or next(iter(experts)) % ep:
        shapes = {n: tuple(p.shape) for n, p in params}
        raise ValueError(f"{style_name} needs every parameter's dim 0 to be the expert count, divisible by EP {ep}; "
                         f"got {shapes}")
    return params


#: the routed contract's index and weight arguments, by their names: transformers' decorated experts, GPT-OSS's own
ROUTED_NAMES = (("top_k_index", "top_k_weights"), ("router_indices", "routing_weights"))


def _contract(module: nn.Module, style_name: str) -> str:
    """``"grouped"`` or ``"routed"``: which forward the experts module has (see the module docstring)."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # no signature to read: take it as the grouped contract
        return "grouped"
    names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    if len(names) == 3 and tuple(names[1:]) in ROUTED_NAMES:
        experts = {p.size(0) for p in module.parameters(recurse=False)}
        if getattr(module, "num_experts", None) not in experts:
            raise ValueError(f"{style_name}: {type(module).__name__} has the routed contract, whose num_experts must be "
                             f"the experts its parameters stack on dim 0 ({sorted(experts)}); it has num_experts = "
                             f"{getattr(module, 'num_experts', None)!r}")
        return "routed"
    if len(names) == 2 or (varargs and len(names) <= 2):  # forward(*args): a wrapper's, which cannot say
        return "grouped"
    raise ValueError(f"{style_name} takes experts whose forward is forward(x, num_tokens_per_expert) (grouped by expert, "
                     "torchtitan's) or forward(hidden_states, top_k_index, top_k_weights) (Hugging Face's); "
                     f"{type(module).__name__}.forward takes ({', '.join(names) or '...'})")


def _connected(out: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """``out``, tied to ``tokens`` in autograd when it is not already: a rank whose experts got no tokens still
    runs the backward of the exchange its peers run (otherwise they would wait for it)."""
    if torch.is_grad_enabled() and tokens.requires_grad and not out.requires_grad:
        return out + tokens.sum() * 0
    return out


class _SumOverTP(torch.autograd.Function):
    """Forward: the sum over the TP group (the row-parallel partial outputs); backward: the gradient as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        out = x.clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


class _SameOverTP(torch.autograd.Function):
    """Forward: the input as it is (the same on every TP rank); backward: the gradient summed over TP."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:  # type: ignore[override]
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Share(torch.autograd.Function):
    """Forward: ``1/n`` of a tensor (each of ``n`` ranks adds a share of it); backward: the gradient as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, n: int) -> torch.Tensor:  # type: ignore[override]
        return x / n

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # type: ignore[override]
        return grad, None


def _tp_forward(module: nn.Module, inner: Any, groups: tuple[Any, Any], whole: set[str], x: torch.Tensor,
                num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Tokens to their experts' EP ranks, this TP rank's slice of each local expert, the sum over TP, back."""
    ep_group, tp_group = groups
    tokens, counts, plan = dispatch(x, num_tokens_per_expert, ep_group)
    tp = dist.get_world_size(tp_group)
    tokens = _SameOverTP.apply(tokens, tp_group)
    with _local_weights(module, lambda name, t: _Share.apply(t, tp) if name in whole else t):
        out = inner(tokens, counts)
    return combine(_SumOverTP.apply(_connected(out, tokens), tp_group), plan, ep_group)


def _forward(module: nn.Module, inner: Any, group: Any, x: torch.Tensor, num_tokens_per_expert: torch.Tensor) -> torch.Tensor:
    """Tokens to their experts' ranks, this rank's experts on their local weights, the results back."""
    tokens, counts, plan = dispatch(x, num_tokens_per_expert, group)
    with _local_weights(module):
        out = inner(tokens, counts)
    return combine(_connected(out, tokens), plan, group)


def _routed_forward(module: nn.Module, inner: Any, group: Any, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                    top_k_weights: torch.Tensor) -> torch.Tensor:
    """Each (token, choice) slot to its expert's rank, the module's own forward there on its local experts (weight 1
    per slot), the results back, weighted by the router and summed over the choices where the token lives."""
    experts, k = module.num_experts, top_k_index.size(-1)
    slots = top_k_index.reshape(-1)
    order = slots.argsort(stable=True)  # the slots grouped by expert, tokens in order within each
    counts = torch.bincount(slots, minlength=experts)
    tokens, local_counts, plan = dispatch(hidden_states[order // k], counts, group)
    # each arrived slot's local expert; its size is the slots that arrived (given, so no device sync reads the counts)
    local = torch.repeat_interleave(torch.arange(local_counts.numel(), device=tokens.device), local_counts,
                                    output_size=tokens.size(0))
    ones = torch.ones(local.numel(), 1, dtype=top_k_weights.dtype, device=tokens.device)
    with _local_weights(module):
        module.num_experts = local_counts.numel()
        try:
            out = inner(tokens, local.unsqueeze(1), ones)
        finally:
            module.num_experts = experts
    back = combine(_connected(out, tokens), plan, group)[order.argsort()]
    weighted = back.view(-1, k, back.size(-1)) * top_k_weights.unsqueeze(-1)
    return weighted.sum(1).to(hidden_states.dtype)
