"""What one run of ``vemesh check`` records: every module's outputs in forward order and every gradient by name.

The same code records the one-process run and each rank of the parallel run, so that the two are keyed alike:

* a module's name is its name in the model as built: wrappers that parallelizing adds (torch's and vemesh's DDP
  ``module.``, ``torch.compile``'s ``_orig_mod.``, activation checkpointing's ``_checkpoint_wrapped_module.``) are
  left out of it (:func:`plain_name`);
* an output is keyed ``(module, call, index)``: the module's ``call``-th forward of the step, the ``index``-th tensor
  of what it returned. A DTensor is gathered whole (``full_tensor()``, a collective every rank of its mesh runs in
  the same order); a plain tensor is kept as this rank's (a TP shard is joined with its peers' when compared).
  Forwards run again in the backward (activation checkpointing's recompute) are not recorded. What recording does
  (a DTensor's gather, a copy) runs outside the step's dispatch modes: inside a region of torch's selective
  checkpoint, whose mode counts each op of the forward to find it again in the recompute, the recording's ops
  changed that count, and a step that raises in a run (HF's Llama with its KV cache on under a per-op policy and TP)
  ran in the check and was called exact;
* a gradient is gathered whole the same way (TP's and FSDP2's DTensors), under every name the parameter has.

:class:`Deterministic` makes the step's dropout draw nothing in either run (``p`` taken as 0, counted), and
records any other random op that a module's forward draws, so that a difference it causes is named as its cause.
"""

from __future__ import annotations

import contextlib
import inspect
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.nn.utils.clip_grad as torch_clip
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.placement_types import _StridedShard
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from vemesh.parallel.experts.style import EXPERT
from vemesh.check.watches import on_tp as param_on_tp
from vemesh.parallel.tp_split import column_split_linears, parts, plain_name, unwrap
from vemesh.planning.user_code import outside_fsdp as fsdp_outside

__all__ = ["RANDOM_OPS", "Deterministic", "Recorder", "column_split_linears", "data_parallel", "gradients",
           "outside_fsdp",
           "not_recorded", "parts", "plain_name", "quiet_shape_inference", "unsynced", "unwrap"]


def data_parallel(model: nn.Module) -> bool:
    """Whether ``model`` is wrapped in a data-parallel module the check knows: torch's or vemesh's DDP, or FSDP2 (on
    it or any module under it)."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, nn.Module):  # under PP: any stage's
        return any(data_parallel(m) for m in model)
    if isinstance(model, nn.parallel.DistributedDataParallel):
        return True
    return any(isinstance(m, FSDPModule) for m in unwrap(model).modules())


def unsynced(model: Any) -> str:
    """How the step left gradients that DP did not average, or '': its last backward under vemesh DDP's
    ``no_sync()`` (the wrapper holds them unaveraged), or with FSDP2's ``set_requires_gradient_sync(False)``."""
    from torch.distributed.fsdp import FSDPModule

    if not isinstance(model, nn.Module):  # under PP: any stage's
        return next((said for said in map(unsynced, model) if said), "")
    if getattr(model, "holds_unsynced_grads", False):
        return "vemesh DDP's no_sync()"
    for m in unwrap(model).modules():
        group = m._get_fsdp_state()._fsdp_param_group if isinstance(m, FSDPModule) else None
        if group is not None and not group.reduce_grads:
            return "FSDP2's set_requires_gradient_sync(False)"
    return ""


def on_tp(model: nn.Module) -> bool:
    """Whether any of ``model``'s parameters is a DTensor on a mesh with the TP dim (any placement: a TP plan's
    sharded Linears, sequence parallelism's replicated norms, FSDP2's shards of them): TP touched the model."""
    return any(param_on_tp(p) for part, _ in parts(model) for p in part.parameters())


def outside_fsdp(model: Any) -> list[str]:
    """The names of ``model``'s trainable parameters (its stages' under PP) under no FSDP2 unit, where FSDP2 shards
    some of them (:func:`vemesh.planning.user_code.outside_fsdp`)."""
    return fsdp_outside([part for part, _ in parts(model)])


