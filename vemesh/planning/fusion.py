"""What ``torch.compile`` and Float8 change in a step, counted on the eager trace (``vemesh plan --compile``,
``--float8``): the rules :mod:`vemesh.planning.step_time` times.

**Compile: which ops fuse.** Inductor fuses runs of pointwise ops and the reductions beside them (norms, softmax,
SwiGLU's ``silu * x``, RoPE's rotations, dtype casts) into one kernel each; it does not fuse matmuls, attention,
collectives, embeddings, the loss, or (torchtitan compiles the blocks, not the optimizer) the optimizer's foreach
ops. :class:`Fusion` replays that on the trace's ops in order: consecutive fusible ops (views in between do not
break a run) are one *region*, one kernel. Inside a region a read of a tensor the region wrote is free; a region's
write is paid only when something outside the region reads it later (the next matmul, the backward that saved it);
a write nobody reads again is never made. Every other memory-bound op pays its reads and writes as in eager. What
it gives: ``fused_bytes`` (the memory-bound bytes under compile) and ``kernels`` (the launches: each region one,
every other op one), in place of eager's bytes and ops. What it does not model: inductor's own recomputation
choices in backward (its min-cut partitioner), and so the activation memory a compiled step saves: the plan's
peak stays eager's (but the Llama 3 preset's compiled loss, traced as inductor holds it).

**Transcendental ops** (``transcendental_bytes``): eager's bytes of the memory-bound ops whose arithmetic is
transcendental, a division or a normalization (exp, GELU, SiLU, tanh, rsqrt, softmax, layer and RMS norms). A GPU
runs them at its memory bandwidth; a CPU's cores do not (GELU's backward at 6 GB/s where an add reaches 30, on this
project's machine), and a profile may time them at their own rate (``transcendental_bandwidth``).

**Attention** (``attention_flops``): the FLOPs of the fused attention kernels, which a profile may time at their
own fraction of the peak (``attention_achievable``: flash attention reaches less of it than a large matmul), and
the same FLOPs by shape (``attention_flops@SEQxHEAD``, :func:`vemesh.planning.speedups.attention_key`: the
geometric mean of the query and key lengths, and the head size), which a calibrated profile times at the rate
interpolated on the grid of shapes it measured (:meth:`vemesh.planning.profiles.DeviceProfile.attention_fraction`):
a CPU's flash attention reaches 0.04 of its matmul rate at head size 4 and 0.58 at (1024, 64). The backward's FLOPs
are counted by shape again apart (``attention_backward_flops@SEQxHEAD``), for a profile whose backward reaches less
than its forward (``attention_backward``).

**Float8: which matmuls.** ``linear_flops`` are the FLOPs of ``aten.mm``/``aten.addmm`` (``nn.Linear``'s three
matmuls a forward and backward: torchao's training recipe runs all three in float8), ``linear_elements`` the
elements of their two operands (each cast to float8 and scaled). Attention, batched matmuls and the rest stay in
the job's dtype.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.distributed._tools.fake_collectives import collective_ops
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.flop_counter import FlopCounterMode

from vemesh.planning.measure import FLOP_FORMULAS
from vemesh.planning.speedups import ATTENTION_IN, FLOPS_IN, attention_key
from vemesh.planning.step_tracker import answer_device, device_query
from vemesh.planning.storages import StorageTables, storage_key

__all__ = ["Fusion", "MemoryBoundBytes", "moves_data", "step_counters"]

_aten = torch.ops.aten
#: reductions inductor fuses with the pointwise ops around them (norms, softmax), and casts
_FUSIBLE = {_aten.sum, _aten.mean, _aten.amax, _aten.amin, _aten.var_mean, _aten._softmax, _aten._log_softmax,
            _aten._softmax_backward_data, _aten._log_softmax_backward_data, _aten._to_copy, _aten.copy_, _aten.clone}
_LINEAR = {_aten.mm, _aten.addmm}
#: attention's fused kernels as the planner traces them (CPU fake tensors), forward and backward
_ATTENTION_BACKWARD = _aten._scaled_dot_product_flash_attention_for_cpu_backward
_ATTENTION = {_aten._scaled_dot_product_flash_attention_for_cpu, _ATTENTION_BACKWARD}
#: ops that move no data: a query (``prim.device``), allocations (what an op writes later is its own), views that
#: torch does not tag as views, and detach
_NO_TRAFFIC = {torch.ops.prim.device, _aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided,
               _aten.empty_like, _aten._unsafe_view, _aten.detach, _aten.alias, _aten.lift_fresh}


#: memory-bound ops whose arithmetic is transcendental, a division or a normalization: on a GPU they run at the memory
#: bandwidth as an add does; on a CPU's cores they are slower per byte (a profile's ``transcendental_bandwidth``)
_TRANSCENDENTAL = {getattr(_aten, name) for name in (
    "exp", "log", "log1p", "erf", "sin", "cos", "tanh", "tanh_backward", "sigmoid", "sigmoid_backward", "gelu",
    "gelu_backward", "silu", "silu_backward", "rsqrt", "sqrt", "reciprocal", "div", "pow", "_softmax",
    "_softmax_backward_data", "_log_softmax", "_log_softmax_backward_data", "native_layer_norm",
    "native_layer_norm_backward", "_fused_rms_norm", "_fused_rms_norm_backward") if hasattr(_aten, name)}


#: ops that make a new storage and write nothing into it
_ALLOCATIONS = {_aten.empty, _aten.empty_strided, _aten.new_empty, _aten.new_empty_strided, _aten.empty_like}


def moves_data(func: Any) -> bool:
    """Whether ``func`` reads or writes tensor data (not a view, a query, an allocation or a profiler mark)."""
    return not func.is_view and func.overloadpacket not in _NO_TRAFFIC and func.namespace != "profiler"


def _fusible(func: Any) -> bool:
    name = func.overloadpacket.__name__
    if name.startswith(("_foreach", "_fused_")):
        return False
    return torch.Tag.pointwise in func.tags or func.overloadpacket in _FUSIBLE


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Fusion:
    """The compile and Float8 counts of one step's ops, fed in order by :class:`~vemesh.planning.fusion.MemoryBoundBytes`
    (see the module docstring)."""

    def __init__(self) -> None:
        self.region = 0
        self._open = False
        self._producer: dict[int, int] = {}  # storage -> the fusible region that wrote it last (-1: another op)
        self._pending: dict[int, int] = {}  # storage -> bytes a region wrote that nothing outside it has read yet
        #: a later storage at a dead one's address (the same key) starts with nothing written
        self._storages = StorageTables(self._producer, self._pending)
        self.fused_bytes = 0
        self.kernels = 0
        self.linear_flops = 0
        self.linear_elements = 0
        self.attention_flops = 0
        self.transcendental_bytes = 0
        #: attention's FLOPs by shape (:func:`~vemesh.planning.speedups.attention_key`)
        self.by_key: dict[str, int] = {}

    def counts(self) -> dict[str, int]:
        return {"fused_bytes": self.fused_bytes, "kernels": self.kernels, "linear_flops": self.linear_flops,
                "linear_elements": self.linear_elements, "attention_flops": self.attention_flops,
                "transcendental_bytes": self.transcendental_bytes, **self.by_key}

    def set_counts(self, counts: dict[str, int], *, add: bool = False) -> None:
        """Every count as ``counts`` has it (a replay's restore), or with ``counts`` added (``add``: a record's
        change); a count that ``counts`` lacks is 0, or unchanged when adding."""
        if not add:
            self.by_key.clear()
            for name in self.counts():
                setattr(self, name, 0)
        for name, value in counts.items():
            if "@" in name:
                self.by_key[name] = self.by_key.get(name, 0) + value
            else:
                setattr(self, name, getattr(self, name) + value)

    @property
    def is_open(self) -> bool:
        """Whether the last op was fusible (the next fusible op joins its region)."""
        return self._open

    @is_open.setter
    def is_open(self, value: bool) -> None:
        self._open = value

    def writer_of(self, t: torch.Tensor) -> tuple[int | None, int | None]:
        """(the region that last wrote ``t``'s storage, -1 for another op, None if none did; its bytes a region wrote
        that nothing outside it has read yet, or None)."""
        key = storage_key(t)
        return self._producer.get(key), self._pending.get(key)

    def wrote(self, t: torch.Tensor, region: int, pending: int | None) -> None:
        """Record ``t``'s storage as written by ``region`` (-1: another op), ``pending`` of its bytes not paid yet."""
        key = self._storages.watch(t)
        self._producer[key] = region
        if pending is not None:
            self._pending[key] = pending

    def ran(self, func: Any, out: Any, flops: int) -> None:
        """A matmul's or attention's FLOPs, counted by the dtype it ran in (its first output's)."""
        first = next((t for t in tree_leaves(out) if isinstance(t, torch.Tensor)), None)
        if first is None or not flops:
            return
        name = str(first.dtype).removeprefix("torch.")
        if name == "float32" and _tf32():  # on a GPU these run in TF32 (the trace's CPU has none)
            name = "tf32"
        for prefix in (FLOPS_IN, ATTENTION_IN) if func.overloadpacket in _ATTENTION else (FLOPS_IN,):
            self.by_key[prefix + name] = self.by_key.get(prefix + name, 0) + flops

    def _escape(self, key: int) -> None:
        self.fused_bytes += self._pending.pop(key, 0)

    def see(self, func: Any, args: Any, kwargs: Any, result: Any, *, matmul: bool, collective: bool) -> None:
        """One op (not on DTensors) after it ran."""
        if not moves_data(func):
            if func.overloadpacket in _ALLOCATIONS:  # a new storage, perhaps at a dead one's address: not its writes
                for t in tree_leaves(result):
                    if isinstance(t, torch.Tensor):
                        self._producer.pop(storage_key(t), None)
                        self._pending.pop(storage_key(t), None)
            return
        reads = [t for t in tree_leaves((args, kwargs or {})) if isinstance(t, torch.Tensor)]
        # an in-place op that returns nothing (foreach's, fused AdamW) writes what its schema marks
        writes = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)] or written(func, args, kwargs)
        if func.overloadpacket in _LINEAR:
            a, b = reads[-2], reads[-1]
            self.linear_flops += 2 * a.shape[0] * a.shape[1] * b.shape[1]
            self.linear_elements += a.numel() + b.numel()
        elif func.overloadpacket in _ATTENTION:  # timed at the profile's attention_achievable
            shapes = [x.shape if isinstance(x, torch.Tensor) else x for x in args]
            flops = FLOP_FORMULAS[func.overloadpacket](*shapes, **(kwargs or {}))
            q, k = args[1:3] if func.overloadpacket is _ATTENTION_BACKWARD else args[:2]  # backward: (grad, q, k, ...)
            key = attention_key(q.shape[-2], k.shape[-2], q.shape[-1])
            self.attention_flops += flops
            self.by_key[key] = self.by_key.get(key, 0) + flops
            if func.overloadpacket is _ATTENTION_BACKWARD:  # also apart: a backward runs at its own rate
                key = attention_key(q.shape[-2], k.shape[-2], q.shape[-1], backward=True)
                self.by_key[key] = self.by_key.get(key, 0) + flops
        elif func.overloadpacket in _TRANSCENDENTAL:  # eager's bytes of these ops, timed at their own rate
            self.transcendental_bytes += sum(_nbytes(t) for t in (*reads, *writes))
        if _fusible(func):
            if not self._open:
                self.region, self._open = self.region + 1, True
                self.kernels += 1
            for t in reads:
                key = storage_key(t)
                if self._producer.get(key) != self.region:
                    self._escape(key)
                    self.fused_bytes += _nbytes(t)
            for t in writes:
                key = self._storages.watch(t)
                self._producer[key] = self.region
                self._pending[key] = _nbytes(t)
            return
        self._open = False
        if not collective:
            self.kernels += 1
        for t in reads:
            self._escape(storage_key(t))
        if not matmul and not collective:
            self.fused_bytes += sum(_nbytes(t) for t in (*reads, *writes))
        for t in writes:
            key = self._storages.watch(t)
            self._producer[key] = -1
            self._pending.pop(key, None)


