"""A search's estimate of a PP mesh against the plan that traces torch's schedule on every PP rank, side by side.

    python bench/plan_pp_estimate.py --json bench/results/plan_pp_estimate.json

A search over the GPT preset estimates each PP mesh (``vemesh.planning.pipeline_estimate``: one micro-batch per stage
traced, the data-parallel wrapper's work per micro-batch from ``vemesh.planning.wrapper_costs``, the schedule's
action list), where ``vemesh plan --pp N`` traces every PP rank through torch's schedule. Each mesh below is planned
both ways in this process, on 8 ranks with the built-in ``h100-sxm`` profile, and printed: the peak of each way
and their ratio (the largest rank class; and the ratios per PP rank), the step's ratio, the FLOPs' equality, and
the wall time of each way. Two widths: the GPT at width 2048 (8 blocks, sequences of 1024, vocabulary 32768, bf16)
and at width 512 (4 blocks, sequences of 256, vocabulary 4096, fp32), where the wrappers' and the schedule's own ops
are a larger part of the step.
"""

from __future__ import annotations

import argparse
import json
import time

from vemesh.planning.api import time_of
from vemesh.planning.fit import Job, predict
from vemesh.planning.mesh_plan import plan_mesh
from vemesh.planning.profiles import load_profile

#: (DP mode, schedule, PP, TP) on 8 ranks, DP the rest
MESHES = [("zero1", "1f1b", 2, 1), ("fsdp", "1f1b", 4, 1), ("fsdp", "interleaved-1f1b", 2, 2), ("ddp", "gpipe", 2, 1),
          ("zero1", "1f1b", 4, 2), ("fsdp", "1f1b", 2, 2)]
MODELS = {"width 2048, bf16": ("gpt:n_layer=8,n_embd=2048,n_head=16,vocab=32768,seq_len=1024", "bf16"),
          "width 512, fp32": ("gpt:n_layer=4,n_embd=512,n_head=8,vocab=4096,seq_len=256", "fp32")}


def compare(spec: str, dtype: str, mode: str, schedule: str, pp: int, tp: int) -> dict:
    dp = 8 // pp // tp
    job = Job(spec, 16, dp_mode=mode, pp_schedule=schedule, timed=True, dtype=dtype)
    t0 = time.perf_counter()
    traced = predict(job, dp=dp, pp=pp, tp=tp)
    t1 = time.perf_counter()
    estimated = predict(job, dp=dp, pp=pp, tp=tp, trace_pipeline=False)
    t2 = time.perf_counter()
    mesh, profile = plan_mesh(8, pp=pp, dp=dp, cp=1, tp=tp, ep=1), load_profile("h100-sxm")

    def step(fit: object) -> float:
        return max(t.total for t in time_of(fit, mesh, profile, job))

    return {"mode": mode, "schedule": schedule, "PP": pp, "TP": tp, "DP": dp,
            "peak_traced": traced.peak, "peak_estimated": estimated.peak, "peak_ratio": estimated.peak / traced.peak,
            "peak_ratio_per_rank": [e.peak / t.peak for e, t in zip(estimated.classes, traced.classes)],
            "step_traced": step(traced), "step_estimated": step(estimated),
            "step_ratio": step(estimated) / step(traced),
            "flops_equal": [e.flops for e in estimated.classes] == [t.flops for t in traced.classes],
            "traced_s": t1 - t0, "estimated_s": t2 - t1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = {}
    for name, (spec, dtype) in MODELS.items():
        print(f"{name} ({spec})")
        print(f"  {'mesh':38} {'peak ratio':>10} {'step ratio':>10} {'FLOPs':>6} {'traced s':>9} {'estimate s':>10}")
        rows[name] = []
        for mesh in MESHES:
            row = compare(spec, dtype, *mesh)
            rows[name].append(row)
            label = f"{row['mode']} {row['schedule']} PP {row['PP']} x DP {row['DP']} x TP {row['TP']}"
            print(f"  {label:38} {row['peak_ratio']:10.3f} {row['step_ratio']:10.3f} "
                  f"{'equal' if row['flops_equal'] else 'DIFFER':>6} {row['traced_s']:9.1f} {row['estimated_s']:10.1f}",
                  flush=True)
        peaks = [r["peak_ratio"] for r in rows[name]]
        steps = [r["step_ratio"] for r in rows[name]]
        print(f"  peak {min(peaks):.3f} to {max(peaks):.3f}; step {min(steps):.3f} to {max(steps):.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