def _whole(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.clone()


def _column_shard(module: nn.Module, t: torch.Tensor) -> torch.Tensor | None:
    """A column-wise Linear's (or Embedding's) local output, as the DTensor it is a shard of; None otherwise.

    torch's ``ColwiseParallel`` and vemesh's ``FusedColwiseParallel`` return the local shard by default: its
    placement is the weight's output rows' (``Shard(0)`` rows give ``Shard(-1)`` outputs, a strided shard of the
    rows a strided shard of the outputs), on the weight's TP mesh."""
    w = getattr(module, "weight", None)
    if isinstance(t, DTensor) or not isinstance(w, DTensor) or w.device_mesh.ndim != 1 or t.dim() == 0:
        return None
    (p,) = w.placements
    rows = 0 if isinstance(module, nn.Linear) else 1 if isinstance(module, nn.Embedding) else None
    if rows is None or not isinstance(p, (Shard, _StridedShard)) or p.dim != rows or \
            t.shape[-1] != w.to_local().shape[rows]:
        return None
    out = _StridedShard(t.dim() - 1, split_factor=p.split_factor) if isinstance(p, _StridedShard) else Shard(t.dim() - 1)
    return DTensor.from_local(t.detach(), w.device_mesh, [out], run_check=False)


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


#: depth of :func:`not_recorded`: forwards that are not the step's
_UNRECORDED = [0]


@contextlib.contextmanager
def not_recorded() -> Iterator[None]:
    """Inside, no module output is recorded and no random op is: a forward that is not the step's (torch's pipeline
    stage runs its module once on placeholder inputs to learn the shapes it sends, before the first micro-batch)."""
    _UNRECORDED[0] += 1
    try:
        yield
    finally:
        _UNRECORDED[0] -= 1


def quiet_shape_inference(stage: Any) -> None:
    """``stage`` (a ``PipelineStage``) runs its shape-learning forward under :func:`not_recorded`."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:  # another torch: nothing of the kind to leave out
        return

    def quiet(*args: Any, **kwargs: Any) -> Any:
        with not_recorded():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = quiet


class Recorder:
    """Record ``model``'s module outputs while active (a context manager), in the order the modules finish."""

    def __init__(self, model: nn.Module | list[nn.Module], expected: dict[str, frozenset] | None = None) -> None:
        self.modules: list[tuple[str, nn.Module]] = []
        #: under PP (``model`` a list of stage modules, ``expected`` the model's modules' parameters by name): the
        #: modules of a stage under a name of the model whose parameters are not that module's, left out: a stage's
        #: own root, the base model's module over the stage's layers, a stand-in (``nn.Identity`` for the final norm
        #: on the stages before the last)
        self.partial: set[str] = set()
        for part, stage in parts(model):
            for n, m in part.named_modules(remove_duplicate=False):
                if not stage or (n and expected is not None and expected.get(plain_name(n)) == module_params(n, m)):
                    self.modules.append((n, m))
                elif n:
                    self.partial.add(plain_name(n))
        self.names = {id(m): plain_name(n) for n, m in self.modules}
        #: each module's parameters by name (what a stage's modules are matched with under PP)
        self.params = {plain_name(n): module_params(n, m) for n, m in self.modules}
        #: expert-parallel modules (vemesh's ExpertParallel): inside them each EP rank runs the tokens routed to its
        #: experts, in their order, which no join of one process's outputs makes; their own output is compared
        self.experts = {plain_name(n) for n, m in self.modules if getattr(m, EXPERT, False)}
        #: ``(module name, call, index) -> tensor``, in the order the outputs were produced
        self.outputs: dict[tuple[str, int, int], torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        #: the modules whose forward is running now (innermost last), for :class:`Deterministic`; after a forward
        #: raised, the modules it raised in
        self.stack: list[str] = []
        self._handles: list[Any] = []
        #: each Linear's output, by id, until read (:meth:`read`): ``id -> (weak reference, Linear's name)``
        self._linear_out: dict[int, tuple[Any, str, int]] = {}  # (the output, the Linear, the dim of its features)
        #: how many equal parts the forward cut each Linear's output into along its last dim, by the op that cut it
        #: (``chunk(2, -1)``, ``split(C, -1)``, ``view(B, T, 3, -1, d)``): a fused projection's parts, read
        self.read_parts: dict[str, int] = {}
        #: each Embedding's indices at its first call (a learned position embedding's: how the model numbers them)
        self.indices: dict[str, torch.Tensor] = {}

    def _pre(self, module: nn.Module, args: Any) -> None:
        name = self.names.get(id(module))
        if name is not None and not _in_backward():  # also where not recorded: a pipeline stage's shape inference
            self.stack.append(name)  # runs the first forward, and a wrong plan raises there first (where, said)
            if isinstance(module, nn.Embedding) and args and isinstance(args[0], torch.Tensor):
                with _disable_current_modes():
                    self.indices.setdefault(name, args[0].detach().clone())

    def _post(self, module: nn.Module, args: Any, output: Any) -> None:
        name = self.names.get(id(module))
        if name is None or _in_backward():
            return
        if self.stack and self.stack[-1] == name:
            self.stack.pop()
        if _UNRECORDED[0]:
            return
        if self.experts and any(s in self.experts for s in self.stack):  # inside one: the routed tokens
            return
        call = self.calls.get(name, 0)
        self.calls[name] = call + 1
        if type(module) is nn.Linear and isinstance(output, torch.Tensor) and name not in self.read_parts:
            self._linear_out[id(output)] = (weakref.ref(output), name, output.dim() - 1)
        leaves, _ = tree_flatten(output)
        tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.is_floating_point()]
        if not tensors and hasattr(output, "values"):  # HF's ModelOutput is a dict the pytree does not open
            tensors = [t for t in output.values() if isinstance(t, torch.Tensor) and t.is_floating_point()]
        with _disable_current_modes():  # the recording's own ops, not the step's (the module docstring)
            for i, t in enumerate(tensors):
                shard = _column_shard(module, t) if i == 0 and len(tensors) == 1 else None
                self.outputs[(name, call, i)] = _whole(t if shard is None else shard)

    def read(self, func: Any, args: Any, kwargs: dict, result: Any = None) -> None:
        """If ``func`` cuts a Linear's output into equal parts along its features' dim, note how many (read_parts);
        if it moves that dim (a transpose, Mamba's ``in_proj(x).transpose(1, 2)``), follow it to ``result``."""
        x = args[0] if args else None
        seen = self._linear_out.pop(id(x), None) if isinstance(x, torch.Tensor) else None
        if seen is None or seen[0]() is not x:
            return
        if func in _MOVES:
            if isinstance(result, torch.Tensor) and (dim := _moved(func, x, args[1:], kwargs, seen[2])) is not None:
                self._linear_out[id(result)] = (weakref.ref(result), seen[1], dim)
            return
        parts = _parts_cut(func, x, args[1:], kwargs, seen[2])
        if parts is not None and x.shape[seen[2]] % parts == 0:
            self.read_parts[seen[1]] = parts

    def __enter__(self) -> Recorder:
        # each module's own hooks, after those that parallelizing put there (a TP style's output redistribution
        # runs first, so the output recorded is the one the next module gets; an embedding's masked partial sum is
        # reduced by its style, not by the recording)
        for _, m in {id(m): (n, m) for n, m in self.modules}.values():
            self._handles += [m.register_forward_pre_hook(self._pre, prepend=True),
                              m.register_forward_hook(self._post)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


def module_params(name: str, module: nn.Module) -> frozenset:
    """The names of ``module``'s parameters in the model (``name`` its own), wrappers left out."""
    return frozenset(plain_name(f"{name}.{p}" if name else p) for p, _ in module.named_parameters(remove_duplicate=False))


def gradients(model: nn.Module | list[nn.Module]) -> dict[str, torch.Tensor | None]:
    """Each parameter's whole gradient (None: none) under each of its names; collective for DTensors. Under PP
    (a list of this rank's stage modules) those of its stages'."""
    out: dict[str, torch.Tensor | None] = {}
    for part, _ in parts(model):
        for name, p in part.named_parameters(remove_duplicate=False):
            out[plain_name(name)] = None if p.grad is None else _whole(p.grad)
    return out


_CHUNKS = {torch.chunk, torch.Tensor.chunk}
_SPLITS = {torch.split, torch.Tensor.split}
_VIEWS = {torch.Tensor.view, torch.Tensor.reshape, torch.reshape}
_MOVES = {torch.transpose, torch.Tensor.transpose, torch.permute, torch.Tensor.permute}


def _moved(func: Any, x: torch.Tensor, rest: tuple, kwargs: dict, dim: int) -> int | None:
    """Where ``func(x, *rest, **kwargs)`` (a transpose or permute) puts ``x``'s dim ``dim``, else None."""
    if func in (torch.transpose, torch.Tensor.transpose):
        a, b = (kwargs.get("dim0", rest[0] if rest else None), kwargs.get("dim1", rest[1] if len(rest) > 1 else None))
        if not (isinstance(a, int) and isinstance(b, int)):
            return None
        a, b = a % x.dim(), b % x.dim()
        return b if dim == a else a if dim == b else dim
    order = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list)) else kwargs.get("dims", rest)
    if not all(isinstance(n, int) for n in order) or len(order) != x.dim():
        return None
    return [n % x.dim() for n in order].index(dim)


