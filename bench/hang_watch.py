"""The cost of the hang watch: the GPT example's step time with ``VEMESH_HANG_DIR`` on (torch's Flight
Recorder on every group, the watchdog thread polling it) against off, side by side in one run.

Run (BENCHMARKS.md's "Hang watch" figure comes from it):

    python bench/hang_watch.py --json bench/results/hang_watch.json
    python bench/hang_watch.py --rounds 1 --steps 8      # a smoke run
    python bench/hang_watch.py --detection --json bench/results/hang_detection.json   # detection, not cost
    python bench/hang_watch.py --detection --burners 2 --runs 0 --stragglers 0 --slow-starts 0 --dead 20 \
        --json bench/results/hang_dead_loaded.json   # dead ranks, with two CPU burners on the machine

Each round runs the example twice on 2 gloo ranks, (DP=1, TP=2): a core each, so that the machine adds the least noise; watch off and on, in an order that
alternates between rounds; a run's step time is the median over its steps after the first 5 (start-up
and warm-up left out), from the example's metrics file. The figure is the median over rounds of
on / off; the target is at most 1.02. Runs of the example differ from each other by more than the watch
costs on these shared machines, so the script also times what the watch adds to each collective:
5000 all-reduces of 1 KiB over the mesh's TP group of 2 ranks, off and on, the same rounds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--n-layer", "2", "--n-embd", "128", "--seq-len", "64", "--global-batch-size", "16", "--eval-every", "0",
        "--sample-tokens", "0", "--log-every", "1000", "--mesh-shape", "1,2"]


def run(watch: bool, steps: int, tmp: Path) -> float:
    """One run of the example; the median seconds per step after the first 5."""
    metrics = tmp / f"m_{watch}_{len(list(tmp.iterdir()))}.jsonl"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("VEMESH_HANG_DIR", None)
    if watch:
        env["VEMESH_HANG_DIR"] = str(tmp / "dumps")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(REPO / "examples" / "gpt" / "train.py"), *ARGS, "--steps", str(steps),
                          "--metrics-file", str(metrics)], cwd=REPO, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the example failed (watch {'on' if watch else 'off'}):\n{out.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    tokens = 16 * 64
    return statistics.median(tokens / r["tokens_per_s"] for r in rows if r["step"] > 5)


def collectives_worker(n: int) -> None:
    """Under torchrun: ``n`` all-reduces of 1 KiB over the mesh's TP group; rank 0 prints microseconds per call."""
    import time

    import torch
    import torch.distributed as dist

    from vemesh import VESCALE_DEVICE_MESH as mesh

    mesh.init_device_mesh("cpu", (1, 2), mesh_dim_names=("DP", "TP"))
    group, x = mesh.get_group("TP"), torch.ones(256)
    for _ in range(200):
        dist.all_reduce(x, group=group)
    start = time.perf_counter()
    for _ in range(n):
        dist.all_reduce(x, group=group)
    took = (time.perf_counter() - start) / n * 1e6
    if dist.get_rank() == 0:
        print(f"us_per_all_reduce {took:.2f}", flush=True)
    dist.barrier()
    os._exit(0)


def collectives(watch: bool, tmp: Path, n: int = 5000) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]))
    env.pop("VEMESH_HANG_DIR", None)
    if watch:
        env["VEMESH_HANG_DIR"] = str(tmp / "dumps")
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", __file__,
                          "--worker", str(n)], cwd=REPO, env=env, capture_output=True, text=True)
    line = next((x for x in out.stdout.splitlines() if x.startswith("us_per_all_reduce")), None)
    if line is None:
        raise SystemExit(f"the collectives worker failed:\n{out.stderr[-3000:]}")
    return float(line.split()[1])


