"""Training-step benchmark: vemesh DDP / DistributedOptimizer against torch's own, at DP=2.

Run (2 ranks, spawned by the script; BENCHMARKS.md's "Training step" figures come from the first line):

    OMP_NUM_THREADS=1 python bench/train_step.py --json bench/results/train_step.json
    python bench/train_step.py --quick                    # smoke run of the GPT path (a test runs it)
    python bench/train_step.py --quick --model mlp        # smoke run of the MLP path
    OMP_NUM_THREADS=1 python bench/train_step.py --n-layer 6 --n-embd 512 --n-head 8 --bucket-mb 25
    OMP_NUM_THREADS=1 python bench/train_step.py --model mlp --memory none   # issue 3's MLP, timing only

Under ``torchrun --nproc-per-node 2 bench/train_step.py`` it uses torchrun's ranks instead, and skips
the memory table (that needs a fresh process per contender).

The default model is the GPT preset (``vemesh.models.gpt``, what the example trains), trained with its step
(``train.py``: ``opt.zero_grad()``, ``loss_fn(model(x), y).backward()``, ``clip_grad_norm_`` to
``--grad-clip``, ``opt.step()``: torch's loop, the same calls for every contender) on its byte-level data, every
rank taking its own DP slice of each global batch. ``--model mlp`` is issue 3's MLP on random
data (MSE loss). Every contender trains the same model from the same initial weights on the same
batches.

Timing: all contenders live in the same two processes; steps are interleaved (contender order
rotates each step), each step starts after a barrier, and a step's time is the slowest rank's.
We report the median over ``--steps`` steps after ``--warmup``. A ratio is the median over steps of
(candidate's time / baseline's time in the same round), which cancels load that drifts between
rounds on a shared machine; the ratio of the two medians is printed beside it. Pairs and targets:

* vemesh DDP (+ torch AdamW) vs ``torch.nn.parallel.DistributedDataParallel`` (+ AdamW), same
  bucket size (torch's first bucket is then as large as the others): target ratio <= 1.05;
* vemesh ``DistributedOptimizer`` vs torch DDP + ``ZeroRedundancyOptimizer``: target <= 1.0;
  FSDP2 ``fully_shard`` per transformer block and at the root, resharding after forward (ZeRO-3)
  and not (ZeRO-2-like), as a reference without a target;
* gradient sync (a backward inside ``no_sync()``, then the timed ``finish_grad_sync()``) vs a bare
  ``all_reduce`` of the same number of bytes: target bare/sync >= 0.8;
* optimizer-state bytes per rank for each optimizer (DTensor state counted by its local shard);
* collectives on this backend: reduce-scatter vs all-reduce for gradients (vemesh always
  all-reduces, so that every ``.grad`` is valid for clipping and GradScaler, as ZeRO-1 in
  DeepSpeed and torch's ZeroRedundancyOptimizer do), all-gather vs one broadcast per rank for
  the parameter gather (vemesh broadcasts on gloo).

Memory: peak RSS is per process for its whole life (``ru_maxrss``, ``VmHWM``), and freed heap is
not always handed back to the OS, so one process cannot measure several contenders fairly. Each
contender therefore gets a fresh world of processes: each rank trains a tiny model of the same
kind once (so torch's code and threads are paged in), records its RSS (the baseline), resets
``VmHWM`` through ``/proc/self/clear_refs``, builds the contender, runs ``--warmup`` +
``--mem-steps`` steps, and reports ``VmHWM - baseline`` (peak) and ``VmRSS - baseline`` (after the
steps); the larger rank's figure is shown. ``--memory glibc`` forks the processes from the
launcher (which has imported torch but run nothing) with glibc's default malloc, as users run:
RSS then also holds freed heap that glibc keeps. ``--memory mmap`` spawns them with
``MALLOC_MMAP_THRESHOLD_=65536``, so every tensor of 64 KiB or more is its own mapping, returned
on free, and RSS follows the live tensors. ``both`` (the default) runs each.

To add a contender, write a ``build_*`` function returning a :class:`Runner` and add it to
:func:`contenders`; to add a model, extend :func:`build_model`, :func:`make_batches` and
:func:`compute_loss`.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.distributed.tensor import DTensor

from vemesh.ddp import DistributedDataParallel as VeDDP
from vemesh.optim import DistributedOptimizer

GPT_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
sys.path.insert(0, str(GPT_EXAMPLE))  # the example's modules import each other by plain name
from data import VOCAB_SIZE, ByteDataset  # noqa: E402
from vemesh.models.gpt import GPT, GPTConfig  # noqa: E402
from train import loss_fn as gpt_loss_fn  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    """What to train and how long to time it. Every field is a ``--flag``."""

    model: str = "gpt"  # "gpt" (the GPT example) or "mlp"
    n_layer: int = 4  # gpt
    n_head: int = 6  # gpt
    n_embd: int = 384  # gpt
    seq_len: int = 64  # gpt
    width: int = 1024  # mlp
    depth: int = 8  # mlp
    batch: int = 4  # sequences (gpt) or rows (mlp) per rank
    steps: int = 20
    warmup: int = 3
    mem_steps: int = 3  # steps per contender in the memory runs (after warmup)
    bucket_mb: float = 4.0  # bucket size for vemesh (in elements: MiB / 4) and torch DDP (bucket_cap_mb)
    lr: float = 1e-4
    grad_clip: float = 1.0  # clip the global gradient norm to this, as train.py does (0: off)
    memory: str = "both"  # memory runs: "glibc" (as users run), "mmap" (MALLOC_MMAP_THRESHOLD_), "both", "none"

    @property
    def bucket_elems(self) -> int:
        return int(self.bucket_mb * 1024 * 1024) // 4


PRESETS = {
    ("gpt", False): BenchConfig(),
    ("gpt", True): BenchConfig(n_layer=1, n_head=2, n_embd=32, seq_len=16, batch=2, steps=3, warmup=1,
                               mem_steps=1, bucket_mb=0.05, memory="glibc"),
    ("mlp", False): BenchConfig(model="mlp", batch=64, bucket_mb=25, grad_clip=0.0, steps=15),
    ("mlp", True): BenchConfig(model="mlp", width=64, depth=2, batch=8, steps=3, warmup=1, mem_steps=1,
                               bucket_mb=1, grad_clip=0.0, memory="glibc"),
}


def build_model(cfg: BenchConfig) -> nn.Module:
    """The benchmark model, identical on every rank and for every contender."""
    torch.manual_seed(0)
    if cfg.model == "gpt":
        return GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.seq_len, n_layer=cfg.n_layer,
                             n_head=cfg.n_head, n_embd=cfg.n_embd))
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    return nn.Sequential(*layers)


def make_batches(cfg: BenchConfig, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This rank's ``n`` batches: batch ``i`` is this rank's DP slice of global batch ``i``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    if cfg.model == "gpt":
        dataset = ByteDataset(None, max_bytes=1_000_000, val_fraction=0.1)  # the example's default corpus
        return [dataset.get_batch("train", step=i, seed=1337, global_batch_size=cfg.batch * world,
                                  seq_len=cfg.seq_len, dp_rank=rank, dp_size=world) for i in range(n)]
    g = torch.Generator().manual_seed(rank)
    return [(torch.randn(cfg.batch, cfg.width, generator=g), torch.randn(cfg.batch, cfg.width, generator=g))
            for _ in range(n)]


def compute_loss(cfg: BenchConfig, model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return gpt_loss_fn(model(x), y) if cfg.model == "gpt" else F.mse_loss(model(x), y)


@dataclass
class Runner:
    """One contender: ``step()`` returns the seconds to count; ``state_bytes()`` its optimizer state."""

    step: Callable[[], float]
    state_bytes: Callable[[], int]
    grad_numel: int = 0


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of tensor optimizer state on this rank (a DTensor counts its local shard)."""
    total = 0
    for state in opt.state.values():
        for t in state.values():
            if isinstance(t, DTensor):
                t = t.to_local()
            if torch.is_tensor(t):
                total += t.numel() * t.element_size()
    return total


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