def _parts_cut(func: Any, x: torch.Tensor, rest: tuple, kwargs: dict,
               features: int | None = None) -> int | None:
    """How many equal parts ``func(x, *rest, **kwargs)`` cuts ``x`` into along its features' dim (``features``, the
    last by default) (2 or more), else None: ``chunk(n, dim=-1)``; ``split(size, dim=-1)`` (or equal sizes); a view
    of the last dim as ``(n, -1 or heads, d)`` with ``n`` 2 or 3 (ModernBERT's ``Wqkv``), not ``(heads, 3, d)`` (a
    head-major ``[q_h k_h v_h]``, which a plain row split shards exactly)."""
    last = x.dim() - 1
    features = last if features is None else features
    if func in _CHUNKS or func in _SPLITS:
        dim = kwargs.get("dim", rest[1] if len(rest) > 1 else 0)
        if not isinstance(dim, int) or dim % x.dim() != features:
            return None
        arg = kwargs.get("chunks", kwargs.get("split_size_or_sections", kwargs.get("split_size",
                                                                                rest[0] if rest else None)))
        if func in _CHUNKS:
            return arg if isinstance(arg, int) and arg > 1 else None
        if isinstance(arg, int) and arg > 0:
            return x.shape[features] // arg if x.shape[features] // arg > 1 else None
        sizes = list(arg) if isinstance(arg, (list, tuple)) else []
        return len(sizes) if len(sizes) > 1 and len(set(sizes)) == 1 else None
    if func in _VIEWS and features == last:
        shape = rest[0] if len(rest) == 1 and isinstance(rest[0], (tuple, list, torch.Size)) else rest
        shape = kwargs.get("shape", shape)
        if not all(isinstance(n, int) for n in shape) or tuple(shape[:last]) != tuple(x.shape[:last]):
            return None
        tail = tuple(shape[last:])
        if len(tail) >= 3 and tail[0] in (2, 3) and tail[1] not in (2, 3):
            return tail[0]
    return None


