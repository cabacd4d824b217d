"""Replayed micro-batches against tracing every one: the same pipeline plan, side by side in one process.

    python bench/plan_replay.py --json bench/results/plan_replay.json

``vemesh.planning.pipeline_replay`` replays a stage's forward or backward of a micro-batch from the record of two
alike, instead of tracing it again. Each pipeline below is planned both ways (the order alternates, so that neither
way always runs on a warm process): every PP rank through torch's schedule, two steps each. Printed: the wall time
of each way, their ratio, the actions replayed, the PP ranks traced again without replay (a replayed forward whose
backward had no record), whether the two plans agree (the same peak within 4 bytes, and each part's, the same bytes
held by kind, collectives, FLOPs, memory-bound bytes and compile counts), and how far apart their counts of ops
dispatched are.

The pipelines are the tiny Llama 3 of ``test/planning/test_pipeline_replay.py`` (width 32, 2 heads, sequences of 16)
with torchtitan's parallelization (FSDP2 without resharding after forward, as it shards for PP; loss-parallel under
TP), 3 blocks a stage where named, and the GPT preset at 70B width (``--pp 4 --tp 4`` over 1,024 ranks, ZeRO-1, 8
micro-batches of 2, the blocks traced 3 and 4 a stage and the rest added by difference).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path
from typing import Any

from vemesh.planning import pipeline_plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "models"))
from tiny_llama3_pipelines import tiny_pipeline  # noqa: E402  (the tests' pipelines)

#: name -> (schedule, dp mode, global batch, PP, TP, blocks a stage); DP 2, micro-batches of 1
PIPELINES = {
    "llama-tiny pp4 1f1b fsdp 8 mb": ("1f1b", "fsdp", 16, 4, 1, 1),
    "llama-tiny pp8 1f1b fsdp 8 mb, 3 blocks a stage": ("1f1b", "fsdp", 16, 8, 1, 3),
    "llama-tiny pp4 x tp2 1f1b fsdp 6 mb": ("1f1b", "fsdp", 12, 4, 2, 1),
    "llama-tiny pp2 interleaved-1f1b fsdp 8 mb": ("interleaved-1f1b", "fsdp", 16, 2, 1, 1),
    "llama-tiny pp4 1f1b zero1 8 mb": ("1f1b", "zero1", 16, 4, 1, 1),
    "llama-tiny pp2 interleaved-1f1b zero1 6 mb": ("interleaved-1f1b", "zero1", 12, 2, 1, 1),
}
GPT_70B = ["plan", "--model", "gpt:n_layer=80,n_embd=8192,n_head=64,vocab=128256,seq_len=4096", "--world-size", "1024",
           "--pp", "4", "--tp", "4", "--global-batch-size", "1024", "--dtype", "bf16"]


def _llama(schedule: str, mode: str, batch: int, pp: int, tp: int, blocks: int, replay: bool) -> tuple[Any, list]:
    fns, kwargs = tiny_pipeline(schedule, mode, batch, pp, tp, blocks)
    retraced: list[int] = []
    trace_user = pipeline_plan.trace_user

    def counted(*args: Any, **kwargs: Any) -> Any:
        if replay and not kwargs["exchange"].replay:
            retraced.append(kwargs["pp_rank"])
        return trace_user(*args, **kwargs)

    # every PP rank traced both ways: the replay compared alone, not with alike ranks added by difference (whose
    # check the replay's op counts, a few apart, can turn down)
    since = pipeline_plan.RANKS_BY_DIFFERENCE_FROM
    pipeline_plan.REPLAY, pipeline_plan.trace_user, pipeline_plan.RANKS_BY_DIFFERENCE_FROM = replay, counted, 10**9
    notes: list[str] = []
    try:
        counted_ranks = pipeline_plan.trace_pipeline(fns, kwargs, notes)
    finally:
        pipeline_plan.REPLAY, pipeline_plan.trace_user, pipeline_plan.RANKS_BY_DIFFERENCE_FROM = True, trace_user, since
    return counted_ranks, notes, retraced


def _replayed(notes: list[str]) -> tuple[int, int]:
    for note in notes:
        if m := re.search(r"(\d+) of (\d+) stage forwards", note):
            return int(m.group(1)), int(m.group(2))
    return 0, 0


def _agree(a: dict, b: dict) -> bool:
    """The first plan of a process holds 4 bytes more (a scalar made once, then cached), whichever way it traces."""
    def held(c: Any) -> dict:
        return {k: v for k, v in c.held.items() if k != "activations"}

    def parts(c: Any) -> dict:  # each part's peak: what the plans by difference scale
        return {k: p for k, (p, _) in c.phases.items()}

    def near(x: dict, y: dict) -> bool:
        return x.keys() == y.keys() and all(abs(x[k] - y[k]) <= 4 for k in x)

    return all(abs(a[r].peak - b[r].peak) <= 4 and abs(a[r].held["activations"] - b[r].held["activations"]) <= 4 and
               near(parts(a[r]), parts(b[r])) and
               (held(a[r]), a[r].sent, a[r].flops, a[r].memory_bytes, a[r].by_op, a[r].counts, a[r].dtensor_ops) ==
               (held(b[r]), b[r].sent, b[r].flops, b[r].memory_bytes, b[r].by_op, b[r].counts, b[r].dtensor_ops)
               for r in b)


def _ops_apart(a: dict, b: dict) -> float:
    """The largest relative difference of a PP rank's ops dispatched (FakeTensor's device queries and FSDP2's
    profiler marks vary with their caches and state: a record made on a colder cache counts a few more)."""
    return max(abs(a[r].ops - b[r].ops) / b[r].ops for r in b)


def _gpt(replay: bool) -> tuple[dict, float]:
    from vemesh.cli import main as cli
    from vemesh.planning import fit
    import contextlib
    import io

    fit._traced_preset.cache_clear()  # a plan asked again is answered from the cache: trace it again
    pipeline_plan.REPLAY = replay
    out = io.StringIO()
    start = time.perf_counter()
    try:
        with contextlib.redirect_stdout(out):
            cli([*GPT_70B, "--json"])
    except SystemExit as e:
        if e.code:
            raise
    finally:
        pipeline_plan.REPLAY = True
    return json.loads(out.getvalue()), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--skip-gpt", action="store_true", help="leave out the 70B GPT plan (about 2 minutes)")
    args = parser.parse_args()
    rows = []
    print("| pipeline | traced every micro-batch (s) | replayed (s) | ratio | actions replayed | ranks traced again "
          "| plans agree | ops dispatched apart |")
    print("|---|---:|---:|---:|---:|---:|:-:|---:|")
    for i, (name, config) in enumerate(PIPELINES.items()):
        runs = {}
        for replay in ((True, False) if i % 2 else (False, True)):
            start = time.perf_counter()
            runs[replay] = (*_llama(*config, replay), time.perf_counter() - start)
        (fast, notes, retraced, t_fast), (whole, _, _, t_whole) = runs[True], runs[False]
        done, total = _replayed(notes)
        row = dict(name=name, whole_s=t_whole, replayed_s=t_fast, ratio=t_fast / t_whole, replayed=done,
                   actions=total, retraced_ranks=retraced, agree=_agree(fast, whole),
                   ops_apart=_ops_apart(fast, whole))
        rows.append(row)
        print(f"| {name} | {t_whole:.1f} | {t_fast:.1f} | {row['ratio']:.2f} | {done} of {total} | {len(retraced)} | "
              f"{'yes' if row['agree'] else '**NO**'} | {row['ops_apart']:.2%} |", flush=True)
    if not args.skip_gpt:
        (whole, t_whole), (fast, t_fast) = _gpt(False), _gpt(True)
        done, total = _replayed(fast["notes"])
        agree = {k: v for k, v in fast.items() if k != "notes"} == {k: v for k, v in whole.items() if k != "notes"}
        rows.append(dict(name="gpt 70B pp4 x tp4 zero1 8 mb", whole_s=t_whole, replayed_s=t_fast,
                         ratio=t_fast / t_whole, replayed=done, actions=total, agree=agree))
        print(f"| gpt 70B pp4 x tp4 zero1 8 mb (the JSON compared whole) | {t_whole:.1f} | {t_fast:.1f} | "
              f"{t_fast / t_whole:.2f} | {done} of {total} | | {'yes' if agree else '**NO**'} | |", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                         "rows": rows}, indent=1) + "\n")
    if not all(r["agree"] for r in rows):
        sys.exit("a replayed plan differs from the plan that traced every micro-batch")


if __name__ == "__main__":
    main()
