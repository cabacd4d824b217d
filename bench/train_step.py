"""Training-step benchmark: vemesh DDP / DistributedOptimizer against torch's own, at DP=2.

Run (2 ranks, spawned by the script; the figures in BENCHMARKS.md come from the first line):

    OMP_NUM_THREADS=1 python bench/train_step.py
    python bench/train_step.py --quick                       # smoke run, a few seconds (a test runs it)
    OMP_NUM_THREADS=1 python bench/train_step.py --width 2048 --depth 4 --steps 20

Under ``torchrun --nproc-per-node 2 bench/train_step.py`` it uses torchrun's ranks instead.

Every contender trains the same MLP from the same initial weights on the same data. Steps are
interleaved (contender order rotates each step), each step starts after a barrier, and a
step's time is the slowest rank's. We report the median over ``--steps`` steps after
``--warmup``. Pairs and targets:

* vemesh DDP (+ torch AdamW) vs ``torch.nn.parallel.DistributedDataParallel`` (+ AdamW), same
  bucket size: target ratio <= 1.05;
* vemesh ``DistributedOptimizer`` vs torch DDP + ``ZeroRedundancyOptimizer``: target <= 1.0;
* gradient sync (``finish_grad_sync()`` after a backward, nothing overlapped) vs a bare
  ``all_reduce`` of the same number of bytes: target bare/sync >= 0.8;
* optimizer-state bytes per rank for each optimizer;
* the ZeRO-1 collective choice on this backend: reduce-scatter vs all-reduce for gradients,
  all-gather vs one broadcast per rank for parameters.

To add a contender (e.g. FSDP2), write a ``build_*`` function returning a :class:`Runner` and
add it to :func:`contenders`; to add a model, extend :func:`build_model`.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.distributed.optim import ZeroRedundancyOptimizer

from vemesh.ddp import DistributedDataParallel as VeDDP
from vemesh.optim import DistributedOptimizer


@dataclass(frozen=True)
class BenchConfig:
    """What to train and how long to time it."""

    width: int = 1024
    depth: int = 8
    batch: int = 64  # per rank
    steps: int = 15
    warmup: int = 3
    bucket_mb: int = 25  # bucket size for both vemesh (in elements: MiB / 4) and torch DDP
    lr: float = 1e-4

    @property
    def bucket_elems(self) -> int:
        return self.bucket_mb * 1024 * 1024 // 4


QUICK = BenchConfig(width=64, depth=2, batch=8, steps=3, warmup=1, bucket_mb=1)


def build_model(cfg: BenchConfig) -> nn.Module:
    """The benchmark MLP, identical on every rank and for every contender."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(cfg.depth):
        layers += [nn.Linear(cfg.width, cfg.width), nn.ReLU()]
    return nn.Sequential(*layers)


@dataclass
class Runner:
    """One contender: ``step()`` returns the seconds to count; ``state_bytes()`` its optimizer state."""

    step: Callable[[], float]
    state_bytes: Callable[[], int]
    grad_numel: int = 0


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t))


def _data(cfg: BenchConfig) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank())
    return torch.randn(cfg.batch, cfg.width, generator=g), torch.randn(cfg.batch, cfg.width, generator=g)


def _timed(fn: Callable[[], None]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def build_vemesh_ddp(cfg: BenchConfig) -> Runner:
    model = VeDDP(build_model(cfg), overlap_grad_reduce=True, bucket_size=cfg.bucket_elems)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    x, y = _data(cfg)

    def step() -> None:
        model.zero_grad_buffer()
        F.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        opt.step()

    return Runner(lambda: _timed(step), lambda: _state_bytes(opt))


def build_torch_ddp(cfg: BenchConfig) -> Runner:
    model = nn.parallel.DistributedDataParallel(build_model(cfg), bucket_cap_mb=cfg.bucket_mb)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    x, y = _data(cfg)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return Runner(lambda: _timed(step), lambda: _state_bytes(opt))


def build_vemesh_zero(cfg: BenchConfig) -> Runner:
    model = VeDDP(build_model(cfg), overlap_grad_reduce=True, use_distributed_optimizer=True, bucket_size=cfg.bucket_elems)
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=cfg.lr)
    x, y = _data(cfg)

    def step() -> None:
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        model.finish_grad_sync()
        opt.step()

    return Runner(lambda: _timed(step), lambda: _state_bytes(opt.optimizer))


def build_torch_zero(cfg: BenchConfig) -> Runner:
    model = nn.parallel.DistributedDataParallel(build_model(cfg), bucket_cap_mb=cfg.bucket_mb)
    opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.AdamW, lr=cfg.lr)
    x, y = _data(cfg)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        F.mse_loss(model(x), y).backward()
        opt.step()

    return Runner(lambda: _timed(step), lambda: _state_bytes(opt.optim))


