"""The planner's async TP against torchtitan's published async TP table: the speedup of each row, planned and measured.

    python bench/plan_async_tp.py --json bench/results/plan_async_tp.json

pytorch/torchtitan ``benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md`` (June 2025, the same Grand Teton H100s
as the December 2024 table: 96 GB HBM2e, 500 W) trains Llama 3.1 with and without async TP, in bf16 and in two
Float8 recipes, under ``torch.compile``:

* 70B on 256 GPUs, FSDP 32 x TP 8, full activation checkpointing, local batch 16;
* 8B on 64 GPUs, FSDP 8 x TP 8, per-op selective activation checkpointing, local batch 12.

Each configuration is planned with ``vemesh plan --model llama3:SIZE`` on the built-in ``h100-hbm2e-500w`` profile
(published specifications, not measured), with and without ``--async-tp``; the two plans share one trace (the
switches change only the timing). Printed: the predicted and published tokens/s/GPU of each row, and the predicted
and published speedup of async TP. The table's own note: its float8 rowwise baseline was slow for a reason since
fixed (torchtitan issue 1207), which the plan does not model.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from plan_published import plan  # noqa: E402  (the same in-process plan as the December table's)

PROFILE = "h100-hbm2e-500w"
SOURCE = "pytorch/torchtitan benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md"
#: (model, world, flags, global batch, {recipe: (published vanilla TP tokens/s/GPU, async TP)})
CONFIGS = [
    ("llama3:70b", 256, ["--tp", "8", "--activation-checkpointing", "full"], 16 * 32,
     {"bf16": (597.3, 652.4), "tensorwise": (809.8, 942.4), "rowwise": (599.6, 624.8)}),
    ("llama3:8b", 64, ["--tp", "8", "--activation-checkpointing", "selective-op"], 12 * 8,
     {"bf16": (4378, 4809.4), "tensorwise": (5078.1, 5570.1), "rowwise": (3708.5, 3914.9)}),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    print("| model | recipe | predicted TP / async TP tokens/s/GPU | published | ratio TP / async | predicted speedup "
          "| published speedup |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for model, world, flags, batch, recipes in CONFIGS:
        for recipe, (tp, async_tp) in recipes.items():
            switches = ["--compile"] + ([] if recipe == "bf16" else ["--float8", recipe])
            start = time.monotonic()
            got = [batch * 8192 / plan(model, world, [*flags, *switches, *extra], batch, PROFILE)["step_time"] / world
                   for extra in ([], ["--async-tp"])]
            row = {"model": model, "world_size": world, "recipe": recipe, "flags": [*flags, *switches],
                   "global_batch_size": batch, "predicted_tps_per_gpu": got, "published_tps_per_gpu": [tp, async_tp],
                   "predicted_speedup": got[1] / got[0], "published_speedup": async_tp / tp,
                   "plan_seconds": time.monotonic() - start}
            rows.append(row)
            print(f"| {model} | {recipe} | {got[0]:,.0f} / {got[1]:,.0f} | {tp:,.0f} / {async_tp:,.0f} | "
                  f"{got[0] / tp:.2f} / {got[1] / async_tp:.2f} | {row['predicted_speedup']:.3f} | "
                  f"{row['published_speedup']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"source": SOURCE, "profile": PROFILE, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
