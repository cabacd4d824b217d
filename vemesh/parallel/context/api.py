"""``context_parallel``: torch's context manager, for any model that calls SDPA, on vemesh's ring.

Inside ``with context_parallel(cp_mesh, buffers=[x, y, rope_cos], buffer_seq_dims=[1, 1, 0]):``

* every buffer is cut in place along its sequence dim to this CP rank's part, the same way for all of them
  (head-tail with ``load_balance``: CP rank ``r`` of ``cp`` keeps chunks ``r`` and ``2 cp - 1 - r`` of ``2 cp``),
  so a ``[B, T]`` token batch and a ``[T, d]`` RoPE table stay aligned; they are put back on exit, except
  ``no_restore_buffers``;
* the model's own ``F.scaled_dot_product_attention(q, k, v, is_causal=True)`` computes this rank's rows of
  causal attention over the whole sequence (with ``is_causal=False``, of an encoder's attention over every
  position): a ring over the CP group (:func:`~vemesh.parallel.context.ring_attention`,
  torch's kernels), forward and backward, with no change to the model. ``F``'s attribute is swapped for the
  context (so a checkpoint's recompute in backward finds it too), and a torch function mode catches SDPA
  called under a name bound before the context.

What cannot be exact is refused, naming the value: an ``attn_mask`` (the ring applies none but the causal one),
attention dropout, keys of another length than the queries, buffers
of different lengths, a length CP does not divide, a query whose length is not the buffers' share, and attention
the model computes itself (a softmax over a ``(batch, heads, t, t)`` score matrix of this rank's ``t`` positions:
Hugging Face's eager attention; ``nn.MultiheadAttention`` with ``need_weights=True``), which the ring never sees, and a calling attention's sliding window shorter than
the sequence (Hugging Face's ``sliding_window``), which the ring does not apply, and a buffer shifted by a position
inside the context (``y[:, 1:]``, ``F.pad``, Hugging Face's ``labels=``), which pairs tokens of other parts. Load
balancing is exact wherever it is allowed (the ring knows which chunks each rank holds); it is on by default.

Run the backward inside the context too (torch asks the same): activation checkpointing recomputes SDPA
there, and outside the context that recompute would be local attention. A context left with such a
recompute still to come raises ``RuntimeError`` at its exit instead.

A vemesh ``DistributedDataParallel`` never broadcasts a buffer while a context holds it sharded: each CP rank's
shard is its own (torch's ``broadcast_buffers`` would copy CP rank 0's shard over the others').
"""

from __future__ import annotations

import contextlib
import functools
import gc
import sys
import threading
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from vemesh.parallel.context.ring import ROTATE_METHODS, check_sequence_split, positions, ring_attention, shard_sequence
from vemesh.mesh.views import check_view

__all__ = ["context_parallel", "current_positions", "sharded_buffers"]

_SDPA = (torch._C._nn.scaled_dot_product_attention,)
_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_STATE = threading.local()


def current_positions(length: int, device: torch.device | str | None = None) -> torch.Tensor | None:
    """The global positions of this CP rank's ``length`` tokens inside an active :func:`context_parallel` (its
    buffers' sequence cut as it cuts them), or None outside one (or in one of a single CP rank). A model that numbers
    its positions from 0 would number a rank's share from 0: ask here instead. ``ValueError`` when ``length`` is not
    this rank's share of the buffers' sequence."""
    active = getattr(_STATE, "active", [])
    if not active:
        return None
    ctx = active[-1]
    cp = ctx.cp_mesh.size()
    if ctx.seq_len is None or length * cp != ctx.seq_len:
        raise ValueError(f"inside context_parallel, {length} positions are not this CP rank's share of the buffers' "
                         f"sequence ({ctx.seq_len}, over CP {cp}): pass every tensor that carries the sequence in "
                         "buffers=")
    return positions(ctx.seq_len, ctx.cp_mesh.get_local_rank(), cp, load_balance=ctx.load_balance, device=device)


def sharded_buffers() -> set[int]:
    """The ``id`` of every tensor an active :func:`context_parallel` holds sharded (DDP leaves them alone)."""
    return {i for ctx in getattr(_STATE, "active", []) for i in ctx.buffer_ids}