_QUERIES = {torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel,
            torch.ops.aten.sym_storage_offset, torch.ops.aten.is_contiguous, torch.ops.aten.dim}


#: the metadata queries torch's ``FlopCounterMode`` passes on untouched (its ``__torch_dispatch__``'s first test)
_FLOPS_PASS = {_aten.sym_is_contiguous.default, _aten.is_contiguous.default, _aten.is_contiguous.memory_format,
               _aten.is_strides_like_format.default, _aten.is_non_overlapping_and_dense.default, _aten.size.default,
               _aten.sym_size.default, _aten.stride.default, _aten.sym_stride.default, _aten.storage_offset.default,
               _aten.sym_storage_offset.default, _aten.numel.default, _aten.sym_numel.default, _aten.dim.default,
               torch.ops.prim.layout.default}


_DECOMPOSES: dict[Any, bool] = {}


def _decomposes(func: Any) -> bool:
    """Whether ``func.decompose`` would run a decomposition (a CompositeImplicitAutograd kernel), not return
    NotImplemented; cached by op."""
    known = _DECOMPOSES.get(func)
    if known is None:
        key = torch._C.DispatchKey.CompositeImplicitAutograd
        known = _DECOMPOSES[func] = key in func.py_kernels or torch._C._dispatch_has_kernel_for_dispatch_key(
            func.name(), key)
    return known


