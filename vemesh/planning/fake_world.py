"""The world a plan of the user's functions runs in: rank 0 of a fake world of the planned mesh, fake tensors.

* :func:`fake_world`: torch's fake backend for the world size, ``VESCALE_DEVICE_MESH`` built by ParallelDims;
* :func:`real_mesh_tensors`: torch's DeviceMesh computing with real tensors inside ``FakeTensorMode``;
* :func:`give_storage`: a model built on the meta device given fake storage (``to_empty``);
* :func:`copies_in_mode`: ``copy.deepcopy`` of a fake tensor (a pipeline stage cut from the model) made in the
  trace's own fake mode, as a real copy is a new tensor of the same kind;
* :func:`fakes_take_foreach`: torch's foreach paths (clipping) taking a fake tensor as a plain one;
* :func:`to_bf16`: ``model.to(torch.bfloat16)`` for a model of fake tensors;
* :class:`Held`: the bytes of a model's own weights and gradients at a moment (the peak), each storage once;
* :func:`local_shards`: ``distribute_tensor`` cutting only this rank's shard (no chunk per rank, no scatter);
* :func:`chunks_on_demand`: FSDP2's cut of each parameter into one chunk per shard made only for the chunks it reads
  (at 16384 data-parallel ranks, a view per rank of every parameter was most of a plan's time);
* :func:`cpu_kernel_shapes`: the ops whose meta kernels refuse what their CPU kernels run, given their shapes.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import re
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.placement_types import Shard
from torch.utils._pytree import tree_map_only

from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
from vemesh.parallel import ParallelDims

__all__ = ["Chunks", "Held", "chunks_on_demand", "copies_in_mode", "cpu_kernel_shapes", "fake_world",
           "fakes_take_foreach", "give_storage", "local_shards", "real_mesh_tensors", "to_bf16"]


@contextlib.contextmanager
def fake_world(world_size: int, degrees: dict[str, int], dp_replicate: int, keep_dp: bool = False,
               pp_rank: int = 0) -> Iterator[Any]:
    """Rank 0 of a fake world, or the first rank of PP rank ``pp_rank``, ``VESCALE_DEVICE_MESH`` built for the
    degrees by ParallelDims (with a DP dim of size 1 too when ``keep_dp``); undone after."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("the planner runs your functions on torch's fake backend, in a world of its own; call it "
                           "before init_process_group (or in another process)")
    names = tuple(n for n in ("PP", "DP", "CP", "TP") if degrees.get(n, 1) > 1 or (n == "DP" and keep_dp)) or None
    dims = ParallelDims(world_size, pp=degrees.get("PP", 1), dp_replicate=dp_replicate, cp=degrees["CP"],
                        tp=degrees["TP"], ep=degrees["EP"], mesh_dims=names)
    rank = pp_rank * (world_size // degrees.get("PP", 1))  # PP is the outermost dim: its ranks are blocks
    # torch warns once per mesh where DTensor redistributes over two dims in two collectives (a clipping's norm
    # over DP x TP); each world here has a mesh of its own, so a search printed it once per trace. The trace counts
    # both collectives; a run prints it once.
    redistribute = logging.getLogger("torch.distributed.tensor._redistribute")
    level = redistribute.level
    redistribute.setLevel(logging.ERROR)
    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        _forget_meshes()
        dims.build("cpu", mesh)
        yield mesh
    finally:
        mesh.reset()
        dist.destroy_process_group()
        _forget_meshes()
        redistribute.setLevel(level)


def _forget_meshes() -> None:
    """Empty DTensor's caches of sharding and redistribution plans. They are keyed by DeviceMesh, which compares equal
    for the same slice of two worlds (its layout, not its ranks): a plan cached in the world of PP rank 0 would
    send PP rank 1's TP all-reduce to PP rank 0's group (and a run after the plan to a fake world's group)."""
    from torch.distributed.tensor import DTensor, _redistribute
    from torch.distributed.tensor.debug import _clear_sharding_prop_cache

    _clear_sharding_prop_cache()  # the Python cache and the C++ fast path's
    type(DTensor._op_dispatcher.sharding_propagator)._propagate_tensor_meta_cached.cache_clear()
    _redistribute._gen_transform_infos.cache_clear()
    _redistribute.clear_redistribute_planner_cache()


@contextlib.contextmanager
def real_mesh_tensors() -> Iterator[None]:
    """torch's DeviceMesh computes with its rank tensor (``nonzero``, ``tolist``); under FakeTensorMode that tensor
    would be fake. DeviceMesh never touches the model's tensors, so every method of it runs with real tensors here
    (FSDP2 builds a mesh while sharding a TP model; vemesh DDP reads a DTensor's mesh). So does torch's strided
    shard's index arithmetic (``_StridedShard.local_shard_size_and_offset``: an ``arange`` of a dim's size, then
    ``tolist``), which gathering one (a fused projection's, ``vemesh.parallel.FusedColwiseParallel``) runs."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor.placement_types import _StridedShard

    def real(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            with unset_fake_temporarily():
                return fn(*args, **kwargs)
        return run

    saved = {}
    for name, attr in list(vars(DeviceMesh).items()):
        if name in ("__new__", "__init_subclass__", "__class_getitem__"):
            continue
        if isinstance(attr, staticmethod):
            saved[name], new = attr, staticmethod(real(attr.__func__))
        elif isinstance(attr, classmethod):
            saved[name], new = attr, classmethod(real(attr.__func__))
        elif isinstance(attr, property) and attr.fget is not None:
            saved[name], new = attr, property(real(attr.fget), attr.fset, attr.fdel, attr.__doc__)
        elif inspect.isfunction(attr):
            saved[name], new = attr, real(attr)
        else:
            continue
        setattr(DeviceMesh, name, new)
    strided = vars(_StridedShard)["local_shard_size_and_offset"]
    _StridedShard.local_shard_size_and_offset = real(strided)
    # init_device_mesh makes the rank tensor before DeviceMesh sees it: real too, in every module that holds it by
    # name (FSDP2's fully_shard without a mesh makes one over the world with it; so may the user's own code)
    made = torch.distributed.device_mesh.init_device_mesh
    holders = [m for m in list(sys.modules.values()) if vars(m).get("init_device_mesh") is made]
    for module in holders:
        module.init_device_mesh = real(made)
    try:
        with quiet_sharding_propagation():
            yield
    finally:
        for name, attr in saved.items():
            setattr(DeviceMesh, name, attr)
        _StridedShard.local_shard_size_and_offset = strided
        for module in holders:
            module.init_device_mesh = made


@contextlib.contextmanager
def quiet_sharding_propagation() -> Iterator[None]:
    """DTensor derives an op's output shape by running the op on fake tensors of the *global* shapes (its sharding
    propagation, ``_propagate_tensor_meta_non_cached``). Under the planner's counters those would count as the
    step's allocations, FLOPs and bytes: a vocabulary-parallel loss's logits at their full size, every time its
    handlers propagate. They run here with every dispatch mode off (a fresh fake mode of their own)."""
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import _disable_current_modes

    cls = type(DTensor._op_dispatcher.sharding_propagator)
    original = cls._propagate_tensor_meta_non_cached

    def quiet(self: Any, op_schema: Any) -> Any:
        with _disable_current_modes():
            return original(self, op_schema)

    cls._propagate_tensor_meta_non_cached = quiet
    try:
        yield
    finally:
        cls._propagate_tensor_meta_non_cached = original


@contextlib.contextmanager
def fakes_take_foreach() -> Iterator[None]:
    """Inside, torch's foreach paths that choose by a tensor's type (``clip_grad_norm_``'s norms and its scaling) take
    a fake tensor as the plain tensor it stands for, as torch registers DTensor: a real step's clipping runs one
    ``_foreach_norm`` over its gradients, where a fake one ran a norm per gradient (each an op, counted at the
    framework's time per op)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils import _foreach_utils

    supported = _foreach_utils._foreach_supported_types
    added = FakeTensor not in supported
    if added:
        supported.append(FakeTensor)
    try:
        yield
    finally:
        if added:
            supported.remove(FakeTensor)


@contextlib.contextmanager
def copies_in_mode(fake_mode: Any) -> Iterator[None]:
    """Inside, ``copy.deepcopy`` of a fake tensor of ``fake_mode`` is a new fake tensor of the same mode, with its own
    storage (a Parameter stays a Parameter). torch's own deepcopy of a fake tensor makes it in a new fake mode, whose
    views MemTracker cannot tell from their base: a stage cut from the model by ``deepcopy`` (torchtitan's way, and
    the GPT's) held every weight twice in the peak, once for the weight and once for each ``weight.t()`` kept for
    backward."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.overrides import TorchFunctionMode

    class Copies(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            if func is torch.Tensor.__deepcopy__ and isinstance(args[0], FakeTensor) and \
                    args[0].fake_mode is fake_mode:
                tensor, memo = args
                if id(tensor) not in memo:
                    with torch.no_grad():
                        copy = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype,
                                                   device=tensor.device)
                    copy = nn.Parameter(copy, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else \
                        copy.requires_grad_(tensor.requires_grad)
                    memo[id(tensor)] = copy
                return memo[id(tensor)]
            return func(*args, **(kwargs or {}))

    with Copies():
        yield


class Chunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` (FSDP2's ``_chunk_with_empty``), each chunk
    made when it is read: the same tensors, without ``n`` views of every parameter up front."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int) -> None:
        self.tensor, self.n, self.dim = tensor, n, dim
        length = tensor.size(dim)
        self.step = -(-length // n) if length else 0  # torch.chunk's chunk size: ceil(length / n)
        self.made = -(-length // self.step) if self.step else n  # how many chunks torch.chunk returns (n if empty)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if not -self.n <= i < self.n:
            raise IndexError(f"chunk {i} of {self.n}")
        i %= self.n
        if i >= self.made:
            return self[0].new_empty(0)
        start = i * self.step
        return self.tensor.narrow(self.dim, start, min(self.step, self.tensor.size(self.dim) - start))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return (self[i] for i in range(self.n))


@contextlib.contextmanager
def chunks_on_demand() -> Iterator[None]:
    """Inside, FSDP2 cuts parameters with :class:`Chunks` (it only indexes the list ``_chunk_with_empty`` returns)."""
    import torch.distributed.fsdp._fully_shard._fsdp_param as fsdp_param

    real = fsdp_param._chunk_with_empty
    fsdp_param._chunk_with_empty = Chunks  # type: ignore[assignment]
    try:
        yield
    finally:
        fsdp_param._chunk_with_empty = real


@contextlib.contextmanager
def local_shards() -> Iterator[None]:
    """Inside, ``distribute_tensor`` cuts only this rank's shard of each ``Shard`` placement: torch's chunk of the
    tensor at this rank's coordinate, cloned, as its ``src_data_rank=None`` path gives it, without a view of every
    rank's chunk and the scatter (a run's one-time start-up, outside any step the plan counts). A chunk that would be
    empty (more ranks than rows) and ``_StridedShard`` take torch's own path."""
    real = Shard._shard_tensor

    def shard(self: Shard, tensor: torch.Tensor, mesh: Any, mesh_dim: int, src_data_rank: int | None = 0) -> torch.Tensor:
        coordinate = mesh.get_coordinate()
        n = mesh.size(mesh_dim=mesh_dim)
        chunks = Chunks(tensor, n, self.dim) if coordinate is not None else None
        if type(self) is not Shard or chunks is None or coordinate[mesh_dim] >= chunks.made:
            return real(self, tensor, mesh, mesh_dim, src_data_rank)
        return chunks[coordinate[mesh_dim]].clone()

    Shard._shard_tensor = shard  # type: ignore[method-assign]
    try:
        yield
    finally:
        Shard._shard_tensor = real  # type: ignore[method-assign]


def _replace(model: nn.Module, change: Callable[[torch.Tensor], torch.Tensor | None]) -> None:
    """Each parameter and buffer ``t`` of ``model`` replaced by ``change(t)`` (None: kept), as ``Module._apply`` would
    but for fake tensors, which it cannot swap. A tensor held twice (tied weights) is replaced once: still tied."""
    done: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, p in module._parameters.items():
            if p is not None and id(p) not in done and (new := change(p)) is not None:
                done[id(p)] = nn.Parameter(new, requires_grad=p.requires_grad)
            if p is not None and id(p) in done:
                module._parameters[name] = done[id(p)]  # type: ignore[assignment]
        for name, b in module._buffers.items():
            if b is not None and id(b) not in done and (new := change(b)) is not None:
                done[id(b)] = new
            if b is not None and id(b) in done:
                module._buffers[name] = done[id(b)]


def to_bf16(model: nn.Module) -> None:
    """``model.to(torch.bfloat16)`` for fake tensors: floating parameters and buffers not yet bf16 replaced by bf16
    copies."""
    _replace(model, lambda t: t.detach().to(torch.bfloat16) if t.is_floating_point() and t.dtype != torch.bfloat16
             else None)


def give_storage(model: nn.Module, device: str = "cpu", dtype: torch.dtype | None = None) -> None:
    """A model built on the meta device, as torchtitan builds one, given (fake) storage on ``device``: what
    ``model.to_empty(device=device)`` does for real tensors, and with ``dtype`` then ``model.to(dtype)`` (its floating
    tensors made in it at once). Its ``__init__`` ran on meta, so an initialisation that samples until its values fit
    (``trunc_normal_``) was a no-op, as it is for torchtitan's meta init.

    A contiguous tensor is made by its shape and strides (``empty_like`` keeps both for it, a size-1 dim's stride
    too), not by ``empty_like`` of the meta tensor, which the fake mode first converts to one of its own."""

    def storage(t: torch.Tensor) -> torch.Tensor | None:
        if not t.is_meta:
            return None
        kind = dtype if dtype is not None and t.is_floating_point() else t.dtype
        if t.is_contiguous():
            return torch.empty_strided(t.size(), t.stride(), dtype=kind, device=device)
        return torch.empty_like(t, device=device, dtype=kind)

    _replace(model, storage)


class Held:
    """At a new peak: the bytes of the model's own parameters (their local shards, as the function left them), of its
    buffers (a storage a parameter shares counted as the parameter's), and of their gradients (and DDP's gradient
    buffers), each storage once."""

    def __init__(self, parts: list[nn.Module], ddps: list[Any]) -> None:
        self.weights = [t for part in parts for t in part.parameters()]
        self.model_buffers = [t for part in parts for t in part.buffers()]
        self.buffers = [b.data for ddp in ddps for b in ddp.grad_buffers]
        #: ZeRO-1's parameter buffers (:attr:`DistributedOptimizer.shards`), set once the optimizer is built: the
        #: plain parameters are views of them, and they hold a copy of the DTensor ones
        self.param_buffers: list[torch.Tensor] = []
        #: the model's largest kind of buffer, by name, a block's number as ``*``: ``(name, bytes of one)``
        self.largest_buffer = largest_buffer(parts)

    def __call__(self) -> dict[str, int]:
        # no torch-function mode sees these reads (nothing is made): through them, a tenth of a pipeline plan's time
        with torch._C.DisableTorchFunction():
            grads = [p.grad for p in self.weights if p.grad is not None]
            weights = _storages(self.weights + self.param_buffers)
            buffers = _storages(self.model_buffers)
            grads = _storages(grads + self.buffers)
        return {"params": sum(weights.values()), "buffers": sum(b for k, b in buffers.items() if k not in weights),
                "grads": sum(grads.values())}


def largest_buffer(parts: list[nn.Module]) -> tuple[str, int] | None:
    """The kind of buffer that holds the most bytes in ``parts``: ``(name with each number as *, bytes of the
    largest of it)`` (torchtitan's ``layers.*.attention.rope.cache``), or None without buffers. Named as in the
    model as built: DDP's ``module.``, ``torch.compile``'s and activation checkpointing's wrappers left out."""
    kinds: dict[str, list[int]] = {}
    for part in parts:
        for name, b in part.named_buffers():
            name = re.sub(r"^module\.|(?<![^.])(_orig_mod|_checkpoint_wrapped_module|_fsdp_wrapped_module)\.", "", name)
            kinds.setdefault(re.sub(r"(^|\.)\d+(?=\.)", r"\1*", name), []).append(b.numel() * b.element_size())
    if not kinds:
        return None
    name, sizes = max(kinds.items(), key=lambda kv: sum(kv[1]))
    return name, max(sizes)


def _storages(tensors: list[torch.Tensor]) -> dict[int, int]:
    """The bytes of each storage of ``tensors`` (a DTensor's local tensor's) by the storage's own address, which
    every tensor here keeps alive for the call."""
    from torch.distributed.tensor import DTensor

    seen: dict[int, int] = {}
    for t in tensors:
        storage = (t._local_tensor if isinstance(t, DTensor) else t).untyped_storage()
        seen[storage._cdata] = storage.nbytes()
    return seen


@contextlib.contextmanager
def cpu_kernel_shapes() -> Iterator[None]:
    """Inside, a fake tensor mode gives the ops whose meta kernels refuse what their CPU kernels run an output of the
    shape the CPU kernel returns.

    torch 2.13's ``_grouped_mm`` meta kernel takes bf16 only (CUDA's rule), while its CPU kernel takes fp32 too, and
    transformers 5's MoE experts call it in fp32 on CPU. Its output's shape is the meta kernel's on bf16 stand-ins,
    its dtype the inputs' (or ``out_dtype``). The rule is one of ``FakeTensorMode``'s own op implementations
    (``torch._subclasses.fake_impls``), held for the block: no dispatch mode of its own on every op (a mode cost a
    pipeline trace 6% to 9%), and the modes above the fake mode (the memory tracker, the counters) see the op as it
    was called."""
    from torch._subclasses import fake_impls

    rule = (_is_grouped_mm, _grouped_mm_on_cpu)
    fake_impls.op_implementations_checks.insert(0, rule)
    try:
        yield
    finally:
        fake_impls.op_implementations_checks.remove(rule)


def _is_grouped_mm(func: Any) -> bool:
    return func is torch.ops.aten._grouped_mm.default


def _grouped_mm_on_cpu(fake_mode: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """``_grouped_mm`` of fp32 or fp64 CPU tensors in ``fake_mode``; NotImplemented (torch's meta kernel) otherwise."""
    if args[0].device.type != "cpu" or args[0].dtype not in (torch.float32, torch.float64):
        return NotImplemented
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def stand_in(t: torch.Tensor) -> torch.Tensor:
        dtype = torch.bfloat16 if t.is_floating_point() else t.dtype
        return torch.empty_strided(t.shape, t.stride(), dtype=dtype, device="meta")

    out_dtype = kwargs.get("out_dtype", args[4] if len(args) > 4 else None) or args[0].dtype
    inputs = {**dict(zip(("offs", "bias"), args[2:4])), **kwargs, "out_dtype": None}
    with unset_fake_temporarily():
        shape = func(*tree_map_only(torch.Tensor, stand_in, args[:2]),
                     **tree_map_only(torch.Tensor, stand_in, inputs)).shape
        out = torch.empty(shape, dtype=out_dtype, device="meta")
    return fake_mode.fake_tensor_converter.from_meta_and_device(fake_mode, out, args[0].device)
