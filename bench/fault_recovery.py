"""Recovery from a lost replica: torchft's live path against torchrun's restart + checkpoint load, side by side.

Run (BENCHMARKS.md's "Fault recovery" figures come from it):

    python bench/fault_recovery.py --json bench/results/fault_recovery.json
    python bench/fault_recovery.py --quick      # smoke run (a test runs it)

The same job both ways: the GPT example with TP=2 and 2 data-parallel copies, 4 workers, one global
batch of 8 sequences per step.

* **Live** (``--ft-replica-id``): a torchft lighthouse and two replica groups, each its own
  ``torchrun --nproc_per_node=2`` with TP=2 inside. When replica 1 has logged step K, its torchrun and
  both workers get SIGKILL. Replica 0 keeps its processes: its all-reduce with the dead peer fails, the
  step is not committed, the next quorum (once the lighthouse stops hearing replica 1, after
  ``--heartbeat-ms``) holds replica 0 alone, and it retries the step on the whole batch.
* **Restart** (torchrun's elastic path): one ``torchrun --nproc_per_node=4 --max-restarts=1`` on
  ``(DP=2, TP=2)`` saving a checkpoint after every step (its best case: no step is redone). A worker
  exits at the start of step K+1 (``--fail-at-step``); torchrun stops the others, starts 4 new workers,
  and they load the last checkpoint.

**Recovery time** is measured the same way for both, from the metrics each run writes (wall-clock
``time`` of each committed step): the seconds between the last step committed before the loss and the
next step committed after it. The normal step time is printed beside it.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "examples"))
import ft_scenarios as S  # noqa: E402


def step_gaps(rows: list[dict]) -> list[float]:
    return [b["time"] - a["time"] for a, b in zip(rows, rows[1:]) if b["step"] == a["step"] + 1]


def live(tmp: Path, steps: int, kill_at: int, heartbeat_ms: int) -> dict:
    m0, m1 = tmp / "live0.jsonl", tmp / "live1.jsonl"
    args = [*S.TINY, "--steps", str(steps), "--mesh-shape", "1,2"]
    with S.lighthouse(tmp, heartbeat_ms=heartbeat_ms) as address:
        procs = [S.torchrun([*args, "--ft-lighthouse", address, "--ft-replica-id", str(i), "--metrics-file", str(m)],
                            tmp / f"live{i}.log") for i, m in enumerate((m0, m1))]
        try:
            S.wait_for(m1, kill_at, 180, procs)
            S.kill(procs[1])
            if procs[0].wait(timeout=300) != 0:
                raise SystemExit(f"replica 0 failed:\n{(tmp / 'live0.log').read_text()[-3000:]}")
        finally:
            for p in procs:
                S.kill(p)
    rows = S.records(m0)
    before = max(r["step"] for r in rows if r["participants"] == 2)
    at = {r["step"]: r for r in rows}
    together = [r for r in rows if r["participants"] == 2]
    return {"recovery_s": at[before + 1]["time"] - at[before]["time"], "last_step_before": before,
            "step_s": statistics.median(step_gaps(together)), "pids": sorted({r["pid"] for r in rows}),
            "steps_logged": len(rows)}


def restart(tmp: Path, steps: int, fail_at: int) -> dict:
    metrics, ckpt = tmp / "restart.jsonl", tmp / "ckpt"
    cmd_args = [*S.TINY, "--steps", str(steps), "--mesh-shape", "2,2", "--checkpoint-dir", str(ckpt),
                "--checkpoint-every", "1", "--fail-at-step", str(fail_at), "--metrics-file", str(metrics)]
    proc = S.torchrun(cmd_args, tmp / "restart.log", nproc=4, torchrun_args=["--max-restarts=1"])
    code = proc.wait(timeout=600)
    if code != 0:
        raise SystemExit(f"the restart run failed:\n{(tmp / 'restart.log').read_text()[-3000:]}")
    rows = S.records(metrics)  # the restarted run rewrites the file: the steps up to the checkpoint, then its own
    at = {r["step"]: r for r in rows}
    before = fail_at - 1
    first = [r for r in rows if r["restart"] == 0]
    return {"recovery_s": at[fail_at]["time"] - at[before]["time"], "last_step_before": before,
            "step_s": statistics.median(step_gaps(first)), "restarted": at[fail_at]["restart"] == 1}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (smoke run)")
    parser.add_argument("--heartbeat-ms", type=int, default=1000,
                        help="the lighthouse's --heartbeat_timeout_ms: how long it waits before counting a replica lost")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    steps, at = (16, 6) if args.quick else (30, 10)
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        t0 = time.monotonic()
        a = live(tmp, steps, at, args.heartbeat_ms)
        b = restart(tmp, steps, at + 1)
        wall = time.monotonic() - t0
    ratio = b["recovery_s"] / a["recovery_s"]
    print("GPT example, TP=2 x 2 data-parallel copies (4 gloo workers), global batch 8 x 64 tokens")
    print(f"{'path':<40} {'recovery (s)':>13} {'normal step (s)':>16}")
    print(f"{'live: torchft, lost replica':<40} {a['recovery_s']:>13.2f} {a['step_s']:>16.3f}")
    print(f"{'restart: torchrun + checkpoint load':<40} {b['recovery_s']:>13.2f} {b['step_s']:>16.3f}")
    print(f"restart / live: {ratio:.1f}x (target: at least 5x); lighthouse heartbeat timeout {args.heartbeat_ms} ms; "
          f"replica 0's worker pids {a['pids']} (unchanged); {wall:.0f}s in all")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"live": a, "restart": b, "ratio": ratio, "heartbeat_ms": args.heartbeat_ms,
                                         "steps": steps}, indent=2) + "\n")


if __name__ == "__main__":
    main()
