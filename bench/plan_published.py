"""The planner against torchtitan's published Llama 3.1 table: every row, on two built-in H100 profiles.

    python bench/plan_published.py --json bench/results/plan_published.json
    python bench/plan_published.py --only t1-fsdp,t4-2d          # some rows

Each row of pytorch/torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md`` (18 rows in 6 tables) is planned with
``vemesh plan --model llama3:SIZE[,seq_len=N]``, with the row's mesh, batch, activation checkpointing and switches
(``--compile``, ``--float8 tensorwise``, ``--async-tp``) and hosts of 8, and timed on two built-in profiles from
published specifications (not measured): ``h100-sxm`` (the datasheet's H100 SXM: HBM3 at 3.35 TB/s, 700 W) and
``h100-hbm2e-500w``, the hardware the page names (96 GB HBM2e at 2.4 TB/s, power-limited to 500 W, "the actual peak
TFLOPs number is between SXM and NVL"). A row is traced once, in this process; its second profile reuses the trace.
The predicted tokens/s/GPU is the global batch's tokens over the step over the GPUs; the predicted memory is the
plan's peak (the largest rank class); the step is that of torchtitan's order of the dims (``PP, DP, CP, TP``
outermost first), which its runs used, also where the plan would choose another. Printed beside the published figures, with each ratio, and per table whether
the order of the rows by throughput is the published one.

torchtitan's memory column is read at the 90th step; the plan's peak is the tensors a step holds (no allocator
cache, no NCCL buffers).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

PROFILES = ("h100-sxm", "h100-hbm2e-500w")
SOURCE = "pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md"
#: torchtitan's commit of the table (9dec370, 2024-12-26) compiled the blocks alone: its loss was left eager ("compiling
#: loss function causes CUDA errors, turning off for now", train.py), so its rows compile the model component only
COMPILE_F8 = ["--compile", "model", "--float8", "tensorwise"]
#: torchtitan's 405B config of that commit (train_configs/llama3_405b.toml) also sends FSDP's all-gather in Float8
F8_405B = [*COMPILE_F8, "--float8-all-gather"]

#: (table, row name, model, world, flags, global batch, published TPS/GPU, published memory GiB)
ROWS: list[tuple[str, str, str, int, list[str], int, float, float]] = [
    # Table 1: 8B, FSDP 8, local batch 2, selective activation checkpointing
    ("1", "t1-fsdp", "llama3:8b", 8, ["--activation-checkpointing", "selective-op"], 16, 5762, 82.4),
    ("1", "t1-fsdp-compile", "llama3:8b", 8, ["--activation-checkpointing", "selective-op", "--compile", "model"], 16, 6667, 77.0),
    ("1", "t1-fsdp-compile-float8", "llama3:8b", 8, ["--activation-checkpointing", "selective-op", *COMPILE_F8], 16,
     8532, 76.8),
    # Table 2: 8B, FSDP x CP on 8 GPUs, compile + Float8, local batch 1, full activation checkpointing
    ("2", "t2-fsdp8-cp1-32k", "llama3:8b,seq_len=32768", 8, ["--cp", "1", "--activation-checkpointing", "full",
                                                            *COMPILE_F8], 8, 3890, 83.9),
    ("2", "t2-fsdp4-cp2-64k", "llama3:8b,seq_len=65536", 8, ["--cp", "2", "--activation-checkpointing", "full",
                                                            *COMPILE_F8], 4, 2540, 84.2),
    ("2", "t2-fsdp2-cp4-128k", "llama3:8b,seq_len=131072", 8, ["--cp", "4", "--activation-checkpointing", "full",
                                                              *COMPILE_F8], 2, 1071, 84.0),
    ("2", "t2-fsdp1-cp8-256k", "llama3:8b,seq_len=262144", 8, ["--cp", "8", "--activation-checkpointing", "full",
                                                              *COMPILE_F8], 1, 548, 84.5),
    # Table 3: 8B, FSDP 128, local batch 2, selective activation checkpointing
    ("3", "t3-fsdp", "llama3:8b", 128, ["--activation-checkpointing", "selective-op"], 256, 5605, 67.0),
    ("3", "t3-fsdp-compile", "llama3:8b", 128, ["--activation-checkpointing", "selective-op", "--compile", "model"], 256, 6514,
     62.0),
    ("3", "t3-fsdp-compile-float8", "llama3:8b", 128, ["--activation-checkpointing", "selective-op", *COMPILE_F8], 256,
     8380, 61.8),
    # Table 4: 70B, FSDP 32 x TP 8, compile + Float8, local batch 16, full activation checkpointing
    ("4", "t4-2d", "llama3:70b", 256, ["--tp", "8", "--activation-checkpointing", "full", *COMPILE_F8], 512, 829, 71.9),
    ("4", "t4-2d-async-tp", "llama3:70b", 256, ["--tp", "8", "--activation-checkpointing", "full", *COMPILE_F8,
                                                "--async-tp"], 512, 876, 67.6),
    # Table 5: 405B, FSDP 8 x TP 8 x PP 8, compile + Float8 + async TP, local batch 32, full activation checkpointing.
    # The page names no micro-batch count; torchtitan then (9dec370, 2024/12/26: pipeline_parallel_microbatches None)
    # split a step into as many micro-batches as PP ranks: 8 of 4 sequences (rows planned until 2026-11-27 took 32 of 1)
    ("5", "t5-1f1b", "llama3:405b", 512, ["--tp", "8", "--pp", "8", "--pp-schedule", "1f1b", "--micro-batch-size",
                                         "4", "--activation-checkpointing", "full", *F8_405B, "--async-tp"], 256,
     100, 82.5),
    ("5", "t5-interleaved-1f1b", "llama3:405b", 512, ["--tp", "8", "--pp", "8", "--pp-schedule", "interleaved-1f1b",
                                                     "--micro-batch-size", "4", "--activation-checkpointing", "full",
                                                     *F8_405B, "--async-tp"], 256, 128, 72.7),
    # Table 6: 405B, TP 8 x PP 8 x FSDP x CP, compile + Float8 + async TP + 1F1B, local batch 8, full AC: 8 micro-batches
    # of 1 by the same default
    *[("6", f"t6-fsdp{8 // cp}-cp{cp}-{32 * cp}k", f"llama3:405b,seq_len={32768 * cp}", 512,
       ["--tp", "8", "--pp", "8", "--cp", str(cp), "--pp-schedule", "1f1b", "--micro-batch-size", "1",
        "--activation-checkpointing", "full", *F8_405B, "--async-tp"], 8 * (8 // cp), tps, mem)
      for cp, tps, mem in ((1, 76, 75.3), (2, 47, 75.9), (4, 31, 77.1), (8, 16, 84.9))],
]


def plan(model: str, world: int, flags: list[str], batch: int, profile: str) -> dict[str, Any]:
    """``vemesh plan ... --json``'s document, in this process (a second profile of a row reuses its trace)."""
    from vemesh.cli import build_parser
    from vemesh.planning.api import answer
    from vemesh.planning.request import PlanRequest

    argv = ["plan", "--model", model, "--world-size", str(world), "--dtype", "bf16", "--dp-mode", "fsdp",
            "--devices-per-host", "8", "--device-profile", profile, "--global-batch-size", str(batch), *flags, "--json"]
    return answer(PlanRequest.from_args(build_parser().parse_args(argv))).document()