class _Context:
    """One active ``context_parallel``: its mesh, options, sharded buffers and ring calls still owed a backward."""

    def __init__(self, cp_mesh: DeviceMesh, load_balance: bool, rotate: str, seq_len: int | None,
                 buffer_dims: dict[int, int]) -> None:
        self.cp_mesh, self.load_balance, self.rotate = cp_mesh, load_balance, rotate
        #: the ``id`` of each buffer held cut, and its sequence dim
        self.seq_len, self.buffer_dims, self.buffer_ids = seq_len, buffer_dims, set(buffer_dims)
        self.pending = 0  # ring calls whose backward has not run
        #: of those, the calls under activation checkpointing (saved tensors hooked), each a weak reference to a
        #: token its autograd node holds: a call whose graph is gone (a forward that torch's pipeline stage runs only
        #: to infer shapes, then drops) owes no backward
        self.checkpointed: list[weakref.ref] = []

    def owed(self) -> int:
        """The calls under activation checkpointing whose graph can still run backward and has not."""
        def count() -> int:
            return sum(1 for ref in self.checkpointed if (token := ref()) is not None and not token.done)

        owed = count()
        if owed:  # a graph in a reference cycle is gone only once collected
            gc.collect()
            owed = count()
        return owed


class _Owed:
    """What a ring call's autograd node holds while its backward is owed."""

    done = False


