"""Which mesh is fastest: the planner's step time on a calibrated profile, beside the measured step time.

    python bench/plan_time.py --json bench/results/plan_time.json      # calibrate, then every configuration
    python bench/plan_time.py --profile FILE                           # an existing profile (no calibration)

1. ``vemesh calibrate --nproc 4`` measures this machine as a 4-rank gloo job uses it (the profile is written
   beside the results).
2. For each configuration of the Llama-style test model (``test/models/llama_jobs.py``, the user's own factory,
   parallelize function and step) on 4 ranks: ``vemesh plan ... --device-profile PROFILE --json`` predicts the
   step time before launch, then ``torchrun bench/plan_user_run.py --time-steps 20`` runs the same functions
   for 3 warm-up and 20 timed steps (each after a barrier; a step is the slowest rank's) and takes the median.
3. It prints each prediction against its measurement, the rank correlation of the two orders (Spearman), and
   whether the predicted fastest is within 10% of the measured fastest. The issue's targets: every prediction
   within 25% of its measurement, a rank correlation of at least 0.8, the predicted fastest within 10%.

What it does not cover: the GPT example's configurations (its preset is planned by the analytic engine, which has
no time model yet), PP and CP (the traced engine does not plan PP; CP is not in these configurations).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JOBS = "test/models/llama_jobs.py"
BATCH = 8
STEPS = 20
#: name -> (parallelize function, flags of both the plan and the run)
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "dp4-ddp": ("parallelize_ddp", ["--dp-mode", "ddp"]),
    "dp4-zero1": ("parallelize_ddp", ["--dp-mode", "zero1"]),
    "dp4-fsdp2": ("parallelize_fsdp", ["--dp-mode", "fsdp"]),
    "dp2-tp2-zero1": ("parallelize_ddp", ["--tp", "2", "--dp-mode", "zero1"]),
    "dp2-tp2-ddp": ("parallelize_ddp", ["--tp", "2", "--dp-mode", "ddp"]),
    "dp2-tp2-fsdp2": ("parallelize_fsdp", ["--tp", "2", "--dp-mode", "fsdp"]),
}


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    return env


def predicted(parallelize: str, flags: list[str], profile: str) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "vemesh", "plan", "--model", f"module:{JOBS}:make_dense", "--parallelize",
           f"{JOBS}:{parallelize}", "--step", f"{JOBS}:step", "--world-size", "4", "--global-batch-size", str(BATCH),
           "--device-profile", profile, *flags, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env())
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout[: out.stdout.rindex("}") + 1])


def measured(parallelize: str, flags: list[str]) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "time.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4",
               str(ROOT / "bench" / "plan_user_run.py"), "--model", f"module:{JOBS}:make_dense", "--parallelize",
               f"{JOBS}:{parallelize}", "--step", f"{JOBS}:step", "--global-batch-size", str(BATCH),
               "--time-steps", str(STEPS), "--report", str(report), *flags]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=_env())
        if out.returncode or not report.exists():
            raise SystemExit(f"{' '.join(cmd)}\n{out.stdout[-2000:]}\n{out.stderr[-3000:]}")
        return json.loads(report.read_text())["median_step_s"]


def spearman(a: list[float], b: list[float]) -> float:
    """Spearman's rank correlation of two lists without ties (1: the same order)."""
    def ranks(x: list[float]) -> list[int]:
        order = sorted(range(len(x)), key=x.__getitem__)
        out = [0] * len(x)
        for r, i in enumerate(order):
            out[i] = r
        return out
    ra, rb, n = ranks(a), ranks(b), len(a)
    return 1 - 6 * sum((x - y) ** 2 for x, y in zip(ra, rb)) / (n * (n * n - 1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="a device profile to use instead of calibrating")
    parser.add_argument("--only", help="comma-separated configuration names")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()
    profile = args.profile
    if profile is None:
        profile = str(ROOT / "bench" / "results" / "profile-calibrated-4.json")
        done = subprocess.run([sys.executable, "-m", "vemesh", "calibrate", "--nproc", "4", "--output", profile],
                              capture_output=True, text=True, cwd=ROOT, env=_env())
        if done.returncode:
            raise SystemExit(done.stderr)
        print(done.stdout.strip())
    names = args.only.split(",") if args.only else list(CONFIGS)
    rows = []
    print(f"| configuration | predicted (ms) | measured (ms) | predicted / measured | within 25% |")
    print("|---|---:|---:|---:|:-:|")
    for name in names:
        parallelize, flags = CONFIGS[name]
        plan = predicted(parallelize, flags, profile)
        seconds = measured(parallelize, flags)
        ratio = plan["step_time"] / seconds
        rows.append({"name": name, "predicted_s": plan["step_time"], "measured_s": seconds, "ratio": ratio,
                     "time": plan["time"]})
        print(f"| {name} | {plan['step_time'] * 1e3:.1f} | {seconds * 1e3:.1f} | {ratio:.3f} | "
              f"{'PASS' if abs(ratio - 1) <= 0.25 else 'MISS'} |", flush=True)
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]) if len(rows) > 1 else 1.0
    fastest_predicted = min(rows, key=lambda r: r["predicted_s"])
    fastest = min(rows, key=lambda r: r["measured_s"])
    gap = fastest_predicted["measured_s"] / fastest["measured_s"] - 1
    print(f"\nrank correlation (Spearman) {rho:.3f}: {'PASS' if rho >= 0.8 else 'MISS'} (target >= 0.8)")
    print(f"predicted fastest {fastest_predicted['name']} runs {gap * 100:.1f}% slower than the measured fastest "
          f"{fastest['name']}: {'PASS' if gap <= 0.10 else 'MISS'} (target <= 10%)")
    if args.json:
        Path(args.json).write_text(json.dumps({"profile": profile, "rows": rows, "spearman": rho,
                                               "fastest_gap": gap}, indent=2) + "\n")


if __name__ == "__main__":
    main()
