"""``vemesh calibrate``: measure this machine as a job of N processes uses it, and write a device profile.

It starts N processes (gloo on CPU, nccl on GPUs, one device each), and all of them measure at once, as the
ranks of a job share the machine:

* **matmul**: a square matmul per dtype (fp32, bf16, and on a GPU of compute capability 8.9 or more fp8 through
  ``torch._scaled_mm``, as Float8 training runs its Linear layers), the median over repetitions, as FLOP/s per rank;
  of 1024 (4096 on a GPU, whose product of 1024 takes about its launch's time; fp8 8192);
* **one GPU** (``--device cuda --nproc 1``): the same device figures, and no collective; the links are the
  built-in profile's of that GPU (H100, H200, A100: its published figures, said in the assumptions);
* **attention**: causal ``scaled_dot_product_attention``, forward and backward, on a grid of sequence lengths and
  head sizes (:func:`vemesh.planning.device_rates.attention_grid`), each as a fraction of the same dtype's matmul
  rate (fp32 on a CPU, bf16 on a GPU): a CPU's flash attention reaches 0.04 of its matmul rate at head size 4 and
  0.58 at (1024, 64), which no one fraction stands for. On a GPU the forward is timed alone as well: the grid holds
  the forward's rates and ``attention_backward`` the median over the grid of the backward's rate over the
  forward's, as the built-in GPU profiles hold them;
* **memory**: cycles of a step's memory-bound ops on 1 MiB tensors (16 MiB on a GPU), each into a new one, as a
  step runs them (out of place, the inputs no longer in a cache), bytes read and written per second per rank: adds
  and multiplies, and apart the transcendental ones, a division or a normalization (GELU, exp, rsqrt, softmax,
  norms: on a CPU they are slower per byte than an add);
* **overlap**: an all-reduce started asynchronously under matmuls, against each alone: the fraction of the shorter
  that ran at the same time (a CPU whose cores the ranks share has little to spare);
* **collective wait**: small all-reduces between stretches of compute, against the same run back to back: what
  each call costs on top, since the ranks reach it at different moments; and a reference TP step (an MLP of the
  GPT example's width under torch's ``parallelize_module`` on pairs of ranks, forward and backward, against its
  local compute alone, each sample started after a barrier): what one TP collective costs in all. Of that, what a
  step time does not count apart (the all-reduce's latency and bytes on pairs, the wait above, its DTensor ops)
  is a functional collective's own wait, so that the figures add up to what the reference paid however their
  parts moved (short differences of runs read 2 to 3x apart from one launch to the next here; the reference
  moves by 10%);
* **shared compute**: with more ranks than cores (times each rank's threads), how many ranks share a core: the
  ranks that compute while others wait in a pipeline bubble run that much faster at most;
* **op overheads**: a small model's training step over the ops it dispatches (its compute is nothing: the
  framework's time per op, modules, autograd and the optimizer included), and what an op on a DTensor adds (its
  sharding propagation); these and the memory rates are :mod:`vemesh.planning.device_rates`;
* **each collective kind** (all-reduce, all-gather, reduce-scatter, all-to-all, broadcast) on groups of each size
  that divides N (every group of that size at once, as a mesh dim's groups run), at a small size (its latency per
  ring step) and a large one (its bus bandwidth, nccl-tests' busbw with the latency taken off). The ``host``
  link is the all-reduce over all N; each kind and size keeps its own figures.

One machine has one link class, so the profile's ``network`` link is the host's and it says so in its
assumptions: to predict a job across hosts, take a built-in profile or edit the ``network`` entry.
The profile's ``achievable`` is 1: the measured throughput is what a step reaches.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import statistics
import tempfile
import time
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

from vemesh import local_ranks
from vemesh.layout.names import divisors
from vemesh.planning.device_rates import attention_grid, attention_rates, median_seconds, memory_rates, op_overheads
from vemesh.planning.fusion import MemoryBoundBytes
from vemesh.planning.profiles import AttentionRate, DeviceProfile, Link, load_profile
from vemesh.planning.step_time import collective_seconds, ring

__all__ = ["KINDS", "calibrate", "functional_wait"]

#: The collective kinds measured, as the step-time model names them.
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _collective(kind: str, numel: int, n: int, device: torch.device, group: Any) -> Any:
    """A function that runs one ``kind`` collective of ``numel`` fp32 elements (nccl-tests' size) on ``group``."""
    if kind == "all_reduce":
        t = torch.ones(numel, device=device)
        return lambda: dist.all_reduce(t, group=group)
    if kind == "all_gather":
        out, part = torch.empty(numel, device=device), torch.ones(numel // n, device=device)
        gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)  # torch 2.13 renames it
        return lambda: gather(out, part, group=group)
    if kind == "reduce_scatter":
        full, part = torch.ones(numel, device=device), torch.empty(numel // n, device=device)
        scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)  # torch 2.13 renames it
        return lambda: scatter(part, full, group=group)
    if kind == "all_to_all":
        src, dst = torch.ones(numel, device=device), torch.empty(numel, device=device)
        return lambda: dist.all_to_all_single(dst, src, group=group)
    t = torch.ones(numel, device=device)
    return lambda: dist.broadcast(t, dist.get_global_rank(group, 0), group=group)


def _overlap(device: torch.device, sync: Any, reps: int, quick: bool) -> float:
    """How much of an all-reduce runs behind matmuls: (compute + comm - both) / the shorter, in [0, 1]."""
    a = torch.randn(256 if quick else 512, 256 if quick else 512, device=device)
    t = torch.ones((2**18) if quick else (2**22), device=device)

    def compute() -> None:
        for _ in range(8):
            a @ a

    def comm() -> None:
        dist.all_reduce(t)

    def both() -> None:
        work = dist.all_reduce(t, async_op=True)
        compute()
        work.wait()

    dist.barrier()
    alone = median_seconds(compute, reps, sync)
    dist.barrier()
    talking = median_seconds(comm, reps, sync)
    dist.barrier()
    together = median_seconds(both, reps, sync)
    return min(1.0, max(0.0, (alone + talking - together) / min(alone, talking)))


def _interleaved_wait(device: torch.device, sync: Any, reps: int, quick: bool, group: Any) -> float:
    """Seconds a small all-reduce costs between stretches of compute (a few ms each, as a layer's forward is)
    beyond what the compute and the all-reduces cost apart: the ranks reach it at different moments, and on a CPU
    whose cores they share, each waits for a peer the OS has not run yet. Measured on groups of 2 (TP's size)."""
    a = torch.randn(256, 256, device=device)
    t = torch.ones(256, device=device)
    k = 5 if quick else 20

    def stretch() -> None:
        for _ in range(8):
            a @ a

    def compute() -> None:
        for _ in range(k):
            stretch()

    def comm() -> None:
        for _ in range(k):
            if group is not None:
                dist.all_reduce(t, group=group)

    def interleaved() -> None:
        for _ in range(k):
            stretch()
            if group is not None:
                dist.all_reduce(t, group=group)

    dist.barrier()
    alone = median_seconds(compute, reps, sync) + median_seconds(comm, reps, sync)
    dist.barrier()
    c10d = median_seconds(interleaved, reps, sync)
    return max(0.0, (c10d - alone) / k)


def _pair(device: torch.device) -> tuple[Any, Any]:
    """This rank's group of 2 ranks (TP's size) and its DeviceMesh, or ``(None, None)`` for an odd rank out."""
    from torch.distributed.device_mesh import DeviceMesh

    n, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r, r + 1]) for r in range(0, n - n % 2, 2)]  # every rank makes every group
    group = groups[rank // 2] if rank < n - n % 2 else None
    return group, DeviceMesh.from_group(group, device.type) if group is not None else None


#: The reference TP job: an MLP of the GPT example's width over its tokens, ColwiseParallel then RowwiseParallel.
_TP_WIDTH, _TP_TOKENS = 192, 8 * 64


def _tp_reference(device: torch.device, sync: Any, reps: int, quick: bool, pair: Any) -> tuple[float, int]:
    """What one TP collective costs in a TP step, all in (its waits, its wrapper, DTensor's work around it), and the
    DTensor ops it comes with: an MLP under torch's ``parallelize_module`` on groups of 2, forward and backward (two
    all-reduces: the output's, the input gradient's), against the same local compute without TP, every sample
    started together after a barrier, as a step starts its layers."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    w, k = _TP_WIDTH, 3 if quick else 10

    def mlp(hidden: int) -> nn.Module:
        return nn.Sequential(nn.Linear(w, hidden), nn.GELU(), nn.Linear(hidden, w)).to(device)

    x = torch.randn(_TP_TOKENS, w, device=device, requires_grad=True)
    local = mlp(2 * w)  # a TP rank's share of the 4w hidden width
    tp = parallelize_module(mlp(4 * w), pair, {"0": ColwiseParallel(), "2": RowwiseParallel()}) \
        if pair is not None else local

    def seconds(model: nn.Module) -> float:
        model(x).sum().backward()
        times = []
        for _ in range(reps):
            dist.barrier()
            start = time.perf_counter()
            for _ in range(k):
                model(x).sum().backward()
            sync()
            times.append(time.perf_counter() - start)
        return statistics.median(times)

    counted = MemoryBoundBytes()
    with counted:
        tp(x).sum().backward()
    with_tp, without = seconds(tp), seconds(local)
    return max(0.0, (with_tp - without) / (2 * k)), counted.dtensor_ops // 2


def functional_wait(tp_call: float, dtensor_ops: int, pair: Link, wait: float, per_dtensor_op: float,
                    backend: str) -> float:
    """A functional collective's own wait: what the reference TP step paid per collective (``tp_call``), less what
    a step time counts apart for such a call (the all-reduce's latency and bytes on ``pair``, the c10d ``wait``, its
    ``dtensor_ops`` at ``per_dtensor_op``), so that the profile's figures add up to what the reference paid,
    however their parts moved; never below 0."""
    counted = (collective_seconds("all_reduce", _TP_TOKENS * _TP_WIDTH * 4, 1, 2, pair, backend) + wait
               + dtensor_ops * per_dtensor_op)
    return max(0.0, tp_call - counted)


def _measure(rank: int, n: int, device: torch.device, sync: Any, quick: bool, groups: dict[int, Any],
             pairs: tuple[Any, Any]) -> tuple[list[float], dict[str, dict[str, dict[str, float]]]]:
    """One round of every measurement (see the module docstring): this rank's figures, and each collective kind's
    link per group size; ``pairs`` is this rank's group of 2 and its DeviceMesh (:func:`_pair`, made once)."""
    reps = 3 if quick else 7
    # a GPU needs larger products than a CPU core to reach its rate: at 1024 one takes about its launch's time
    size = 4096 if device.type == "cuda" else 256 if quick else 1024
    flops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        dist.barrier()
        flops[name] = 2 * size ** 3 / median_seconds(lambda: a @ a, reps, sync)
    if device.type == "cuda" and torch.cuda.get_device_capability(device) >= (8, 9):  # fp8 tensor cores
        big = 2 * size
        a8, b8 = (torch.randn(big, big, device=device).to(torch.float8_e4m3fn) for _ in range(2))
        one = torch.ones((), device=device)
        flops["fp8"] = 2 * big ** 3 / median_seconds(
            lambda: torch._scaled_mm(a8, b8.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16), reps, sync)
    memory, transcendental = memory_rates(device, sync, reps, quick)
    attention = attention_rates(device, sync, reps, quick)
    if n == 1:  # one GPU: no collective to measure
        return [flops["fp32"], flops["bf16"], memory, 1.0, 0.0, *(-x for x in op_overheads(device, sync, reps)),
                0.0, 0.0, flops.get("fp8", 0.0), transcendental, *attention], {}
    kinds: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in KINDS}
    for size, group in groups.items():  # each group size, every group of it at once
        small, large = size * 256, size * ((2**18) if quick else (2**22))  # fp32: 1 KiB x size; 1 or 16 MiB x size
        for kind in KINDS:
            factor, steps = ring(kind, size)
            dist.barrier()
            t_small = median_seconds(_collective(kind, small, size, device, group), reps, sync)
            dist.barrier()
            t_large = median_seconds(_collective(kind, large, size, device, group), reps, sync)
            latency = t_small / steps
            moved = factor * large * 4
            kinds[kind][str(size)] = {"latency_s": latency,
                                      "bandwidth": moved / max(t_large - steps * latency, t_large * 0.05)}
    overlap = _overlap(device, sync, reps, quick)
    wait = _interleaved_wait(device, sync, 3 * reps, quick, pairs[0])  # differences of runs: more of them
    per_op, per_dtensor_op = op_overheads(device, sync, reps)
    tp_call, tp_dtensor_ops = _tp_reference(device, sync, 3 * reps, quick, pairs[1])
    # rates, and times negated: the slowest rank is each figure's minimum
    return [flops["fp32"], flops["bf16"], memory, overlap, -wait, -per_op, -per_dtensor_op, -tp_call,
            -tp_dtensor_ops, flops.get("fp8", 0.0), transcendental, *attention], kinds