def _ring(ctx: _Context, given: dict[str, Any]) -> torch.Tensor:
    """One SDPA call of the model, as this rank's rows of its attention (causal or not) over the CP ring."""
    q, k, v = given["query"], given["key"], given["value"]
    _refuse(given, q, k, ctx)
    if given.get("enable_gqa") and k.size(-3) != q.size(-3):  # grouped-query attention: each KV head serves a group
        k = k.repeat_interleave(q.size(-3) // k.size(-3), dim=-3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), dim=-3)
    out = ring_attention(q, k, v, ctx.cp_mesh, load_balance=ctx.load_balance, scale=given.get("scale"),
                         rotate=ctx.rotate, causal=bool(given.get("is_causal", False)))
    if out.requires_grad and torch._C._current_graph_task_id() == -1:  # not a checkpoint's recompute in backward:
        # count the backward still owed, and whether a checkpoint will recompute this call
        token = _Owed()
        if _checkpointing() and out.grad_fn is not None:
            out.grad_fn.metadata["vemesh_cp_owed"] = token  # lives as long as the graph that can still run backward
            ctx.checkpointed.append(weakref.ref(token))
        ctx.pending += 1
        out.register_hook(functools.partial(_owed, ctx, token))
    return out


_ring_sdpa: Any = None  #: :func:`_ring` as the model's SDPA calls it, set by :func:`_eager_ring`


def _eager_ring() -> None:
    """Sets :data:`_ring_sdpa`: a compiled model runs the ring eagerly. Dynamo cannot trace torch's templated ring (it
    fails inside, with or without fullgraph), so each attention is a graph break, which ``fullgraph=True`` refuses
    with this reason. Made when a context first opens: importing ``torch._dynamo`` costs about a second, which every
    process that imports ``vemesh.parallel`` would pay (each rank of a job without CP)."""
    global _ring_sdpa
    if _ring_sdpa is None:
        from torch._dynamo import disable

        _ring_sdpa = disable(_ring, recursive=True, reason="vemesh's context_parallel runs its ring eagerly: under "
                             "CP, compile without fullgraph=True (a graph break at each attention)")


def _checkpointing() -> bool:
    """Whether saved tensors are hooked here: activation checkpointing will recompute this forward in backward."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _patched_sdpa(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attn_mask: Any = None,
                  dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                  enable_gqa: bool = False) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` while a context is active: forward, and a checkpoint's recompute in backward."""
    given = dict(query=query, key=key, value=value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                 scale=scale, enable_gqa=enable_gqa)
    return _ring_sdpa(_STATE.active[-1], given)


class _RingSDPA(TorchFunctionMode):
    """Catches SDPA called under a name bound before the context (``from torch.nn.functional import ...``)."""

    def __init__(self, context: _Context) -> None:
        super().__init__()
        self.context = context

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        refuse = _REFUSE.get(func)  # every op of the model passes here: one lookup
        if refuse is not None:
            refuse(self.context, func, args, kwargs or {})
        if func not in _SDPA:
            return func(*args, **(kwargs or {}))
        if _checkpointing():  # its recompute in backward would not pass through here, nor through F's attribute
            raise ValueError(
                "scaled_dot_product_attention was called under activation checkpointing through a name bound before "
                "context_parallel (from torch.nn.functional import ...): its recompute in backward would be local "
                "attention. Call it as torch.nn.functional.scaled_dot_product_attention"
            )
        return _ring_sdpa(self.context, dict(zip(_PARAMS, args)) | (kwargs or {}))


def _refuse_weights(ctx: _Context, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """``ValueError`` for ``nn.MultiheadAttention`` asked for its weights: it then computes its attention itself."""
    if kwargs.get("need_weights", args[15] if len(args) > 15 else True):
        raise ValueError(
            "nn.MultiheadAttention with need_weights=True (its default) inside context_parallel: it computes its "
            "attention itself to return the weights, over this CP rank's share of the sequence only, and would train "
            "on that. Call it with need_weights=False (and is_causal=True with the causal mask), so that it runs "
            "SDPA, which the ring computes"
        )


def _refuse_shift(ctx: _Context, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """``ValueError`` for a buffer the context holds cut, padded or sliced along its sequence dim: a shift by a
    position (Hugging Face's ``labels=``, which pads and shifts inside the model's loss; ``y[:, 1:]``). A rank's
    share of the sequence is not contiguous under load balancing, nor at its edge, so a shift pairs tokens of other
    chunks and drops one a chunk, and the loss is a little off, and trains."""
    if not args or id(args[0]) not in ctx.buffer_dims:
        return
    x, dim = args[0], ctx.buffer_dims[id(args[0])]
    if func is F.pad:
        pad = args[1] if len(args) > 1 else kwargs.get("pad", ())
        k = x.dim() - 1 - dim  # F.pad's pairs run from the last dim
        if not any(pad[2 * k:2 * k + 2]):
            return
        what = f"F.pad(..., {tuple(pad)})"
    else:
        index = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(i is None or isinstance(i, (bool, torch.Tensor)) for i in index) or index.count(Ellipsis) > 1:
            return
        if Ellipsis in index:
            at = index.index(Ellipsis)
            index = index[:at] + (slice(None),) * (x.dim() - len(index) + 1) + index[at + 1:]
        cut = index[dim] if dim < len(index) else slice(None)
        if not isinstance(cut, slice) or range(*cut.indices(x.size(dim))) == range(x.size(dim)):
            return
        what = "a slice [" + ":".join("" if v is None else str(v) for v in (cut.start, cut.stop)) + "]"
    raise ValueError(
        f"{what} of a buffer context_parallel holds cut, along its sequence dim {dim}: a shift by a position inside "
        "the context pairs tokens of other parts of the sequence (a rank's share is not contiguous), and drops one a "
        "part. Shift before the context and pass both as buffers (x, y = tokens[:, :-1], tokens[:, 1:]); with "
        "Hugging Face, compute the loss from the logits and y, not with labels= (it shifts inside)"
    )


def _refuse_local_attention(ctx: _Context, func: Any, args: tuple, kwargs: dict[str, Any]) -> None:
    """``ValueError`` for a softmax over a square score matrix of this CP rank's positions, per sequence and head
    (``(batch, heads, t, t)``): attention computed by the model itself (Hugging Face's ``attn_implementation="eager"``,
    nanoGPT's manual path), which the ring never sees, so that each rank would attend only to its own share of the
    sequence, and train. A MoE router's ``(tokens, experts)`` or ``(batch, t, experts)`` is not taken for one, even
    with as many experts as positions."""
    x = args[0] if args else kwargs.get("input")
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if ctx.seq_len is None or not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() < 4:
        return
    local = ctx.seq_len // ctx.cp_mesh.size()
    if x.size(-1) == x.size(-2) == local and dim % x.dim() >= x.dim() - 2:
        raise ValueError(
            f"a softmax over a {local} x {local} score matrix inside context_parallel: attention computed by the "
            f"model itself, not by torch.nn.functional.scaled_dot_product_attention, sees only this CP rank's {local} "
            f"of the {ctx.seq_len} positions (the ring runs SDPA's calls alone), and would train on that. Use SDPA "
            "(Hugging Face: attn_implementation=\"sdpa\", not \"eager\")"
        )


#: what each torch function that can compute wrong under CP is checked by, inside the context: the softmaxes a model's
#: own attention calls (Hugging Face's eager attention calls ``F.softmax``), ``nn.MultiheadAttention``'s forward, and
#: how a sequence is shifted by a position (HF's ``labels=`` pads it, ``x[:, 1:]`` slices it)
_REFUSE = {**dict.fromkeys((F.softmax, torch.softmax, torch._C.TensorBase.softmax, torch.special.softmax),
                           _refuse_local_attention),
           F.multi_head_attention_forward: _refuse_weights, F.pad: _refuse_shift, torch.Tensor.__getitem__: _refuse_shift}


def _owed(ctx: _Context, token: _Owed, grad: torch.Tensor) -> torch.Tensor:
    """A ring call's backward has come: it is no longer owed."""
    ctx.pending -= 1
    token.done = True
    return grad


def _refuse(given: dict[str, Any], q: torch.Tensor, k: torch.Tensor, ctx: _Context) -> None:
    """``ValueError`` for an SDPA call the ring would not compute exactly."""
    where = "F.scaled_dot_product_attention inside context_parallel"
    if given.get("attn_mask") is not None:
        raise ValueError(f"{where}: an attn_mask is refused (the ring applies no mask but the causal one, so it "
                         "cannot leave out padding: under CP give batches without pad tokens); pass no mask, with "
                         "is_causal=True for a decoder's attention (Hugging Face makes one where "
                         "a rank's position_ids jump, as load balancing cuts them, taking them for packed sequences: "
                         "give the model attention_mask=torch.ones_like(input_ids) with them)")
    if given.get("dropout_p", 0.0):
        raise ValueError(f"{where}: dropout_p={given['dropout_p']} is refused (the ring has no attention dropout); "
                         "pass dropout_p=0.0")
    if k.size(-2) != q.size(-2):
        raise ValueError(f"{where}: keys of {k.size(-2)} positions for queries of {q.size(-2)} (a KV cache, or cross "
                         "attention) are refused: the ring needs self-attention over the sharded sequence")
    cp = ctx.cp_mesh.size()
    window = _sliding_window()
    if window is not None and q.size(-2) * cp > window:
        raise ValueError(
            f"{where}: the calling attention has a sliding window of {window} positions (Hugging Face's "
            f"sliding_window), and the sequence holds {q.size(-2) * cp}: the ring computes causal attention over the "
            "whole sequence, with no window (HF leaves its window's mask out where a CP rank's share fits in it). "
            "Use CP where the sequence fits in the window, or a model without one"
        )
    if ctx.seq_len is not None and q.size(-2) * cp != ctx.seq_len:
        raise ValueError(
            f"{where}: the queries hold {q.size(-2)} positions, but this CP rank's share of the buffers' "
            f"{ctx.seq_len} is {ctx.seq_len // cp}: pass every tensor that carries the sequence (tokens, positions, "
            "RoPE tables) in buffers="
        )


def _sliding_window(depth: int = 8) -> int | None:
    """The sliding window of the attention that called SDPA, where Hugging Face's attention gives one: its
    ``sdpa_attention_forward`` takes it as ``sliding_window`` among its keyword arguments (Mistral, Qwen2 and
    others), and some attention modules hold it as ``self.sliding_window`` (None on a layer of full attention).
    Read from the calling frames, outside this module, as SDPA is not given it."""
    frame = sys._getframe(1)
    for _ in range(depth):
        frame = frame.f_back
        if frame is None:
            return None
        if frame.f_globals.get("__name__") == __name__:
            continue
        names = frame.f_locals
        kwargs, owner = names.get("kwargs"), names.get("self", names.get("module"))
        window = kwargs.get("sliding_window") if isinstance(kwargs, dict) else None
        if window is None and isinstance(owner, torch.nn.Module):
            window = getattr(owner, "sliding_window", None)
        if isinstance(window, int) and not isinstance(window, bool) and window > 0:
            return window
    return None


def _check_arguments(cp_mesh: Any, buffers: Sequence[torch.Tensor], dims: Sequence[int],
                     no_restore: Any, load_balance: bool, rotate: str) -> int | None:
    """Validate everything before anything is changed; the buffers' common sequence length (None without any)."""
    if not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1:
        raise TypeError(f"cp_mesh must be a 1-D DeviceMesh such as VESCALE_DEVICE_MESH['CP']; got {cp_mesh!r:.100}")
    check_view(cp_mesh, "cp_mesh")
    if not isinstance(load_balance, bool):
        raise TypeError(f"load_balance must be True or False; got {load_balance!r}")
    if rotate not in ROTATE_METHODS:
        raise ValueError(f"unknown rotate method {rotate!r}; choose from {list(ROTATE_METHODS)}")
    if len(buffers) != len(dims):
        raise ValueError(f"buffer_seq_dims must give one sequence dim per buffer: {len(buffers)} buffers, "
                         f"{len(dims)} dims")
    for i, b in enumerate(buffers):
        if not isinstance(b, torch.Tensor):
            raise TypeError(f"buffers[{i}] must be a tensor; got {type(b).__name__}")
        if isinstance(b, torch.nn.Parameter):
            raise ValueError(f"buffers[{i}] is a Parameter; shard inputs and buffers, never weights")
    for n in no_restore:
        if not any(n is b for b in buffers):
            raise ValueError("no_restore_buffers must be a subset of buffers (the same tensor objects)")
    lengths = [b.size(d) for b, d in zip(buffers, dims)]
    if len(set(lengths)) > 1:
        raise ValueError(f"the buffers' sequence lengths differ ({lengths} along buffer_seq_dims {list(dims)}): every "
                         "buffer is cut the same way, so a longer table (RoPE for the longest sequence) must be sliced "
                         "to this batch's length first")
    if lengths and cp_mesh.size() > 1:
        check_sequence_split(lengths[0], cp_mesh.size(), load_balance)
    return lengths[0] if lengths else None


@contextlib.contextmanager
def context_parallel(
    cp_mesh: DeviceMesh,
    *,
    buffers: Sequence[torch.Tensor] | None = None,
    buffer_seq_dims: Sequence[int] | None = None,
    no_restore_buffers: set[torch.Tensor] | None = None,
    load_balance: bool = True,
    rotate: str = "alltoall",
) -> Iterator[None]:
    """Context parallelism over ``cp_mesh`` for the SDPA calls and ``buffers`` inside the block (see the module).

    Args:
        cp_mesh: the 1-D CP mesh, ``VESCALE_DEVICE_MESH["CP"]``.
        buffers: tensors that carry the sequence (tokens, labels, positions, RoPE tables), cut in place.
        buffer_seq_dims: the sequence dim of each buffer.
        no_restore_buffers: buffers left as their shard on exit.
        load_balance: head-tail sharding (exact; evens out causal attention's work over the ring).
        rotate: how keys and values travel, ``"alltoall"`` (a ring) or ``"allgather"``.

    On CP = 2 with ``buffers=[x]`` of ``x.shape == (B, 8)`` and load balancing, rank 0 holds positions
    ``0, 1, 6, 7`` and rank 1 ``2, 3, 4, 5`` inside the block; the model's causal SDPA on rank 1 returns rows
    2..5 of attention over all 8 positions. On a CP mesh of one rank (a job's CP dim of size 1) the block runs as
    it is: nothing is cut, and the model's SDPA is its own.
    """
    buffers = list(buffers or [])
    dims = list(buffer_seq_dims or [])
    no_restore = set(no_restore_buffers or ())
    seq_len = _check_arguments(cp_mesh, buffers, dims, no_restore, load_balance, rotate)
    rank, size = cp_mesh.get_local_rank(), cp_mesh.size()
    if size == 1:  # one CP rank holds the whole sequence: nothing to cut, and the model's own SDPA is already exact
        yield
        return
    kept = [None if any(b is n for n in no_restore) else b.clone() for b in buffers]
    with torch.no_grad():
        for b, d in zip(buffers, dims):
            shard = shard_sequence(b, rank, size, dim=d, load_balance=load_balance).clone()
            b.resize_(shard.shape)
            b.copy_(shard)
    context = _Context(cp_mesh, load_balance, rotate, seq_len, {id(b): d % b.dim() for b, d in zip(buffers, dims)})
    _eager_ring()
    _STATE.active = [*getattr(_STATE, "active", []), context]
    original, F.scaled_dot_product_attention = F.scaled_dot_product_attention, _patched_sdpa
    try:
        with _RingSDPA(context):
            yield
    finally:
        F.scaled_dot_product_attention = original
        _STATE.active = [c for c in _STATE.active if c is not context]
        with torch.no_grad():
            for b, old in zip(buffers, kept):
                if old is not None:
                    b.resize_(old.shape)
                    b.copy_(old)
    owed = context.owed()
    if owed:
        raise RuntimeError(
            f"context_parallel exited with {owed} ring attention call(s) under activation checkpointing "
            "still to go backward: the recompute would run SDPA outside the ring. Call loss.backward() inside the "
            "context"
        )
