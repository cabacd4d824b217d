"""``vemesh calibrate``: measure this machine as a job of N processes uses it, and write a device profile.

It starts N processes (gloo on CPU, nccl on GPUs, one device each), and all of them measure at once, as the
ranks of a job share the machine:

* **matmul**: a square matmul per dtype (fp32, bf16), the median over repetitions, as FLOP/s per rank;
* **memory**: an add of two 1 MiB tensors into a new one, as a step's memory-bound ops run (out of place, the
  inputs no longer in a cache), bytes read and written per second per rank;
* **overlap**: an all-reduce started asynchronously under matmuls, against each alone: the fraction of the shorter
  that ran at the same time (a CPU whose cores the ranks share has little to spare);
* **collective wait**: small all-reduces between stretches of compute, against the same run back to back: what
  each call costs on top, since the ranks reach it at different moments; and the same all-reduce as TP runs it
  (a DTensor's ``Partial`` redistributed to ``Replicate``: torch's functional collective, waited for when the
  result is used), against c10d's: what such a call costs on top of that;
* **shared compute**: with more ranks than cores (times each rank's threads), how many ranks share a core: the
  ranks that compute while others wait in a pipeline bubble run that much faster at most;
* **op overheads**: a tiny op's time (the framework's own, per op dispatched), and what the same op on a DTensor
  adds (its sharding propagation);
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
import time
from datetime import datetime, timezone
from typing import Any

import torch
import torch.distributed as dist

from vemesh.planning.profiles import DeviceProfile, load_profile
from vemesh.planning.step_time import ring

__all__ = ["KINDS", "calibrate"]

#: The collective kinds measured, as the step-time model names them.
KINDS: tuple[str, ...] = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast")


def _median_seconds(fn: Any, reps: int, sync: Any) -> float:
    fn()
    sync()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


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
    alone = _median_seconds(compute, reps, sync)
    dist.barrier()
    talking = _median_seconds(comm, reps, sync)
    dist.barrier()
    together = _median_seconds(both, reps, sync)
    return min(1.0, max(0.0, (alone + talking - together) / min(alone, talking)))


def _interleaved_wait(device: torch.device, sync: Any, reps: int, quick: bool) -> tuple[float, float]:
    """Seconds a small all-reduce costs between stretches of compute (a few ms each, as a layer's forward is)
    beyond what the compute and the all-reduces cost apart: the ranks reach it at different moments, and on a CPU
    whose cores they share, each waits for a peer the OS has not run yet. Measured on groups of 2 (TP's size).

    And what the same all-reduce costs on top of that when TP runs it: a DTensor's ``Partial`` redistributed to
    ``Replicate`` (torch's functional collective, its wrapper, its wait when the result is used)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate

    a = torch.randn(256, 256, device=device)
    t = torch.ones(256, device=device)
    n = dist.get_world_size()
    groups = [dist.new_group([r, r + 1]) for r in range(0, n - n % 2, 2)]
    group = groups[dist.get_rank() // 2] if dist.get_rank() < n - n % 2 else None
    pair = DeviceMesh.from_group(group, device.type) if group is not None else None
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

    def as_tp() -> None:
        for _ in range(k):
            stretch()
            if pair is not None:
                DTensor.from_local(t, pair, [Partial()]).redistribute(pair, [Replicate()]).to_local().add_(0)

    dist.barrier()
    alone = _median_seconds(compute, reps, sync) + _median_seconds(comm, reps, sync)
    dist.barrier()
    c10d = _median_seconds(interleaved, reps, sync)
    dist.barrier()
    functional = _median_seconds(as_tp, reps, sync)
    return max(0.0, (c10d - alone) / k), max(0.0, (functional - c10d) / k)


def _memory(device: torch.device, sync: Any, reps: int, quick: bool) -> float:
    """Bytes per second per rank of an add as a training step runs its memory-bound ops, every rank at once: two
    1 MiB tensors read and a new one written (a step's ops move 128 KiB to 2 MiB each, most of their bytes), the
    inputs cycled through 64 MiB of tensors so that none is still in a core's cache from the add before. The same
    adds on 16 values are timed and taken off: the framework's time per op is the profile's ``op_overhead_s``,
    which a step time adds apart."""
    size, working_set = 2**20, (8 if quick else 64) * 2**20
    count = working_set // size
    tensors = [torch.rand(size // 4, device=device) for _ in range(count)]
    tiny = [torch.rand(16, device=device) for _ in range(count)]

    def adds(ts: list[torch.Tensor]) -> Any:
        def run() -> None:
            for a, b in zip(ts, ts[1:]):
                torch.add(a, b)
        return run

    dist.barrier()
    took = _median_seconds(adds(tensors), reps, sync) / (count - 1)
    dist.barrier()
    dispatch = _median_seconds(adds(tiny), reps, sync) / (count - 1)
    return 3 * size / max(took - dispatch, took * 0.05)


def _op_overheads(device: torch.device, sync: Any, reps: int) -> tuple[float, float]:
    """Seconds per tiny op (the framework's own time), and what an op on a DTensor adds (sharding propagation)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    k = 200
    x = torch.ones(16, device=device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    d = distribute_tensor(torch.ones(16, device=device), mesh, [Replicate()])

    def plain() -> None:
        for _ in range(k):
            x.mul(1.0)

    def on_dtensor() -> None:
        for _ in range(k):
            d.mul(1.0)

    dist.barrier()
    per_op = _median_seconds(plain, reps, sync) / k
    dist.barrier()
    return per_op, max(0.0, _median_seconds(on_dtensor, reps, sync) / k - per_op)


def _measure(rank: int, n: int, device: torch.device, sync: Any, quick: bool,
             groups: dict[int, Any]) -> tuple[list[float], dict[str, dict[str, dict[str, float]]]]:
    """One round of every measurement (see the module docstring): this rank's figures, and each collective kind's
    link per group size."""
    reps = 3 if quick else 7
    size = 256 if quick else 1024
    flops = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        a = torch.randn(size, size, device=device, dtype=dtype)
        dist.barrier()
        flops[name] = 2 * size ** 3 / _median_seconds(lambda: a @ a, reps, sync)
    memory = _memory(device, sync, reps, quick)
    kinds: dict[str, dict[str, dict[str, float]]] = {kind: {} for kind in KINDS}
    for size, group in groups.items():  # each group size, every group of it at once
        small, large = size * 256, size * ((2**18) if quick else (2**22))  # fp32: 1 KiB x size; 1 or 16 MiB x size
        for kind in KINDS:
            factor, steps = ring(kind, size)
            dist.barrier()
            t_small = _median_seconds(_collective(kind, small, size, device, group), reps, sync)
            dist.barrier()
            t_large = _median_seconds(_collective(kind, large, size, device, group), reps, sync)
            latency = t_small / steps
            moved = factor * large * 4
            kinds[kind][str(size)] = {"latency_s": latency,
                                      "bandwidth": moved / max(t_large - steps * latency, t_large * 0.05)}
    overlap = _overlap(device, sync, reps, quick)
    wait, functional_wait = _interleaved_wait(device, sync, 3 * reps, quick)  # differences of runs: more of them
    per_op, per_dtensor_op = _op_overheads(device, sync, reps)
    # rates, and times negated: the slowest rank is each figure's minimum
    return [flops["fp32"], flops["bf16"], memory, overlap, -wait, -per_op, -per_dtensor_op, -functional_wait], kinds


def _worker(rank: int, n: int, port: int, device_type: str, quick: bool, out: str, repeat: int = 1) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    backend = "nccl" if device_type == "cuda" else "gloo"
    device = torch.device("cuda", rank) if device_type == "cuda" else torch.device("cpu")
    if device_type == "cuda":
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // n))
    dist.init_process_group(backend, rank=rank, world_size=n)
    sync = (lambda: torch.cuda.synchronize()) if device_type == "cuda" else (lambda: None)  # noqa: E731
    groups = {}
    for size in [d for d in range(2, n + 1) if n % d == 0]:
        made = [dist.new_group(list(range(start, start + size))) for start in range(0, n, size)]
        groups[size] = made[rank // size]
    rounds = [_measure(rank, n, device, sync, quick, groups) for _ in range(repeat)]
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
        host = kinds["all_reduce"][str(n)]
        profile = DeviceProfile(
            name=f"calibrated-{socket.gethostname()}-{n}",
            description=f"measured by vemesh calibrate: {n} {backend} processes on one {platform.machine()} host"
                        + (f" with {torch.cuda.get_device_name(0)}" if device_type == "cuda" else
                           f" of {os.cpu_count()} cores"),
            measured=True,
            sources=[f"vemesh calibrate --nproc {n}{' --quick' if quick else ''}"
                     f"{f' --repeat {repeat}' if repeat > 1 else ''}, "
                     f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}, torch {torch.__version__}"],
            assumptions=["network: one machine has one link class, so the network link is the host's measured "
                         "all-reduce; edit it (or take a built-in profile) to predict a job across hosts",
                         "achievable: 1, since the matmul figures are measured throughput, not a peak"],
            devices_per_host=n,
            matmul_flops={"fp32": slowest[0], "bf16": slowest[1]},
            achievable=1.0,
            memory_bandwidth=slowest[2],
            overlap=slowest[3],
            shared_compute=shared,
            backend=backend,
            collective_wait_s=-slowest[4],
            functional_wait_s=-slowest[7],
            op_overhead_s=-slowest[5],
            dtensor_op_overhead_s=-slowest[6],
            host=dict(latency_s=host["latency_s"], bandwidth=host["bandwidth"]),
            network=dict(latency_s=host["latency_s"], bandwidth=host["bandwidth"]),
            collectives=kinds,
        )
        with open(out, "w") as f:
            json.dump(profile.model_dump(), f, indent=2)
            f.write("\n")
    dist.barrier()
    dist.destroy_process_group()


def calibrate(nproc: int, output: str, *, device_type: str = "cpu", quick: bool = False,
              repeat: int = 1) -> DeviceProfile:
    """Measure this machine with ``nproc`` processes and write the profile to ``output``; return it. ``repeat``
    rounds of every measurement give each figure as its median over them."""
    import torch.multiprocessing as mp

    if repeat < 1:
        raise ValueError(f"--repeat must be at least 1; got {repeat}")
    if device_type == "cuda" and torch.cuda.device_count() < nproc:
        raise ValueError(f"--nproc {nproc} on cuda needs {nproc} GPUs; this machine sees {torch.cuda.device_count()}")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(_worker, args=(nproc, port, device_type, quick, output, repeat), nprocs=nproc, join=True,
                       start_method="spawn")
    return load_profile(output)