#: This rank's batches, drawn by :func:`main` / :func:`measure_memory` before any contender is built.
BATCHES: list[tuple[torch.Tensor, torch.Tensor]] = []


def _training_step(cfg: BenchConfig, model: nn.Module, opt: Any) -> Callable[[], float]:
    """train.py's step, torch's loop: zero, forward + backward, clip the global norm, step."""
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]] = itertools.cycle(BATCHES)
    params = [p for p in model.parameters() if p.requires_grad]

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        opt.zero_grad(set_to_none=True)
        compute_loss(cfg, model, x, y).backward()
        if cfg.grad_clip:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()

    def timed_step() -> float:
        x, y = next(batches)  # outside the timed region
        return _timed(lambda: step(x, y))

    return timed_step


def build_vemesh_ddp(cfg: BenchConfig) -> Runner:
    model = VeDDP(build_model(cfg), overlap_grad_reduce=True, bucket_size=cfg.bucket_elems)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return Runner(_training_step(cfg, model, opt), lambda: _state_bytes(opt))


def build_torch_ddp(cfg: BenchConfig) -> Runner:
    model = nn.parallel.DistributedDataParallel(build_model(cfg), bucket_cap_mb=cfg.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return Runner(_training_step(cfg, model, opt), lambda: _state_bytes(opt))


def build_vemesh_zero(cfg: BenchConfig) -> Runner:
    model = VeDDP(build_model(cfg), overlap_grad_reduce=True, bucket_size=cfg.bucket_elems)
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=cfg.lr)
    return Runner(_training_step(cfg, model, opt), lambda: _state_bytes(opt.optimizer))