class MemoryBoundBytes(TorchDispatchMode):
    """The bytes the step's memory-bound ops move: every op but the matmuls (whose FLOPs it counts, by torch's
    ``FlopCounterMode`` formulas), the views, queries and allocations (which move nothing: :func:`moves_data`) and
    the collectives (which :class:`CollectiveBytes` counts) reads its tensor inputs and writes its outputs once.
    What a step-time prediction charges at the memory bandwidth; and the same ops under ``torch.compile``'s fusion
    and Float8 (:class:`Fusion`, :meth:`counts`).

    With ``flops`` it counts the FLOPs too, as torch's ``FlopCounterMode`` would beneath it (each op first offered
    to its decomposition, whose ops count FLOPs alone; ``flop_counts["Global"]`` by op; :meth:`get_total_flops`):
    one dispatch mode where two stood (``bench/plan_counters.py``). Without, it runs each op as given."""

    def __init__(self, flops: bool = False) -> None:
        super().__init__()
        self.count_flops = flops
        #: torch's FLOP formulas by op (the matmuls and attention: timed by their FLOPs, not their bytes)
        self.flop_registry = FlopCounterMode(custom_mapping=FLOP_FORMULAS).flop_registry
        self.flop_counts: dict[str, dict[Any, int]] = defaultdict(lambda: defaultdict(int))
        self.bytes = 0
        self.ops = 0  #: every op dispatched (each costs the framework's per-op time, whatever it computes)
        self.dtensor_ops = 0  #: the ops on DTensors (each also costs DTensor's sharding propagation)
        self.fusion = Fusion()
        self._decomposing = 0  #: inside an op's decomposition: its ops count FLOPs alone
        self._apart: Any = None  #: the fake mode in which decompositions run apart (:meth:`_decompose`)

    def counts(self) -> dict[str, int]:
        """What compile and Float8 change (:meth:`vemesh.planning.fusion.Fusion.counts`)."""
        return self.fusion.counts()

    def get_total_flops(self) -> int:
        """The step's FLOPs (``FlopCounterMode.get_total_flops``)."""
        return sum(self.flop_counts["Global"].values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if device_query(func, args):
            return answer_device(args[0])
        kwargs = kwargs or {}
        if self._decomposing or func.namespace == "prim" or func.overloadpacket in _QUERIES:
            # metadata that a plain tensor answers in C++ without a dispatch; a fake tensor dispatches it wherever
            # torch asks (its device in indexing, in autograd's engine: 60% of a GPT step's count), so no op of the step
            return self._flops(func, args, kwargs)
        if any(t is DTensor for t in types):
            self.dtensor_ops += 1
            return NotImplemented
        self.ops += 1
        result = self._flops(func, args, kwargs)
        packet, collective = func.overloadpacket, func in collective_ops
        matmul = packet in self.flop_registry
        if not matmul and moves_data(func) and not collective:
            reads = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            # an in-place op that returns nothing (foreach's, fused AdamW) writes what its schema marks
            writes = [t for t in tree_leaves(result) if isinstance(t, torch.Tensor)] or written(func, args, kwargs)
            self.bytes += sum(t.numel() * t.element_size() for t in (*reads, *writes))
        self.fusion.see(func, args, kwargs, result, matmul=matmul, collective=collective)
        return result

    def _flops(self, func, args, kwargs):  # type: ignore[no-untyped-def]
        """Run ``func``, counting its FLOPs as torch's ``FlopCounterMode`` does: its decomposition's, if it has one
        (:meth:`_decompose`), else its own."""
        if not self.count_flops:
            return func(*args, **kwargs)
        if func in _FLOPS_PASS:
            return NotImplemented
        if func is not torch.ops.prim.device.default and _decomposes(func):
            result = self._decompose(func, args, kwargs)
            if result is not NotImplemented:
                return result
        out = func(*args, **kwargs)
        formula = self.flop_registry.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            self.flop_counts["Global"][func._overloadpacket] += flops
            self.fusion.ran(func, out, flops)
        return out

    def _decompose(self, func, args, kwargs):  # type: ignore[no-untyped-def]
        """``func``'s result, the FLOPs of its decomposition counted; NotImplemented where it has none.

        The decomposition runs apart, on fake tensors of its arguments' shapes in a fake mode of its own, below none
        of the trace's modes (its fake world and memory tracker see none of it), and the op itself computes the
        result, as a GPU's kernel does: the decomposition's temporaries (``silu_backward``'s sigmoid and products,
        each of the MLP's hidden size) are not the step's, and a timed trace held them (``llama3:8b``, compiled loss:
        110 MiB over the untimed one). One that cannot run apart runs in place, as FlopCounterMode runs it."""
        if self._apart is None:
            from torch._subclasses.fake_tensor import FakeTensorMode

            self._apart = FakeTensorMode(allow_non_fake_inputs=True)

        def alike(t: Any) -> Any:
            return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=t.device) \
                if isinstance(t, torch.Tensor) else t

        before = {k: dict(v) for k, v in self.flop_counts.items()}, dict(self.fusion.by_key)
        self._decomposing += 1
        try:
            try:
                with _disable_current_modes(), self._apart:
                    apart = tree_map(alike, (args, kwargs))
                    with self:
                        ran = func.decompose(*apart[0], **apart[1])
            except Exception:  # noqa: BLE001 (whatever stopped it apart: what it counted is undone, and it runs here)
                self.flop_counts.clear()
                self.flop_counts.update({k: defaultdict(int, v) for k, v in before[0].items()})
                self.fusion.by_key = before[1]
                with self:
                    return func.decompose(*args, **kwargs)
        finally:
            self._decomposing -= 1
        return NotImplemented if ran is NotImplemented else func(*args, **kwargs)