def same_order(a: list[float], b: list[float]) -> bool:
    return sorted(range(len(a)), key=a.__getitem__) == sorted(range(len(b)), key=b.__getitem__)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated row names")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    only = set(args.only.split(",")) if args.only else None
    rows = []
    print("| table | row | profile | predicted tokens/s/GPU | published | ratio | predicted GiB | published GiB | ratio "
          "| plan s |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for table, name, model, world, flags, batch, tps, mem in ROWS:
        if only is not None and name not in only:
            continue
        seq = int(model.split("seq_len=")[1]) if "seq_len=" in model else 8192
        row: dict[str, Any] = {"table": table, "name": name, "model": model, "world_size": world, "flags": flags,
                               "global_batch_size": batch, "published_tps_per_gpu": tps, "published_gib": mem}
        for profile in PROFILES:
            start = time.monotonic()
            doc = plan(model, world, flags, batch, profile)
            # torchtitan's run had its own order of the dims (PP, DP, CP, TP outermost first): its step, not the
            # step of the order the plan would choose (the two differ where the plan moves a dim onto the network)
            placement = doc.get("placement") or {}
            titan = placement.get("baselines", {}).get("torchtitan", {})
            step = titan.get("step_time", doc["step_time"])
            got = batch * seq / step / world
            peak = doc["peak"] / 2**30
            row[profile] = {"predicted_tps_per_gpu": got, "tps_ratio": got / tps, "step_time": step,
                            "order": titan.get("order"), "chosen_order": placement.get("order"),
                            "chosen_step_time": doc["step_time"], "time_of_chosen_order": doc["time"],
                            "plan_seconds": time.monotonic() - start}
            row.update(predicted_gib=peak, memory_ratio=peak / mem, classes=doc["classes"])
            print(f"| {table} | {name} | {profile} | {got:,.0f} | {tps:,.0f} | {got / tps:.2f} | {peak:.1f} | "
                  f"{mem:.1f} | {peak / mem:.2f} | {row[profile]['plan_seconds']:.0f} |", flush=True)
        rows.append(row)
    orders: dict[str, dict[str, bool]] = {}
    for profile in PROFILES:
        for table in dict.fromkeys(r["table"] for r in rows):
            mine = [r for r in rows if r["table"] == table]
            orders.setdefault(profile, {})[table] = same_order([r[profile]["predicted_tps_per_gpu"] for r in mine],
                                                                [r["published_tps_per_gpu"] for r in mine])
        wrong = [t for t, right in orders[profile].items() if not right]
        within = sum(0.8 <= r[profile]["tps_ratio"] <= 1.2 for r in rows)
        print(f"{profile}: throughput within 20% on {within} of {len(rows)} rows; the order by throughput is the "
              f"published one in {len(orders[profile]) - len(wrong)} of {len(orders[profile])} tables"
              + (f" (not in {', '.join(wrong)})" if wrong else ""))
    print(f"memory within 20%: {sum(0.8 <= r['memory_ratio'] <= 1.2 for r in rows)} of {len(rows)}")
    if args.json:
        Path(args.json).write_text(json.dumps({"source": SOURCE, "profiles": PROFILES, "rows": rows,
                                               "orders": orders}, indent=2) + "\n")


if __name__ == "__main__":
    main()