_DROPOUTS = {F.dropout, F.dropout1d, F.dropout2d, F.dropout3d, F.alpha_dropout, F.feature_alpha_dropout}
RANDOM_OPS = {torch.rand, torch.randn, torch.randint, torch.rand_like, torch.randn_like, torch.randint_like,
           torch.bernoulli, torch.normal, torch.multinomial, torch.randperm, torch.poisson,
           torch.Tensor.bernoulli_, torch.Tensor.normal_, torch.Tensor.uniform_, torch.Tensor.random_,
           torch.Tensor.exponential_, torch.Tensor.geometric_, torch.Tensor.log_normal_, torch.Tensor.cauchy_}


class Deterministic(TorchFunctionMode):
    """Dropout draws nothing (``p`` taken as 0: the same function in both runs); other random ops in a module's
    forward are recorded in :attr:`random_ops` as ``(module, op)``. Random ops outside every module (the step
    drawing its tokens) are the step's inputs, drawn from the same seed in both runs, and left alone.

    :attr:`clips` counts the step's calls of torch's ``clip_grad_norm_``, which under PP clips each stage by its own
    norm: its scaling (``_clip_grads_with_norm_``, looked up by name inside it, so whichever way the step imported
    it), not torch's public ``clip_grads_with_norm_``, which a clip over PP calls after all-reducing the norm."""

    def __init__(self, recorder: Recorder) -> None:
        super().__init__()
        self.recorder = recorder
        self.dropouts = self.clips = 0
        self.random_ops: list[tuple[str, str]] = []
        self._scale: Any = None

    def __enter__(self) -> Deterministic:
        scale = self._scale = getattr(torch_clip, "_clip_grads_with_norm_", None)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.clips += 1
            return scale(*args, **kwargs)

        if scale is not None:  # (a torch that names it otherwise: test_check's clip test says so)
            torch_clip._clip_grads_with_norm_ = counted
        return super().__enter__()

    def __exit__(self, *exc: Any) -> Any:
        if self._scale is not None:
            torch_clip._clip_grads_with_norm_ = self._scale
        return super().__exit__(*exc)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func in _DROPOUTS:
            p = kwargs.get("p", args[1] if len(args) > 1 else 0.5)
            training = kwargs.get("training", args[2] if len(args) > 2 else True)
            if training and p > 0:
                self.dropouts += 1
                return args[0]  # dropout with p = 0: the input itself
        elif func is F.scaled_dot_product_attention:
            p = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if p:
                self.dropouts += 1
                args = tuple(args[:4]) + ((0.0,) + tuple(args[5:]) if len(args) > 4 else ())
                if "dropout_p" in kwargs:
                    kwargs["dropout_p"] = 0.0
        elif func in _CHUNKS or func in _SPLITS or func in _VIEWS:
            self.recorder.read(func, args, kwargs)
        elif func in _MOVES:
            result = func(*args, **kwargs)
            self.recorder.read(func, args, kwargs, result)
            return result
        elif func in RANDOM_OPS and self.recorder.stack and not _in_backward() and not _UNRECORDED[0]:
            self.random_ops.append((self.recorder.stack[-1], getattr(func, "__name__", str(func))))
        return func(*args, **kwargs)


def positions_argument(model: nn.Module) -> str | None:
    """The name under which ``model``'s forward takes the tokens' positions (HF's ``position_ids``, torchtitan's
    ``positions``, gpt-fast's ``input_pos``), or None where it takes none by name: for the CP positions hint."""
    try:
        names = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):  # a forward without a signature Python can read
        return None
    return next((n for n in names if "position" in n or n in ("input_pos", "pos", "pos_ids")), None)
