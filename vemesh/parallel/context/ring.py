"""Context parallelism: ring attention over a CP group, on torch's own engine.

Each of the ``cp`` ranks of a CP group holds ``1/cp`` of every sequence (its queries,
keys and values); :func:`ring_attention` returns this rank's rows of the full attention,
causal (a decoder's) or not (an encoder's: BERT, ViT), and its backward the matching
gradients, while keys and values travel round the group. The arithmetic is torch's:

* on CUDA, torch's ring flash attention (``_scaled_dot_product_ring_flash_attention``
  and its backward: what ``torch.distributed.tensor.experimental.context_parallel``
  dispatches SDPA to);
* on the CPU, where torch 2.13 routes no SDPA op through context parallelism, torch's
  templated ring attention (``_templated_ring_attention`` and its backward) around the
  CPU flash-attention op.

Both are private torch API. They are reached only here, and :func:`check_torch_api`
(run on first use, and by the tests) fails loudly, naming what moved, if a torch
release renames them.

*Load balancing* (torch's head-tail sharding): causal attention gives the last rank of
the ring the most work. With ``load_balance=True`` the sequence is cut into ``2 * cp``
chunks and rank ``r`` holds chunks ``r`` and ``2 * cp - 1 - r``; :func:`shard_sequence`
and :func:`positions` cut batches and position indices that way. On ``cp = 2`` and a
sequence of 8 tokens, rank 0 holds tokens ``0, 1, 6, 7`` and rank 1 tokens ``2, 3, 4, 5``.
Results are the same either way (up to float rounding). Attention that is not causal
needs no balancing (every query reads every key) and no order of the chunks: torch's ring
refuses load balancing there, and it is off for that call, however the sequence was cut.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from vemesh.layout.names import divisors, listed

__all__ = ["check_sequence_split", "check_torch_api", "positions", "ring_attention", "shard_sequence"]

_NAMES = (
    "_cp_options",
    "_RotateMethod",
    "_templated_ring_attention",
    "_templated_ring_attention_backward",
    "_scaled_dot_product_ring_flash_attention",
    "_scaled_dot_product_ring_flash_attention_backward",
)
_API: dict[str, object] = {}


def check_torch_api() -> dict[str, object]:
    """torch's private ring-attention functions, checked; ``RuntimeError`` naming what moved if they did."""
    if _API:
        return _API
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention as module
    except ImportError as e:
        raise RuntimeError(
            f"vemesh context parallelism needs torch.distributed.tensor.experimental._context_parallel._attention, which torch "
            f"{torch.__version__} does not have ({e}); vemesh is tested with torch 2.13"
        ) from None
    missing = [n for n in _NAMES if not hasattr(module, n)]
    if not missing:
        options = module._cp_options
        missing += [f"_cp_options.{a}" for a in ("enable_load_balance", "rotate_method") if not hasattr(options, a)]
        missing += [f"_RotateMethod.{m}" for m in ROTATE_METHODS.values() if not hasattr(module._RotateMethod, m)]
        wanted = {"group", "seq_dim", "op", "query", "key", "value", "is_causal"}
        params = set(inspect.signature(module._templated_ring_attention).parameters)
        if not wanted <= params:
            missing.append(f"_templated_ring_attention({', '.join(sorted(wanted - params))})")
    if missing:
        raise RuntimeError(
            f"torch {torch.__version__} moved the private ring-attention API vemesh's context parallelism uses: "
            f"{missing} not found in torch.distributed.tensor.experimental._context_parallel._attention; vemesh is tested with torch 2.13"
        )
    _API.update({n: getattr(module, n) for n in _NAMES})
    return _API


#: How keys and values travel: "alltoall" passes one block to the next rank per step (a true ring: one
#: extra block in memory); "allgather" gathers every block at once (fewer, larger messages; torch's default).
ROTATE_METHODS = {"alltoall": "ALL_TO_ALL", "allgather": "ALL_GATHER"}