def detection(runs: int, stragglers: int, slow_starts: int = 0, dead: int = 0) -> dict:
    """With the watch's defaults (no VEMESH_HANG_AFTER; test/hangs/hang_job.py's 60 s timeout, 0.1 s steps):

    * the latency from a rank falling asleep (at steps 12 to 30) to the last rank's dump, over ``runs`` runs;
    * over ``stragglers`` runs of each straggler factor (1.5x, 2x, 4x from step 12, 50 steps, a 2 s straggler
      window): the hang reports, which must be none, and the runs whose straggler lines name rank 2, with the median
      factor they gave;
    * over ``slow_starts`` runs of a rank taking 25 s before its first collective: the hang reports (none);
    * over ``dead`` runs of each death (SIGKILL, exit code 137, gloo's abort on a wrong size): the runs in which the
      dead rank is named, and the seconds from its death until the report is printed and every process is gone
      (target: named within 15 s)."""
    sys.path.insert(0, str(REPO / "test" / "hangs"))
    from hang_runs import torchrun  # the test suite's runner: torchrun with the watch on

    job = str(REPO / "test" / "hangs" / "hang_job.py")
    latencies, false, named, slow, deaths = [], {}, {}, 0, {}
    with tempfile.TemporaryDirectory() as tmp:
        def fresh(name: str) -> Path:
            where = Path(tmp) / name
            where.mkdir()
            return where

        def last_dump(where: Path) -> float:
            return max(json.loads(p.read_text())["time_ns"] / 1e9 for p in (where / "dumps").glob("rank-*.json"))

        for i in range(runs):
            at = 12 + (18 * i) // max(1, runs - 1)
            where = fresh(f"sleep{i}")
            _, _, out = torchrun(4, [job, "paced-sleep"], where, after_s=None, HANG_AT_STEP=str(at))
            slept = float(out.split("rank 3 sleeps at ", 1)[1].split()[0])
            latencies.append({"step": at, "seconds": last_dump(where) - slept})
            print(f"asleep at step {at}: named, every dump written, {latencies[-1]['seconds']:.2f} s after", flush=True)
        for factor in (1.5, 2.0, 4.0) if stragglers else ():
            reports, factors = 0, []
            for i in range(stragglers):
                where = fresh(f"straggle{factor}_{i}")
                code, _, out = torchrun(4, [job, "paced-straggle"], where, after_s=None, STRAGGLE_FACTOR=str(factor),
                                        STEPS="50", VEMESH_STRAGGLER_WINDOW="2")
                reports += int(code != 0 or "every rank wrote its dump" in out)
                lines = [x for x in out.splitlines() if x.startswith("vemesh: straggler: rank 2 ")]
                if lines:
                    said = sorted(float(x.split(" is ", 1)[1].split("x slower")[0]) for x in lines)
                    factors.append(said[len(said) // 2])
            false[str(factor)] = reports
            named[str(factor)] = {"named": len(factors), "median_factor": statistics.median(factors) if factors else None}
            print(f"straggler {factor}x: {reports} hang reports in {stragglers} runs; rank 2 named in {len(factors)}, "
                  f"median factor {named[str(factor)]['median_factor']}", flush=True)
        for i in range(slow_starts):
            code, _, out = torchrun(4, [job, "paced-slow-start"], fresh(f"slow{i}"), after_s=None, SLOW_START_S="25")
            slow += int(code != 0 or "every rank wrote its dump" in out)
        if slow_starts:
            print(f"slow start of 25 s: {slow} hang reports in {slow_starts} runs", flush=True)
        for fault, mark, line in (("kill", "rank 2 dies at ", "DEAD: rank 2 (DP=1, TP=0)"),
                                  ("exit137", "rank 2 dies at ", "DEAD: rank 2 (DP=1, TP=0)"),
                                  ("size", "rank 1 sends the wrong size at ", "DIED: rank 0 (DP=0, TP=0)")):
            seconds, wrong = [], 0
            for i in range(dead):
                where = fresh(f"{fault}{i}")
                _, _, out = torchrun(4, [job, fault], where, after_s=None)
                gone = time.time()  # the report printed and every process gone: the strictest end to measure to
                named_dead = {x.split(" (")[0].split(": ")[1] for x in out.splitlines() if x.startswith(("DEAD: ", "DIED: "))}
                wrong += int(named_dead != {line.split(" (")[0].split(": ")[1]})  # a live rank called dead
                if line in out and mark in out:
                    seconds.append(gone - float(out.split(mark, 1)[1].split()[0]))
                else:
                    print(f"{fault} run {i}: not named\n{out[-2000:]}", flush=True)
            if dead:
                deaths[fault] = {"runs": dead, "named": len(seconds), "max_s": max(seconds, default=None),
                                 "within_15_s": sum(x <= 15 for x in seconds), "live_ranks_called_dead": wrong}
                print(f"dead rank ({fault}): named in {len(seconds)} of {dead} runs, within 15 s in "
                      f"{deaths[fault]['within_15_s']}, at most {max(seconds, default=float('nan')):.2f} s; runs naming another "
                      f"rank dead: {wrong}", flush=True)
    if latencies:
        seconds = [x["seconds"] for x in latencies]
        print(f"detection with the defaults: median {statistics.median(seconds):.2f} s, max {max(seconds):.2f} s over "
              f"{runs} runs (target: median <= 10 s, every run <= 15 s; torch alone: its timeout, 600 s by default; "
              f"vemesh's conservative threshold: half of it; NVIDIA's resiliency extension: 60 s)")
    if stragglers:
        print(f"false hangs over {3 * stragglers} straggler runs: {sum(false.values())}")
    return {"latency": latencies, "straggler_reports": false, "stragglers_named": named,
            "slow_start_reports": slow, "slow_starts": slow_starts, "dead": deaths}


def burn(n: int) -> list[subprocess.Popen]:
    """``n`` CPU burners (a busy loop each) for the whole run: the load of a shared machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        return collectives_worker(int(sys.argv[2]))
    if "--detection" in sys.argv:
        parser = argparse.ArgumentParser(description="the hang watch's detection with its defaults")
        parser.add_argument("--detection", action="store_true")
        parser.add_argument("--runs", type=int, default=10)
        parser.add_argument("--stragglers", type=int, default=10, help="runs of each factor (1.5x, 2x, 4x)")
        parser.add_argument("--slow-starts", type=int, default=3, help="runs of a 25 s start")
        parser.add_argument("--dead", type=int, default=0, help="runs of each death (kill, exit 137, gloo's abort)")
        parser.add_argument("--burners", type=int, default=0, help="CPU burners running meanwhile")
        parser.add_argument("--json", help="write the figures here")
        a = parser.parse_args()
        burners = burn(a.burners)
        try:
            found = detection(a.runs, a.stragglers, a.slow_starts, a.dead)
        finally:
            for b in burners:
                b.kill()
        found["burners"] = a.burners
        if a.json:
            Path(a.json).write_text(json.dumps(found, indent=2) + "\n")
        return None
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    if args.steps <= 5:
        parser.error(f"--steps {args.steps}: the first 5 steps are left out; give at least 6")
    rounds = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            times = {watch: run(watch, args.steps, Path(tmp)) for watch in order}
            rounds.append({"off_s": times[False], "on_s": times[True], "ratio": times[True] / times[False]})
            print(f"round {i + 1}: off {times[False] * 1e3:.1f} ms/step, on {times[True] * 1e3:.1f} ms/step, "
                  f"on/off {rounds[-1]['ratio']:.3f}", flush=True)
        calls = []
        for i in range(args.rounds):
            order = (False, True) if i % 2 == 0 else (True, False)
            us = {watch: collectives(watch, Path(tmp)) for watch in order}
            calls.append({"off_us": us[False], "on_us": us[True]})
            print(f"collectives round {i + 1}: 1 KiB all-reduce over TP, off {us[False]:.1f} us, on {us[True]:.1f} us",
                  flush=True)
    ratio = statistics.median(r["ratio"] for r in rounds)
    off_us, on_us = statistics.median(c["off_us"] for c in calls), statistics.median(c["on_us"] for c in calls)
    print(f"hang watch on / off, step time of the GPT example on 2 gloo ranks (TP=2): {ratio:.3f} "
          f"(median of {len(rounds)} rounds, from {min(r['ratio'] for r in rounds):.3f} to "
          f"{max(r['ratio'] for r in rounds):.3f}; target <= 1.02)")
    print(f"one 1 KiB all-reduce over 2 gloo ranks: {off_us:.1f} us off, {on_us:.1f} us on "
          f"({on_us - off_us:+.1f} us a collective: torch's recorder; medians of {len(calls)} rounds)")
    if args.json:
        Path(args.json).write_text(json.dumps({"ratio": ratio, "rounds": rounds, "args": ARGS, "steps": args.steps,
                                               "all_reduce_us": {"off": off_us, "on": on_us, "rounds": calls}}, indent=2)
                                   + "\n")


if __name__ == "__main__":
    main()
