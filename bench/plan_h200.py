"""The planner's built-in ``h200-sxm`` profile against torchtitan's published H200 table: throughput and memory.

    python bench/plan_h200.py --json bench/results/plan_h200.json

pytorch/torchtitan ``benchmarks/llama3_8b_h200_2025-06_torchtitan.md`` (Trainy, June 2025; torch 2.8.0a0, torchao
0afa4c1, torchtitan e7c0cae): Llama 3.1 8B on 4 and 8 hosts of 8 H200s (NVLink inside a host, 400 Gb/s CX-7 RDMA per
GPU), FSDP2 over every GPU, ``llama3_8b.toml`` (sequences of 8192, per-op selective activation checkpointing) with
``--training.local_batch_size=2 --training.compile --model.converters=float8
--float8.enable_fsdp_float8_all_gather --float8.precompute_float8_dynamic_scale_for_fsdp
--float8.force_recompute_fp8_weight_in_bwd``. Its tokens/s/GPU and memory (GiB, the allocator's reserved memory, as
torchtitan logs it) are sampled at step 100.

Each row is planned as issue 51's interface command plans it::

    vemesh plan --model llama3:8b --world-size N --devices-per-host 8 --dtype bf16 --dp-mode fsdp
        --global-batch-size 2N --micro-batch-size 2 --compile --float8 tensorwise --float8-all-gather
        --activation-checkpointing selective-op --device-profile h200-sxm --json

on ``h200-sxm`` (published specifications, not measured). Printed: the predicted and published tokens/s/GPU and
memory, their ratios, and whether the rows' order by throughput is the published one. The plan's peak is the bytes
of live tensors of a bf16 step, eager but for its loss (``--compile`` traces the loss as inductor holds it, and times
the blocks compiled; ``--float8`` is timed, not traced: docs/planning.md);
``force_recompute_fp8_weight_in_bwd`` and ``precompute_float8_dynamic_scale_for_fsdp`` have no flag of their own.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_published import plan, same_order  # noqa: E402  (the same in-process plan as the H100 table's)

PROFILE = "h200-sxm"
SOURCE = "pytorch/torchtitan benchmarks/llama3_8b_h200_2025-06_torchtitan.md"
FLAGS = ["--micro-batch-size", "2", "--compile", "--float8", "tensorwise", "--float8-all-gather",
         "--activation-checkpointing", "selective-op"]
#: (GPUs, published tokens/s/GPU, published GiB)
ROWS = [(32, 10938, 47.96), (64, 10753, 46.97)]
SEQ = 8192


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| GPUs | predicted tokens/s/GPU | published | ratio | predicted GiB | published GiB | ratio | plan s |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for world, tps, gib in ROWS:
        start = time.monotonic()
        doc = plan("llama3:8b", world, FLAGS, 2 * world, PROFILE)
        got_tps, got_gib = 2 * world * SEQ / doc["step_time"] / world, doc["peak"] / 2**30
        row = {"world_size": world, "flags": FLAGS, "global_batch_size": 2 * world, "step_time": doc["step_time"],
               "predicted_tps_per_gpu": got_tps, "published_tps_per_gpu": tps, "tps_ratio": got_tps / tps,
               "predicted_gib": got_gib, "published_gib": gib, "memory_ratio": got_gib / gib,
               "plan_seconds": time.monotonic() - start}
        rows.append(row)
        print(f"| {world} | {got_tps:,.0f} | {tps:,} | {row['tps_ratio']:.3f} | {got_gib:.2f} | {gib:.2f} | "
              f"{row['memory_ratio']:.3f} | {row['plan_seconds']:.0f} |", flush=True)
    order = same_order([r["predicted_tps_per_gpu"] for r in rows], [r["published_tps_per_gpu"] for r in rows])
    print(f"order by throughput as published: {order}")
    if args.json:
        Path(args.json).write_text(json.dumps({"source": SOURCE, "profile": PROFILE, "order_as_published": order,
                                               "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