@contextlib.contextmanager
def _options(load_balance: bool, rotate: str) -> Iterator[None]:
    """torch keeps its CP switches in a module global: set them for one call, then put them back."""
    api = check_torch_api()
    options = api["_cp_options"]
    before = options.enable_load_balance, options.rotate_method  # type: ignore[attr-defined]
    options.enable_load_balance = load_balance  # type: ignore[attr-defined]
    options.rotate_method = getattr(api["_RotateMethod"], ROTATE_METHODS[rotate])  # type: ignore[attr-defined]
    try:
        yield
    finally:
        options.enable_load_balance, options.rotate_method = before  # type: ignore[attr-defined]


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, cp_mesh, load_balance, scale, rotate, causal):  # type: ignore[override]
        api = check_torch_api()
        with _options(load_balance and causal, rotate):
            if q.device.type == "cuda":
                outs = api["_scaled_dot_product_ring_flash_attention"](cp_mesh, q, k, v, 0.0, causal, scale=scale)
                out, rest = outs[0], outs[1:]
            else:
                out, lse = api["_templated_ring_attention"](
                    cp_mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu,
                    query=q, key=k, value=v, is_causal=causal, dropout_p=0.0, scale=scale,
                )[:2]
                rest = (lse,)
        # The flash op's outputs after ``out``, in order: tensors (None where the op leaves one undefined,
        # as cum_seq_q/k for dense inputs) are saved in their order, the ints (max_q, max_k) kept aside.
        ctx.save_for_backward(q, k, v, out, *(r for r in rest if r is None or isinstance(r, torch.Tensor)))
        ctx.extra = [r for r in rest if not (r is None or isinstance(r, torch.Tensor))]
        ctx.cp_mesh, ctx.load_balance, ctx.scale, ctx.rotate, ctx.causal = cp_mesh, load_balance, scale, rotate, causal
        return out

    @staticmethod
    def backward(ctx, dout):  # type: ignore[override]
        api = check_torch_api()
        q, k, v, out, *saved = ctx.saved_tensors
        dout = dout.contiguous()
        with _options(ctx.load_balance and ctx.causal, ctx.rotate):
            if q.device.type == "cuda":
                lse, cum_q, cum_k, philox_seed, philox_offset = saved[0], saved[1], saved[2], saved[3], saved[4]
                max_q, max_k = ctx.extra[0], ctx.extra[1]
                grads = api["_scaled_dot_product_ring_flash_attention_backward"](
                    ctx.cp_mesh, dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, ctx.causal,
                    philox_seed, philox_offset, scale=ctx.scale,
                )
            else:
                grads = api["_templated_ring_attention_backward"](
                    ctx.cp_mesh.get_group(), 2, torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward,
                    grad_out=dout, grad_out_name="grad_out", query=q, key=k, value=v, out=out, logsumexp=saved[0],
                    is_causal=ctx.causal, dropout_p=0.0, scale=ctx.scale,
                )
        return grads[0], grads[1], grads[2], None, None, None, None, None


def ring_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp_mesh: DeviceMesh, *, load_balance: bool = False,
    scale: float | None = None, rotate: str = "alltoall", causal: bool = True,
) -> torch.Tensor:
    """Attention over the sequence shared by ``cp_mesh``'s ranks, causal unless ``causal=False``: this rank's rows of
    it.

    Args:
        q, k, v: ``(B, H, T_local, head_dim)``, this rank's part of the sequence as
            :func:`shard_sequence` cuts it (contiguous, or head-tail with ``load_balance``).
        cp_mesh: the 1-D CP mesh, e.g. ``VESCALE_DEVICE_MESH["CP"]``.
        load_balance: whether the sequence was cut head-tail.
        scale: softmax scale (default ``1 / sqrt(head_dim)``).
        rotate: ``"alltoall"`` (a true ring: each rank holds one extra key/value block, so attention
            memory is about ``1/cp``) or ``"allgather"`` (torch's default: every block gathered at once).
        causal: each position attends to those up to it (a decoder's), or, with False, to every position (an
            encoder's); either way with no mask.

    Returns:
        ``(B, H, T_local, head_dim)``: what ``F.scaled_dot_product_attention(..., is_causal=causal)``
        of the whole sequence gives at this rank's positions. On 2 CP ranks with 8 tokens,
        rank 1 (tokens 4..7) gets rows 4..7 of the full result.
    """
    if not isinstance(cp_mesh, DeviceMesh) or cp_mesh.ndim != 1:
        raise TypeError(f"cp_mesh must be a 1-D DeviceMesh such as VESCALE_DEVICE_MESH['CP']; got {cp_mesh!r}")
    if rotate not in ROTATE_METHODS:
        raise ValueError(f"unknown rotate method {rotate!r}; choose from {list(ROTATE_METHODS)}")
    if cp_mesh.size() == 1:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    if rotate == "allgather" and q.device.type == "cuda" and "gloo" in str(dist.get_backend(cp_mesh.get_group())):
        # Seen on an H100 with torch 2.11: the gathered rotation of CUDA tensors over gloo kills the process (SIGSEGV).
        raise ValueError("rotate='allgather' with CUDA tensors needs an nccl CP group (over gloo it crashes the "
                         "process); use rotate='alltoall', or build the mesh on 'cuda'")
    return _RingAttention.apply(q, k, v, cp_mesh, load_balance, scale, rotate, causal)


