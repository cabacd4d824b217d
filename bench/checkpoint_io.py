"""Checkpoint integrity benchmark: save and load time with the CRC-32 checksums against without them.

Run (2 ranks, spawned by the script; BENCHMARKS.md's "Checkpoint checksums" figures come from it):

    OMP_NUM_THREADS=1 python bench/checkpoint_io.py --json bench/results/checkpoint_io.json
    python bench/checkpoint_io.py --quick      # smoke run (a test runs it)

The state is the GPT example's model (ZeRO-1 AdamW after one step) on DP=2. ``vemesh.checkpoint.save``
and ``load`` run unchanged, alternating with runs where the checksum work is replaced by nothing
(the per-rank file reads at save, the verification at load); everything else (DCP's writes with
fsync, the manifest, the rename, the restricted unpickler) is the same on both sides. Rounds
alternate the order, every call starts after a barrier and lasts until its slower rank is done,
and a ratio is the median over rounds of with / without.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from vemesh.models.gpt import GPT, GPTConfig  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from two_ranks import run_on_two_ranks  # noqa: E402

import vemesh.resilience.checkpoint.api as api  # noqa: E402
from vemesh import VESCALE_DEVICE_MESH, checkpoint  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.optim import DistributedOptimizer  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    n_layer: int = 8
    n_embd: int = 512
    rounds: int = 8


QUICK = BenchConfig(n_layer=1, n_embd=64, rounds=2)


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def _without_checksums():
    """Patch out the checksum work (and restore it): names only at save, no verification at load."""
    real_share, real_verify = api.checksum_share, api._verify_checksums
    api.checksum_share = lambda root, names, rank, world: {n: "crc32:00000000" for n in sorted(names)[rank::world]}
    api._verify_checksums = lambda path, manifest: None
    return lambda: (setattr(api, "checksum_share", real_share), setattr(api, "_verify_checksums", real_verify))


def run(cfg: BenchConfig, work: Path) -> dict[str, Any]:
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("DP",))
    torch.manual_seed(0)
    model = DDP(GPT(GPTConfig(n_layer=cfg.n_layer, n_embd=cfg.n_embd, n_head=8, block_size=64)), VESCALE_DEVICE_MESH["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=1e-4)
    opt.zero_grad()
    model(torch.randint(0, 256, (2, 64))).float().mean().backward()
    opt.step()
    times: dict[str, list[float]] = {"save_with": [], "save_without": [], "load_with": [], "load_without": []}
    for i in range(cfg.rounds + 1):
        for with_checksums in ((True, False) if i % 2 == 0 else (False, True)):
            tag = "with" if with_checksums else "without"
            root = work / f"r{i}_{tag}"
            restore = None if with_checksums else _without_checksums()
            try:
                t_save = _timed(lambda: checkpoint.save(root, model=model, optimizer=opt, step=1))
                t_load = _timed(lambda: checkpoint.load(root, model=model, optimizer=opt))
            finally:
                if restore:
                    restore()
            if i > 0:  # round 0 warms up
                times[f"save_{tag}"].append(t_save)
                times[f"load_{tag}"].append(t_load)
            dist.barrier()
            if dist.get_rank() == 0:
                shutil.rmtree(root)
    size = sum(p.numel() * 4 * 3 for p in model.module.parameters())  # weights + two Adam moments, fp32
    result = {"config": asdict(cfg), "world_size": dist.get_world_size(), "state_mib": size / 2**20,
              "median_ms": {k: 1e3 * statistics.median(v) for k, v in times.items()},
              "save_ratio": statistics.median(a / b for a, b in zip(times["save_with"], times["save_without"])),
              "load_ratio": statistics.median(a / b for a, b in zip(times["load_with"], times["load_without"]))}
    VESCALE_DEVICE_MESH.reset()
    return result


TARGET = 1.15  # checksums may cost at most 15% of a save or a load


def verdict(ratio: float) -> str:
    """The bench's verdict on one with / without ratio (timings are for people: the script never fails on a MISS)."""
    return "PASS" if ratio <= TARGET else "MISS"


def report(r: dict[str, Any]) -> str:
    m = r["median_ms"]
    return "\n".join([
        f"# checkpoint_io: world={r['world_size']}, GPT n_layer={r['config']['n_layer']} n_embd={r['config']['n_embd']}, "
        f"{r['state_mib']:.1f} MiB of weights + AdamW state, {r['config']['rounds']} rounds",
        "",
        "| | with checksums (ms) | without (ms) | with / without | target |",
        "|---|---:|---:|---:|---:|",
        f"| save | {m['save_with']:.1f} | {m['save_without']:.1f} | {r['save_ratio']:.3f} | <= {TARGET} "
        f"({verdict(r['save_ratio'])}) |",
        f"| load | {m['load_with']:.1f} | {m['load_without']:.1f} | {r['load_ratio']:.3f} | <= {TARGET} "
        f"({verdict(r['load_ratio'])}) |",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json")
    parser.add_argument("--rounds", type=int)
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else BenchConfig()
    if args.rounds:
        cfg = replace(cfg, rounds=args.rounds)
    with tempfile.TemporaryDirectory() as work:
        result = run_on_two_ranks(run, cfg, Path(work))
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