def _worker(rank: int, n: int, store: str, device_type: str, quick: bool, out: str, repeat: int = 1) -> None:
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    # nccl bound to this rank's device (else it guesses it from the rank, and warns that a wrong guess hangs)
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=n,
                            device_id=device if device_type == "cuda" else None)
    sync = (lambda: torch.cuda.synchronize()) if device_type == "cuda" else (lambda: None)  # noqa: E731
    groups = {}
    for size in divisors(n)[1:]:
        made = [dist.new_group(list(range(start, start + size))) for start in range(0, n, size)]
        groups[size] = made[rank // size]
    pairs = _pair(device) if n > 1 else (None, None)
    rounds = [_measure(rank, n, device, sync, quick, groups, pairs) for _ in range(repeat)]
    # each figure's median over the rounds: a shared machine's moments of load fall on one round, not on the profile
    mine = [statistics.median(r[0][i] for r in rounds) for i in range(len(rounds[0][0]))]
    kinds = {kind: {size: {field: statistics.median(r[1][kind][size][field] for r in rounds) for field in link}
                    for size, link in by_size.items()} for kind, by_size in rounds[0][1].items()}
    everyone: list[Any] = [None] * n
    dist.all_gather_object(everyone, mine)
    threads = 1 if device_type == "cuda" else torch.get_num_threads()
    shared = max(1.0, n * threads / (os.cpu_count() or 1)) if device_type == "cpu" else 1.0
    if rank == 0:
        slowest = [min(r[i] for r in everyone) for i in range(len(mine))]  # the slowest rank sets the job's pace
        links = _published_links(torch.cuda.get_device_name(0)) if n == 1 else None
        host = links.host.model_dump() if links is not None else kinds["all_reduce"][str(n)]
        wait, per_dtensor_op, tp_call, tp_dtensor_ops = -slowest[4], -slowest[6], -slowest[7], -slowest[8]
        shapes, cuda = [(s, h) for s in attention_grid(device)[0] for h in attention_grid(device)[1]], device_type == "cuda"
        rates, ratios = slowest[11:11 + len(shapes)], slowest[11 + len(shapes):]  # ratios: on a GPU (attention_rates)
        pair = Link(**kinds["all_reduce"].get("2", host)) if n > 1 else Link(**host)
        profile = DeviceProfile(
            name=f"calibrated-{socket.gethostname()}-{n}",
            description=f"measured by vemesh calibrate: {n} {backend} processes on one {platform.machine()} host"
                        + (f" with {torch.cuda.get_device_name(0)}" if device_type == "cuda" else
                           f" of {os.cpu_count()} cores"),
            measured=True,
            sources=[f"vemesh calibrate --nproc {n}{' --quick' if quick else ''}"
                     f"{f' --repeat {repeat}' if repeat > 1 else ''}, "
                     f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}, torch {torch.__version__}"],
            assumptions=[f"links: one GPU measures no collective; host and network are {links.name}'s published "
                         "figures" if links is not None else
                         "network: one machine has one link class, so the network link is the host's measured "
                         "all-reduce; edit it (or take a built-in profile) to predict a job across hosts",
                         "achievable: 1, since the matmul figures are measured throughput, not a peak"],
            devices_per_host=n,
            matmul_flops={"fp32": slowest[0], "bf16": slowest[1], **({"fp8": slowest[9]} if slowest[9] > 0 else {})},
            achievable=1.0,
            memory_bandwidth=slowest[2],
            transcendental_bandwidth=slowest[10],
            # each a fraction of the same dtype's matmul rate (bf16 on a GPU, fp32 on a CPU), both the slowest rank's
            attention=[AttentionRate(seq=seq, head_dim=head, achievable=min(1.0, rate / slowest[1 if cuda else 0]))
                       for (seq, head), rate in zip(shapes, rates)],
            attention_backward=statistics.median(ratios) if ratios else None,
            overlap=slowest[3],
            shared_compute=shared,
            queued=device_type == "cuda",
            backend=backend,
            collective_wait_s=wait,
            functional_wait_s=functional_wait(tp_call, tp_dtensor_ops, pair, wait, per_dtensor_op, backend) if n > 1
            else 0.0,
            op_overhead_s=-slowest[5],
            dtensor_op_overhead_s=per_dtensor_op,
            host=dict(latency_s=host["latency_s"], bandwidth=host["bandwidth"]),
            network=links.network.model_dump() if links is not None else dict(latency_s=host["latency_s"],
                                                                               bandwidth=host["bandwidth"]),
            collectives=kinds,
        )
        with open(out, "w") as f:
            json.dump(profile.model_dump(), f, indent=2)
            f.write("\n")
    dist.barrier()
    dist.destroy_process_group()


def _published_links(device_name: str) -> DeviceProfile:
    """The built-in profile whose GPU ``device_name`` is (its links stand in for one GPU's unmeasured ones)."""
    for key, name in (("H200", "h200-sxm"), ("H100", "h100-sxm"), ("A100", "a100-sxm-80gb")):
        if key in device_name:
            return load_profile(name)
    return load_profile("h100-sxm")


def calibrate(nproc: int, output: str, *, device_type: str = "cpu", quick: bool = False,
              repeat: int = 1) -> DeviceProfile:
    """Measure this machine with ``nproc`` processes and write the profile to ``output``; return it. ``repeat``
    rounds of every measurement give each figure as its median over them."""
    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1; got {repeat}")
    folder = os.path.dirname(os.path.abspath(output))
    why = ("is a directory" if os.path.isdir(output) else f"is in {folder}, which does not exist"
           if not os.path.isdir(folder) else f"is in {folder}, which this user cannot write"
           if not os.access(folder, os.W_OK) else None)
    if why:  # said before measuring: the figures would be lost at the end
        raise ValueError(f"--output {output} {why}: give a file in a directory that exists, such as profile.json")
    if device_type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc {nproc} on cuda needs {nproc} GPUs; this machine sees {torch.cuda.device_count()}")
    # the rendezvous through a file of a folder of its own: a port chosen here could be taken before rank 0 binds it
    with tempfile.TemporaryDirectory(prefix="vemesh-calibrate-") as folder:
        local_ranks.start(_worker, (nproc, os.path.join(folder, "store"), device_type, quick, output, repeat), nproc,
                          join=True, preload=(__name__,))
    return load_profile(output)