def _tf32() -> bool:
    """Whether the job's code lets fp32 matmuls run in TF32 on a GPU (``torch.backends.cuda.matmul.fp32_precision =
    "tf32"``, its ``allow_tf32 = True``, ``torch.set_float32_matmul_precision("high")``: each sets that flag)."""
    try:
        return torch.backends.cuda.matmul.fp32_precision == "tf32"
    except (AttributeError, RuntimeError):  # a torch without the flag, or one that refuses to read it
        return False


def written(func: Any, args: tuple, kwargs: dict[str, Any] | None) -> list[torch.Tensor]:
    """The tensors ``func`` writes in place, as its schema marks them (``Tensor(a!)[] self``): what an op that returns
    nothing writes. torch's foreach ops (``_foreach_mul_(exp_avgs, beta1)``) and its fused AdamW (params, both moments)
    return nothing, and were counted as reading their tensors only: foreach AdamW's step at 14 of its 21 bytes per
    parameter byte, fused AdamW's at 4 of 7."""
    out: list[torch.Tensor] = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is not None and arg.alias_info.is_write:
            value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
            if arg.name == "grads" and (kwargs or {}).get("grad_scale") is None:
                continue  # fused Adam's schema lets it unscale the gradients in place; without a scale it reads them
            out += [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
    return out


@contextmanager
def step_counters(timed: bool) -> Iterator[tuple[Any, Any]]:
    """``(flops, moved)``: one :class:`MemoryBoundBytes` (it counts the FLOPs too) over a step a step-time
    prediction will time (``timed``); counters of nothing otherwise (an untimed trace runs faster)."""
    if not timed:
        yield _Nothing(), _Nothing()
        return
    with MemoryBoundBytes(flops=True) as moved:
        yield moved, moved


class _Nothing:
    """What an untimed trace counts: nothing."""

    bytes = ops = dtensor_ops = 0

    def counts(self) -> dict[str, int]:
        return {}

    def get_total_flops(self) -> int:
        return 0