def build_vemesh_sync(cfg: BenchConfig) -> Runner:
    """Times only ``finish_grad_sync()``: backward runs first with nothing overlapped."""
    model = VeDDP(build_model(cfg), overlap_grad_reduce=False, bucket_size=cfg.bucket_elems)
    x, y = _data(cfg)
    numel = sum(p.numel() for p in model.parameters())

    def step() -> float:
        model.zero_grad_buffer()
        F.mse_loss(model(x), y).backward()
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
        "vemesh_sync": build_vemesh_sync,
        "bare_all_reduce": build_bare_all_reduce,
    }


# (label, candidate, baseline, target, higher_is_better): ratio = candidate / baseline
PAIRS = [
    ("vemesh DDP / torch DDP (step time)", "vemesh_ddp", "torch_ddp", 1.05, False),
    ("vemesh DistributedOptimizer / ZeroRedundancyOptimizer (step time)", "vemesh_zero", "torch_zero", 1.0, False),
    ("bare all_reduce / vemesh grad sync (fraction of bound)", "bare_all_reduce", "vemesh_sync", 0.8, True),
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
    if dist.get_rank() == 0:
        print(*args, flush=True)


def main(cfg: BenchConfig) -> None:
    torch.set_num_threads(1)
    runners = {name: build(cfg) for name, build in contenders().items()}
    numel = runners["bare_all_reduce"].grad_numel
    print0(f"# train_step: world={dist.get_world_size()} (DP), backend={dist.get_backend()}, torch {torch.__version__}, "
           f"threads/rank={torch.get_num_threads()}, cores={os.cpu_count()}")
    print0(f"# model: MLP width={cfg.width} depth={cfg.depth}, {numel / 1e6:.2f}M params ({numel * 4 / 2**20:.1f} MiB fp32), "
           f"batch/rank={cfg.batch}, bucket={cfg.bucket_mb} MiB, steps={cfg.steps} after warmup={cfg.warmup}")
    times = run_interleaved(runners, cfg.steps, cfg.warmup)
    med = {n: statistics.median(v) * 1e3 for n, v in times.items()}
    print0("\n| contender | median ms | min ms | max ms |\n|---|---:|---:|---:|")
    for n, v in times.items():
        print0(f"| {n} | {med[n]:.2f} | {min(v) * 1e3:.2f} | {max(v) * 1e3:.2f} |")
    print0("\n| ratio | value | target | met |\n|---|---:|---:|:-:|")
    for label, a, b, target, higher in PAIRS:
        ratio = med[a] / med[b]
        met = ratio >= target if higher else ratio <= target
        print0(f"| {label} | {ratio:.3f} | {'>=' if higher else '<='} {target} | {'yes' if met else 'NO'} |")
    print0("\n| optimizer | state bytes / rank | vs torch AdamW |\n|---|---:|---:|")
    full_state = runners["vemesh_ddp"].state_bytes()
    for n in ["vemesh_ddp", "torch_ddp", "vemesh_zero", "torch_zero"]:
        b = runners[n].state_bytes()
        print0(f"| {n} | {b:,} | {b / max(full_state, 1):.3f} |")
    c = collective_choice(numel, max(cfg.steps // 2, 3))
    print0(f"\n# ZeRO-1 collectives ({dist.get_backend()}, {numel * 4 / 2**20:.1f} MiB, median ms): "
           + ", ".join(f"{k} {v:.2f}" for k, v in c.items()))
    print0(f"# reduce_scatter+all_gather / all_reduce = {(c['reduce_scatter'] + c['all_gather']) / c['all_reduce']:.2f}; "
           f"reduce_scatter / all_reduce = {c['reduce_scatter'] / c['all_reduce']:.2f}; "
           f"all_gather / broadcast_shards = {c['all_gather'] / c['broadcast_shards']:.2f}")


def _worker(rank: int, world: int, port: int, cfg: BenchConfig) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=120))
    try:
        main(cfg)
    finally:
        dist.destroy_process_group()


def parse_args() -> tuple[BenchConfig, int]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 3 steps: a smoke run")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn (ignored under torchrun)")
    default = BenchConfig()
    for field, value in asdict(default).items():
        parser.add_argument(f"--{field.replace('_', '-')}", type=type(value), default=None)
    args = parser.parse_args()
    base = QUICK if args.quick else default
    overrides = {f: getattr(args, f) for f in asdict(default) if getattr(args, f) is not None}
    return BenchConfig(**{**asdict(base), **overrides}), args.nproc


if __name__ == "__main__":
    config, nproc = parse_args()
    if "RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            main(config)
        finally:
            dist.destroy_process_group()
    else:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free_port = s.getsockname()[1]
        mp.spawn(_worker, args=(nproc, free_port, config), nprocs=nproc)
