"""Pipeline benchmark: a GPT step with PP=2 against PP=1 (DP=2) at the same world size, in one run.

Run (2 ranks, spawned by the script; BENCHMARKS.md's "Pipeline" figures come from it):

    OMP_NUM_THREADS=1 python bench/pipeline_schedules.py --json bench/results/pipeline.json
    python bench/pipeline_schedules.py --quick      # smoke run (a test runs it)

Both sides train the GPT example's model on the same global batch with the example's code:
PP=1 is ``DDP`` on a 2-rank DP mesh with the ZeRO-1 optimizer, each rank running half the
batch; PP=2 cuts the model into 2 stages (``vemesh.models.gpt.cut_stage``) and runs torch's
``ScheduleGPipe`` / ``Schedule1F1B`` with ``m`` micro-batches. Steps of all contenders are
interleaved (the order rotates every round, each step starts after a barrier, a step's time is
the slower rank's), and a ratio is the median over rounds of PP=2 / PP=1 in the same round.

Next to each ratio stands the one that the pipeline bubble alone predicts. With ``p`` stages
and ``m`` micro-batches a stage idles a fraction ``b = (p - 1) / (m + p - 1)`` of the step, so if
the two layouts cost the same apart from that, PP=2 / PP=1 = ``1 / (1 - b)``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

GPT_EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
sys.path.insert(0, str(GPT_EXAMPLE))  # the example's modules import each other by plain name
from data import VOCAB_SIZE, ByteDataset  # noqa: E402
from pipeline import Pipeline  # noqa: E402  (the example's runner of torch's schedules)

from vemesh.models.gpt import GPT, GPTConfig, cut_stage  # noqa: E402
from train import loss_fn  # noqa: E402
from two_ranks import run_on_two_ranks  # noqa: E402

from vemesh import VESCALE_DEVICE_MESH  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.optim import DistributedOptimizer  # noqa: E402


@dataclass(frozen=True)
class BenchConfig:
    """Every field is a ``--flag``."""

    n_layer: int = 8
    n_head: int = 4
    n_embd: int = 256
    seq_len: int = 64
    global_batch: int = 16
    microbatches: tuple[int, ...] = (2, 4, 8)
    steps: int = 12
    warmup: int = 2


QUICK = BenchConfig(n_layer=2, n_head=2, n_embd=32, seq_len=16, global_batch=4, microbatches=(2,), steps=2, warmup=1)


def bubble(p: int, m: int) -> float:
    """Idle fraction of a stage in a GPipe / 1F1B step with ``p`` stages and ``m`` micro-batches."""
    return (p - 1) / (m + p - 1)


def _model(cfg: BenchConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB_SIZE, block_size=cfg.seq_len, n_layer=cfg.n_layer, n_head=cfg.n_head,
                         n_embd=cfg.n_embd))


def _timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    elapsed = torch.tensor(time.perf_counter() - start)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # a step lasts until its slower rank is done
    return elapsed.item()


def run(cfg: BenchConfig) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dataset = ByteDataset(None, max_bytes=500_000, val_fraction=0.1)
    batches = [dataset.get_batch("train", step=i, seed=1337, global_batch_size=cfg.global_batch,
                                 seq_len=cfg.seq_len, dp_rank=0, dp_size=1) for i in range(4)]
    steps: dict[str, Any] = {}

    # PP=1: DP over both ranks, each taking half of the global batch
    dp_mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("DP",))
    dp_model = DDP(_model(cfg), dp_mesh["DP"])
    dp_opt = DistributedOptimizer(torch.optim.AdamW, models=[dp_model], lr=1e-4)
    half = cfg.global_batch // world

    def dp_step(x: torch.Tensor, y: torch.Tensor) -> None:
        dp_opt.zero_grad()
        loss_fn(dp_model(x[rank * half : (rank + 1) * half]), y[rank * half : (rank + 1) * half]).backward()
        dp_opt.step()

    steps["pp1_dp2"] = dp_step

    # PP=2: one stage per rank, the whole global batch in m micro-batches
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (world, 1, 1), mesh_dim_names=("PP", "DP", "TP"))
    for schedule in ("gpipe", "1f1b"):
        for m in cfg.microbatches:
            stage = DDP(cut_stage(_model(cfg), rank, world), VESCALE_DEVICE_MESH["DP"])
            opt = DistributedOptimizer(torch.optim.AdamW, models=[stage], lr=1e-4)
            pipe = Pipeline([stage], [rank], world, schedule, m, loss_fn, torch.device("cpu"))

            def pp_step(x: torch.Tensor, y: torch.Tensor, pipe=pipe, opt=opt) -> None:
                opt.zero_grad()
                pipe.step(x, y)
                opt.step()

            steps[f"pp2_{schedule}_m{m}"] = pp_step

    names = list(steps)
    times: dict[str, list[float]] = {n: [] for n in names}
    for i in range(cfg.warmup + cfg.steps):
        x, y = batches[i % len(batches)]
        order = names[i % len(names):] + names[: i % len(names)]
        for n in order:
            t = _timed(lambda: steps[n](x, y))
            if i >= cfg.warmup:
                times[n].append(t)
    rows = []
    for n in names[1:]:
        m = int(n.rsplit("_m", 1)[1])
        ratios = [a / b for a, b in zip(times[n], times["pp1_dp2"])]
        predicted = 1 / (1 - bubble(world, m))
        rows.append({"contender": n, "microbatches": m, "bubble": bubble(world, m), "predicted_ratio": predicted,
                     "measured_ratio": statistics.median(ratios), "median_ms": 1e3 * statistics.median(times[n])})
    VESCALE_DEVICE_MESH.reset()
    return {"config": asdict(cfg), "world_size": world, "pp1_dp2_median_ms": 1e3 * statistics.median(times["pp1_dp2"]),
            "rows": rows, "torch": torch.__version__}


def report(result: dict[str, Any]) -> str:
    cfg = result["config"]
    lines = [
        f"# pipeline: world={result['world_size']}, GPT n_layer={cfg['n_layer']} n_embd={cfg['n_embd']} "
        f"seq_len={cfg['seq_len']}, global batch {cfg['global_batch']}, {cfg['steps']} timed rounds",
        f"# PP=1 (DP=2, ZeRO-1): median {result['pp1_dp2_median_ms']:.1f} ms per step",
        "",
        "| PP=2 schedule | m | bubble (p-1)/(m+p-1) | predicted PP2/PP1 = 1/(1-bubble) | measured PP2/PP1 | median ms |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in result["rows"]:
        schedule = r["contender"].split("_")[1]
        lines.append(f"| {schedule} | {r['microbatches']} | {r['bubble']:.3f} | {r['predicted_ratio']:.3f} | "
                     f"{r['measured_ratio']:.3f} | {r['median_ms']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tiny smoke run")
    parser.add_argument("--json", help="also write the result here")
    for name, value in asdict(BenchConfig()).items():
        if name != "microbatches":
            parser.add_argument(f"--{name.replace('_', '-')}", type=type(value))
    parser.add_argument("--microbatches", help="comma-separated, e.g. 2,4,8")
    args = parser.parse_args(argv)
    cfg = QUICK if args.quick else BenchConfig()
    overrides = {k: v for k, v in vars(args).items() if k in asdict(cfg) and v is not None}
    if "microbatches" in overrides:
        overrides["microbatches"] = tuple(int(m) for m in overrides["microbatches"].split(","))
    cfg = replace(cfg, **overrides)
    result = run_on_two_ranks(run, cfg)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