def build_torch_zero(cfg: BenchConfig) -> Runner:
    model = nn.parallel.DistributedDataParallel(build_model(cfg), bucket_cap_mb=cfg.bucket_mb)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=cfg.lr)
    return Runner(_training_step(cfg, model, opt), lambda: _state_bytes(opt.optim))


def _build_fsdp2(cfg: BenchConfig, reshard_after_forward: bool) -> Runner:
    """FSDP2 ``fully_shard`` on each block (GPT) or layer (MLP), then on the root."""
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model = build_model(cfg)
    units = list(model.h.values()) if cfg.model == "gpt" else [m for m in model if isinstance(m, nn.Linear)]
    for unit in units:
        fully_shard(unit, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    return Runner(_training_step(cfg, model, opt), lambda: _state_bytes(opt))


def build_fsdp2_zero3(cfg: BenchConfig) -> Runner:
    return _build_fsdp2(cfg, reshard_after_forward=True)


def build_fsdp2_zero2(cfg: BenchConfig) -> Runner:
    return _build_fsdp2(cfg, reshard_after_forward=False)


def build_vemesh_sync(cfg: BenchConfig) -> Runner:
    """Times only the gradient average: backward runs first inside ``no_sync()``, then ``finish_grad_sync()``."""
    model = VeDDP(build_model(cfg), overlap_grad_reduce=False, bucket_size=cfg.bucket_elems)
    numel = sum(p.numel() for p in model.parameters())
    x, y = BATCHES[0]

    def step() -> float:
        model.zero_grad()
        with model.no_sync():
            compute_loss(cfg, model, x, y).backward()
        dist.barrier()
        return _timed(model.finish_grad_sync)

    return Runner(step, lambda: 0, numel)


def build_bare_all_reduce(cfg: BenchConfig) -> Runner:
    """One ``all_reduce`` of a flat fp32 tensor as large as the model's gradients: the bound."""
    flat = torch.randn(sum(p.numel() for p in build_model(cfg).parameters()))
    return Runner(lambda: _timed(lambda: dist.all_reduce(flat)), lambda: 0, flat.numel())


def contenders() -> dict[str, Callable[[BenchConfig], Runner]]:
    return {
        "vemesh_ddp": build_vemesh_ddp,
        "torch_ddp": build_torch_ddp,
        "vemesh_zero": build_vemesh_zero,
        "torch_zero": build_torch_zero,
        "fsdp2_zero3": build_fsdp2_zero3,
        "fsdp2_zero2": build_fsdp2_zero2,
        "vemesh_sync": build_vemesh_sync,
        "bare_all_reduce": build_bare_all_reduce,
    }


#: Contenders that train (measured for memory and optimizer state).
TRAINERS = ["vemesh_ddp", "torch_ddp", "vemesh_zero", "torch_zero", "fsdp2_zero3", "fsdp2_zero2"]

# (label, candidate, baseline, target or None, higher_is_better): ratio = candidate / baseline
PAIRS = [
    ("vemesh DDP / torch DDP (step time)", "vemesh_ddp", "torch_ddp", 1.05, False),
    ("vemesh DistributedOptimizer / ZeroRedundancyOptimizer (step time)", "vemesh_zero", "torch_zero", 1.0, False),
    ("bare all_reduce / vemesh grad sync (fraction of bound)", "bare_all_reduce", "vemesh_sync", 0.8, True),
    ("vemesh DistributedOptimizer / FSDP2 ZeRO-3 (step time)", "vemesh_zero", "fsdp2_zero3", None, False),
    ("vemesh DistributedOptimizer / FSDP2 ZeRO-2 (step time)", "vemesh_zero", "fsdp2_zero2", None, False),
    ("vemesh DistributedOptimizer / vemesh DDP (step time)", "vemesh_zero", "vemesh_ddp", None, False),
]


def run_interleaved(runners: dict[str, Runner], steps: int, warmup: int) -> dict[str, list[float]]:
    """Median-ready step times: the slowest rank's time per step, contender order rotating."""
    names = list(runners)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(warmup + steps):
        order = names[i % len(names) :] + names[: i % len(names)]
        for name in order:
            dist.barrier()
            t = torch.tensor(runners[name].step(), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            if i >= warmup:
                times[name].append(float(t))
    return times


def collective_choice(numel: int, repeats: int) -> dict[str, float]:
    """Median ms of the ZeRO-1 communication options over ``numel`` fp32 elements.

    Gradients: reduce-scatter or all-reduce; parameters: all-gather or one broadcast per rank.
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    numel -= numel % world
    grads, params = torch.randn(numel), torch.randn(numel)
    shard = numel // world
    mine = slice(rank * shard, (rank + 1) * shard)

    def broadcast_shards() -> None:
        works = [dist.broadcast(params[r * shard : (r + 1) * shard], src=r, async_op=True) for r in range(world)]
        for w in works:
            w.wait()  # type: ignore[union-attr]

    options: dict[str, Callable[[], None]] = {
        "reduce_scatter": lambda: dist.reduce_scatter_single(grads[mine], grads),
        "all_reduce": lambda: dist.all_reduce(grads),
        "all_gather": lambda: dist.all_gather_single(params, params[mine]),
        "broadcast_shards": broadcast_shards,
    }
    out: dict[str, list[float]] = {k: [] for k in options}
    for _ in range(repeats):
        for name, fn in options.items():
            dist.barrier()
            t = torch.tensor(_timed(fn), dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            out[name].append(float(t))
    return {k: statistics.median(v) * 1e3 for k, v in out.items()}


def print0(*args: object) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, flush=True)


def describe_model(cfg: BenchConfig, numel: int) -> str:
    if cfg.model == "gpt":
        what = (f"GPT (examples/gpt) n_layer={cfg.n_layer} n_head={cfg.n_head} n_embd={cfg.n_embd} "
                f"seq_len={cfg.seq_len}, batch/rank={cfg.batch} sequences")
    else:
        what = f"MLP width={cfg.width} depth={cfg.depth}, batch/rank={cfg.batch}"
    return (f"# model: {what}, {numel / 1e6:.2f}M params ({numel * 4 / 2**20:.1f} MiB fp32), "
            f"bucket={cfg.bucket_mb:g} MiB, grad_clip={cfg.grad_clip:g}, steps={cfg.steps} after warmup={cfg.warmup}")


def main(cfg: BenchConfig) -> dict[str, Any]:
    """The timing run, on every rank; prints and returns the results (the same on every rank)."""
    torch.set_num_threads(1)
    load_before = os.getloadavg()[0]
    BATCHES[:] = make_batches(cfg, cfg.warmup + cfg.steps)
    runners = {name: build(cfg) for name, build in contenders().items()}
    numel = runners["bare_all_reduce"].grad_numel
    print0(f"# train_step: world={dist.get_world_size()} (DP), backend={dist.get_backend()}, "
           f"torch {torch.__version__}, threads/rank={torch.get_num_threads()}, cores={os.cpu_count()}")
    print0(describe_model(cfg, numel))
    times = run_interleaved(runners, cfg.steps, cfg.warmup)
    results = {
        "config": asdict(cfg), "params": numel, "world": dist.get_world_size(), "backend": dist.get_backend(),
        "torch": torch.__version__, "cores": os.cpu_count(),
        "times_ms": {n: [t * 1e3 for t in v] for n, v in times.items()},
        "median_ms": {n: statistics.median(v) * 1e3 for n, v in times.items()},
        "state_bytes": {n: runners[n].state_bytes() for n in TRAINERS},
        "collectives_ms": collective_choice(numel, max(cfg.steps // 2, 3)),
    }
    results["load_average"] = [load_before, os.getloadavg()[0]]
    results["ratios"] = report(results)
    return results


def report(r: dict[str, Any]) -> dict[str, Any]:
    """Print the timing tables (rank 0); return the ratios."""
    times, med, state, c = r["times_ms"], r["median_ms"], r["state_bytes"], r["collectives_ms"]
    print0(f"# load average (1 min) before / after the timing run: {r['load_average'][0]:.1f} / "
           f"{r['load_average'][1]:.1f} on {r['cores']} cores")
    print0("\n| contender | median ms | min ms | max ms |\n|---|---:|---:|---:|")
    for n, v in times.items():
        print0(f"| {n} | {med[n]:.2f} | {min(v):.2f} | {max(v):.2f} |")
    print0("\n| ratio | paired median | of medians | target | met |\n|---|---:|---:|---:|:-:|")
    ratios = {}
    for label, a, b, target, higher in PAIRS:
        paired = statistics.median([ta / tb for ta, tb in zip(times[a], times[b])])
        ratios[label] = {"paired_median": paired, "of_medians": med[a] / med[b], "target": target}
        verdict = "- | -"
        if target is not None:
            met = paired >= target if higher else paired <= target
            verdict = f"{'>=' if higher else '<='} {target} | {'PASS' if met else 'MISS'}"
        print0(f"| {label} | {paired:.3f} | {med[a] / med[b]:.3f} | {verdict} |")
    print0("\n| optimizer | state bytes / rank | vs torch AdamW |\n|---|---:|---:|")
    for n, b in state.items():
        print0(f"| {n} | {b:,} | {b / max(state['vemesh_ddp'], 1):.3f} |")
    mib = r["params"] * 4 / 2**20
    print0(f"\n# ZeRO-1 collectives ({r['backend']}, {mib:.1f} MiB, median ms): "
           + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
    rs_ag = (c["reduce_scatter"] + c["all_gather"]) / c["all_reduce"]
    print0(f"# reduce_scatter+all_gather / all_reduce = {rs_ag:.2f}; "
           f"reduce_scatter / all_reduce = {c['reduce_scatter'] / c['all_reduce']:.2f}; "
           f"all_gather / broadcast_shards = {c['all_gather'] / c['broadcast_shards']:.2f}")
    return ratios


# ---------------------------------------------------------------------------------------- memory

def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(f"{field} not in /proc/self/status")


def _page_in(cfg: BenchConfig) -> None:
    """Train a tiny model of the same kind once, so that the first use of torch's code and threads
    (file-backed pages and thread stacks count in RSS) lands in the baseline, not on the first contender."""
    tiny = replace(cfg, n_layer=1, n_head=1, n_embd=8, width=8, depth=1)
    model = build_model(tiny)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    x, y = BATCHES[0]
    if cfg.model == "mlp":
        x, y = x[:, :8], y[:, :8]
    compute_loss(tiny, model, x, y).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    dist.all_reduce(torch.zeros(1024))


def measure_memory(cfg: BenchConfig, name: str) -> dict[str, int | bool]:
    """On every rank of a fresh world: RSS added by building and training ``name`` (KiB)."""
    torch.set_num_threads(1)
    BATCHES[:] = make_batches(cfg, cfg.warmup + cfg.mem_steps)
    _page_in(cfg)
    dist.barrier()
    baseline = _proc_status_kib("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        reset = True
    except OSError:
        reset = False  # VmHWM then also covers the setup; the launcher says so
    runner = contenders()[name](cfg)
    for _ in range(cfg.warmup + cfg.mem_steps):
        runner.step()
    return {"baseline_kib": baseline, "peak_kib": _proc_status_kib("VmHWM") - baseline,
            "end_kib": _proc_status_kib("VmRSS") - baseline, "state_bytes": runner.state_bytes(), "hwm_reset": reset}


# ---------------------------------------------------------------------------------------- launch

def _worker(rank: int, world: int, init_file: str, cfg: BenchConfig, task: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=300))
    try:
        result = main(cfg) if task == "time" else measure_memory(cfg, task)
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, result)
        if rank == 0:
            Path(out_dir, f"{task}.json").write_text(json.dumps(gathered))
    finally:
        dist.destroy_process_group()
    # Skip interpreter teardown: with the contenders' models, hooks and gloo state still alive it
    # occasionally died in C++ ("terminate called without an active exception", SIGABRT) after
    # the results were written. The results are on disk; nothing else needs a clean exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _launch(cfg: BenchConfig, nproc: int, task: str, out_dir: str, start_method: str) -> list[Any]:
    """Run ``task`` on a fresh world of ``nproc`` processes; return every rank's result."""
    # A new rendezvous file each time: the workers skip teardown (os._exit), so the store's file stays.
    init_file = Path(tempfile.mkdtemp(prefix=f"rendezvous-{task}-", dir=out_dir), "store")
    Path(out_dir, f"{task}.json").unlink(missing_ok=True)
    mp.start_processes(_worker, args=(nproc, str(init_file), cfg, task, out_dir), nprocs=nproc,
                       start_method=start_method)
    return json.loads(Path(out_dir, f"{task}.json").read_text())


#: ``MALLOC_MMAP_THRESHOLD_`` for the "mmap" memory runs: every allocation of 64 KiB or more gets its own
#: mmap and goes back to the OS when freed, so RSS follows the live tensors instead of glibc's heap.
MMAP_THRESHOLD = 65536


def memory_table(cfg: BenchConfig, nproc: int, out_dir: str, allocator: str) -> dict[str, Any]:
    """One fresh world per contender.

    ``allocator="glibc"``: forked from the launcher (fast; it has imported torch but run nothing), with
    glibc's default malloc settings, as users run. ``"mmap"``: spawned with ``MALLOC_MMAP_THRESHOLD_``
    set (it must be in the environment when the process starts).
    """
    print(f"\n# memory ({allocator}): a fresh {nproc}-process world per contender, {cfg.warmup}+{cfg.mem_steps} steps "
          "each; RSS over the baseline (process group + data ready), larger rank shown"
          + (f"; MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}" if allocator == "mmap" else ""), flush=True)
    per: dict[str, Any] = {}
    for name in TRAINERS:
        if allocator == "mmap":
            os.environ["MALLOC_MMAP_THRESHOLD_"] = str(MMAP_THRESHOLD)
            try:
                ranks = _launch(cfg, nproc, name, out_dir, "spawn")
            finally:
                del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            ranks = _launch(cfg, nproc, name, out_dir, "fork")
        per[name] = {k: max(r[k] for r in ranks) for k in ("baseline_kib", "peak_kib", "end_kib", "state_bytes")}
        per[name]["hwm_reset"] = all(r["hwm_reset"] for r in ranks)
    if not all(v["hwm_reset"] for v in per.values()):
        print("# warning: /proc/self/clear_refs is not writable here; peaks include the setup", flush=True)
    print("\n| contender | baseline RSS MiB | peak RSS over baseline MiB | RSS after steps over baseline MiB "
          "| optimizer state MiB / rank |\n|---|---:|---:|---:|---:|")
    for name, v in per.items():
        print(f"| {name} | {v['baseline_kib'] / 1024:.1f} | {v['peak_kib'] / 1024:.1f} | {v['end_kib'] / 1024:.1f} "
              f"| {v['state_bytes'] / 2**20:.2f} |", flush=True)
    return per


def parse_args() -> tuple[BenchConfig, int, str | None]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, a few steps: a smoke run")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    parser.add_argument("--json", default=None, help="also write every figure to this JSON file")
    for field, value in asdict(BenchConfig()).items():
        if field == "model":
            parser.add_argument("--model", choices=["gpt", "mlp"], default="gpt")
        elif field == "memory":
            parser.add_argument("--memory", choices=["glibc", "mmap", "both", "none"], default=None,
                                help="per-contender memory runs (default: both; glibc with --quick)")
        else:
            parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args()
    base = PRESETS[(args.model, args.quick)]
    overrides = {f: getattr(args, f) for f in asdict(base) if f != "model" and getattr(args, f) is not None}
    return replace(base, **overrides), args.nproc, args.json


if __name__ == "__main__":
    config, nproc, json_path = parse_args()
    if "RANK" in os.environ:  # torchrun: timing only
        dist.init_process_group("gloo")
        try:
            results = main(config)
            if json_path and dist.get_rank() == 0:
                Path(json_path).write_text(json.dumps(results, indent=1))
        finally:
            dist.destroy_process_group()
    else:
        with tempfile.TemporaryDirectory() as tmp:
            results = _launch(config, nproc, "time", tmp, "spawn")[0]
            for allocator in {"both": ["glibc", "mmap"], "none": []}.get(config.memory, [config.memory]):
                results[f"memory_{allocator}"] = memory_table(config, nproc, tmp, allocator)
        if json_path:
            Path(json_path).write_text(json.dumps(results, indent=1))
