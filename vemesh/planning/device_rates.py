"""What ``vemesh calibrate`` times on each device alone (every rank at once, as a job shares the machine): the
memory-bound ops' rates and the framework's time per op. :mod:`vemesh.planning.calibrate` runs them."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
import torch.distributed as dist

from vemesh.planning.fusion import MemoryBoundBytes

__all__ = ["attention_grid", "attention_rates", "median_seconds", "memory_rates", "op_overheads"]


def attention_grid(device: torch.device) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The shapes ``vemesh calibrate`` times attention at: ``(sequence lengths, head sizes)``, every pair. A CPU's
    rate moves with both (0.04 of its matmul rate at head size 4, 0.58 at (1024, 64) on this project's machine); a
    GPU's flash kernels are timed at the head sizes models use, on the sequences they train."""
    if device.type == "cuda":
        return (512, 2048, 8192), (64, 128)
    return (64, 256, 1024), (4, 16, 64, 128)


def attention_heads(device_type: str, seq: int, head: int, quick: bool = False) -> int:
    """The heads of one timed attention call at ``(seq, head)``: a fixed amount of work (about 30 ms on a CPU core
    shared by two ranks: a few of its time slices, so that each sample sees its share; less at heads under 32, which
    a CPU runs far below its matmul rate). On a GPU at least 32: one head of 8192 tokens is 64 blocks of queries for
    an H200's 132 multiprocessors, and was timed at 0.15 of its matmul rate, where a step's 32 heads run at 0.76."""
    work = 2**36 if device_type == "cuda" else 2**26 if quick else 2**30
    per_head = 7 * 2 * seq * seq * head // 2
    return max(32 if device_type == "cuda" else 1, int(work * min(1.0, head / 32)) // per_head)


def attention_rates(device: torch.device, sync: Any, reps: int, quick: bool, apart: bool | None = None) -> list[float]:
    """FLOP/s per rank of fused causal attention, forward and backward, at each shape of :func:`attention_grid`
    (sequence lengths outer, head sizes inner), every rank at once: ``scaled_dot_product_attention`` as a step calls it
    (fp32 on a CPU, bf16 on a GPU, where the flash kernels need it), its FLOPs counted as the planner counts them
    (Q K^T and P V forward, five such products backward, half of them under the causal mask), enough heads a call for
    a fixed amount of work (:func:`attention_heads`).

    With ``apart`` (the default on a GPU) the forward is also timed alone, and the list holds each shape's forward
    rate, then each shape's backward rate over its forward's: what the built-in GPU profiles hold apart (a
    :class:`~vemesh.planning.profiles.DeviceProfile`'s ``attention_backward``; flash attention's backward runs at
    about 0.9 of its forward's rate on an H100). A backward timed faster per FLOP than its forward is read as the same rate (1),
    the most the profile takes. On a CPU the two together: the rates there were checked against real steps so."""
    F = torch.nn.functional
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    apart = device.type == "cuda" if apart is None else apart
    rates, ratios = [], []
    for seq in attention_grid(device)[0]:
        for head in attention_grid(device)[1]:
            per_head = 7 * 2 * seq * seq * head // 2
            heads = attention_heads(device.type, seq, head, quick)
            q, k, v = (torch.randn(1, heads, seq, head, device=device, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            grad = torch.ones(1, heads, seq, head, device=device, dtype=dtype)

            def forward() -> torch.Tensor:
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            dist.barrier()
            both = median_seconds(lambda: forward().backward(grad), reps, sync)
            if not apart:
                rates.append(heads * per_head / both)
                continue
            dist.barrier()
            alone = median_seconds(forward, reps, sync)
            ahead = heads * 2 * seq * seq * head  # the forward's two products, of the seven
            rates.append(ahead / alone)
            backward = (heads * per_head - ahead) / max(both - alone, 1e-9)
            ratios.append(min(1.0, backward / rates[-1]))
    return rates + ratios


def median_seconds(fn: Any, reps: int, sync: Any) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_rates(device: torch.device, sync: Any, reps: int, quick: bool) -> tuple[float, float]:
    """Bytes per second per rank of a step's memory-bound ops, every rank at once: ``(plain, transcendental)``, of
    adds and multiplies, and of the ops :mod:`vemesh.planning.fusion` times apart (GELU and its backward, exp,
    sigmoid, rsqrt, log-softmax and layer norm on rows of 256), in turn. 1 MiB tensors read and a new one written (a
    step's ops move 128 KiB to 2 MiB each), the inputs cycled through 64 MiB so that none is still in a cache. The
    same ops on 16 values are timed and taken off: the framework's time per op is counted apart
    (:func:`op_overheads`). On a GPU the tensors are 16 MiB and nothing is taken off: its queue runs each op while
    the host dispatches the next, so the time per op is the device's."""
    # 1 MiB each, 8 or 64 MiB in all; on a GPU 16 MiB each (1 MiB is its launch's time; 64 MiB would fit an L2)
    size, count = 2**24 if device.type == "cuda" else 2**20, 8 if quick else 64
    tensors, tiny = ([torch.rand(k, device=device) for _ in range(count)] for k in (size // 4, 16))
    F = torch.nn.functional

    def rows(a: torch.Tensor) -> torch.Tensor:
        return a.view(-1, min(256, a.numel()))

    plain = ((lambda a, b: torch.add(a, b), 3), (lambda a, b: torch.mul(a, b), 3))
    transcendental = ((lambda a, b: F.gelu(a), 2), (lambda a, b: torch.ops.aten.gelu_backward(a, b), 3),
                      (lambda a, b: torch.exp(a), 2), (lambda a, b: torch.sigmoid(a), 2),
                      (lambda a, b: torch.rsqrt(a), 2), (lambda a, b: F.log_softmax(rows(a), -1), 2),
                      (lambda a, b: F.layer_norm(rows(a), rows(a).shape[-1:]), 2))

    def rate(ops: Any) -> float:
        def cycle(ts: list[torch.Tensor]) -> Any:
            def run() -> None:
                for i, (a, b) in enumerate(zip(ts, ts[1:])):
                    ops[i % len(ops)][0](a, b)
            return run

        dist.barrier()
        took = median_seconds(cycle(tensors), reps, sync) / (count - 1)
        if device.type == "cuda":  # the host queues the next op while the GPU runs this one: nothing to take off
            return sum(m for _, m in ops) / len(ops) * size / took
        dist.barrier()
        dispatch = median_seconds(cycle(tiny), reps, sync) / (count - 1)
        return sum(m for _, m in ops) / len(ops) * size / max(took - dispatch, took * 0.05)

    return rate(plain), rate(transcendental)


def op_overheads(device: torch.device, sync: Any, reps: int) -> tuple[float, float]:
    """Seconds of framework time per op dispatched in a training step, and what an op on a DTensor adds (its sharding
    propagation). The first is a small model's step (4 blocks of a layer norm, two Linears of width 16 and 64 and a
    GELU; a cross-entropy; AdamW) over the ops it dispatches: its compute is nothing, so its time is the framework's,
    modules, autograd and the optimizer's Python included (2.6x a bare op's on this project's machine, which
    predicted steps short when it was the figure). The second, a multiply on a replicated DTensor against a plain
    one, in a tight loop."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    model = nn.Sequential(*[nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 16))
                            for _ in range(4)]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x, y = torch.randn(8, 16, device=device), torch.randint(0, 16, (8,), device=device)

    def step() -> None:
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    step()
    with MemoryBoundBytes() as counted:
        step()
    k = 200
    plain = torch.ones(16, device=device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    d = distribute_tensor(torch.ones(16, device=device), mesh, [Replicate()])

    def ops(t: Any) -> Any:
        def run() -> None:
            for _ in range(k):
                t.mul(1.0)
        return run

    dist.barrier()
    per_op = median_seconds(lambda: [step() for _ in range(10)], reps, sync) / (10 * counted.ops)
    dist.barrier()
    bare = median_seconds(ops(plain), reps, sync) / k
    dist.barrier()
    return per_op, max(0.0, median_seconds(ops(d), reps, sync) / k - bare)