def _chunks(cp_rank: int, cp_size: int, load_balance: bool) -> tuple[int, tuple[int, ...]]:
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank {cp_rank} is out of range for cp_size {cp_size}; valid: 0..{cp_size - 1}")
    if load_balance:
        return 2 * cp_size, (cp_rank, 2 * cp_size - 1 - cp_rank)
    return cp_size, (cp_rank,)


def check_sequence_split(length: int, cp_size: int, load_balance: bool, what: str | None = None) -> int:
    """The number of equal chunks CP cuts a sequence of ``length`` into (``cp_size``, or ``2 * cp_size`` with
    ``load_balance``); ``ValueError`` when it does not divide, naming the multiple to choose and the CP sizes that fit
    (``what`` names the length in the caller's words, ``seq_len 12``; by default ``a sequence of 12 positions``).

    The one rule for every place that cuts or plans a sequence over CP: :func:`shard_sequence`,
    :func:`~vemesh.parallel.context.context_parallel`, and the planner's check of a preset's ``seq_len``.
    """
    per = 2 if load_balance else 1
    chunks = cp_size * per
    if length % chunks:
        fits = divisors(length // per) if length % per == 0 and length >= per else []
        how = ", head-tail load balancing: 2 per rank" if load_balance else ""
        cp = f", or CP from {listed(fits)}" if fits else " (no CP splits an odd length into head-tail chunks)"
        raise ValueError(f"{what or f'a sequence of {length} positions'} does not split into {chunks} equal chunks "
                         f"(CP {cp_size}{how}); choose a sequence length that is a multiple of {chunks}{cp}")
    return chunks


def shard_sequence(x: torch.Tensor, cp_rank: int, cp_size: int, *, dim: int = 1, load_balance: bool = False) -> torch.Tensor:
    """This CP rank's part of ``x`` along the sequence ``dim``: one contiguous ``1/cp``, or two head-tail chunks.

    The length must divide by ``cp_size`` (``2 * cp_size`` with ``load_balance``): ``ValueError`` otherwise.
    """
    n, mine = _chunks(cp_rank, cp_size, load_balance)
    check_sequence_split(x.size(dim), cp_size, load_balance)
    pieces = x.chunk(n, dim=dim)
    return torch.cat([pieces[i] for i in mine], dim=dim) if len(mine) > 1 else pieces[mine[0]].contiguous()


def positions(seq_len: int, cp_rank: int, cp_size: int, *, load_balance: bool = False,
              device: torch.device | str | None = None) -> torch.Tensor:
    """The global positions of this CP rank's tokens, in the order :func:`shard_sequence` keeps them.

    ``positions(8, 1, 2)`` is ``[4, 5, 6, 7]``; with ``load_balance=True`` it is ``[2, 3, 4, 5]``.
    """
    return shard_sequence(torch.arange(seq_len, device=device), cp_rank, cp_size, dim=0, load_balance=load_balance)
