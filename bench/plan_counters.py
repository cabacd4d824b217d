"""A timed trace's dispatch modes, now against before: the same plans, side by side in one process.

    python bench/plan_counters.py --json bench/results/plan_counters.json

A timed trace (what a step-time prediction needs) counts FLOPs and memory-bound bytes as it runs. Until 2026-12-01
that took two dispatch modes, torch's ``FlopCounterMode`` beneath vemesh's ``MemoryBoundBytes``; now
``MemoryBoundBytes`` counts the FLOPs itself with torch's formulas, as ``FlopCounterMode`` would beneath it
(each op first offered to its decomposition). Each plan below runs both ways, alternating which goes first, and
prints each way's wall time, their ratio, and whether every counted figure is equal (FLOPs by op, bytes, ops,
compile's counts, the peak: the whole plan's JSON).

Before, too, a third dispatch mode stood on every op of a user-model trace for one op's sake (``_grouped_mm`` in
fp32 on CPU, whose meta kernel refuses it); it is now one of the fake mode's own op implementations
(``vemesh.planning.fake_world.cpu_kernel_shapes``). The "before" column stacks a pass-through dispatch mode of the
same cost in its place.

The plans: the tiny Llama 3 pipelines of ``test/planning/test_pipeline_replay.py`` (every micro-batch traced, no
replay) and the Llama 3 8B preset with compile, Float8 and selective checkpointing (``vemesh plan`` in-process).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from vemesh.planning import fusion, pipeline_plan
from vemesh.planning.measure import FLOP_FORMULAS
from vemesh.planning.step_tracker import NoModules

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "test" / "models"))
from tiny_llama3_pipelines import tiny_pipeline  # noqa: E402  (the tests' pipelines)

#: name -> (schedule, dp mode, global batch, PP, TP); DP 2, micro-batches of 1, a block a stage
PIPELINES = {
    "llama-tiny pp2 interleaved-1f1b fsdp 8 mb": ("interleaved-1f1b", "fsdp", 16, 2, 1),
    "llama-tiny pp4 x tp2 1f1b fsdp 6 mb": ("1f1b", "fsdp", 12, 4, 2),
    "llama-tiny pp2 x tp2 1f1b zero1 4 mb": ("1f1b", "zero1", 8, 2, 2),
}
LLAMA_8B = ["plan", "--model", "llama3:8b,seq_len=2048", "--world-size", "16", "--tp", "2", "--dp-mode", "fsdp",
            "--compile", "--float8", "tensorwise", "--float8-all-gather", "--activation-checkpointing",
            "selective-op", "--global-batch-size", "16", "--micro-batch-size", "1", "--dtype", "bf16",
            "--device-profile", "h100-sxm", "--json"]


@contextmanager
def _two_modes(timed: bool):  # type: ignore[no-untyped-def]
    if not timed:
        yield fusion._Nothing(), fusion._Nothing()
        return
    flops = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
    flops.mod_tracker = NoModules()
    with flops, fusion.MemoryBoundBytes() as moved:  # bytes, ops and fusion; the FLOPs beneath it
        yield flops, moved


class _PassThrough(TorchDispatchMode):
    """Before: the dispatch mode that stood beneath the counters for ``_grouped_mm``'s sake (its test, on every op)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is torch.ops.aten._grouped_mm.default:
            raise AssertionError("no grouped matmul in these plans")
        return func(*args, **(kwargs or {}))


@contextmanager
def _way(before: bool):  # type: ignore[no-untyped-def]
    from vemesh.planning import user_model

    modules = (fusion, user_model)
    saved = [m.step_counters for m in modules]
    shapes = user_model.cpu_kernel_shapes

    @contextmanager
    def with_a_mode():  # type: ignore[no-untyped-def]
        with shapes(), _PassThrough():
            yield

    try:
        for m in modules:
            m.step_counters = _two_modes if before else saved[0]
        user_model.cpu_kernel_shapes = with_a_mode if before else shapes
        yield
    finally:
        for m, s in zip(modules, saved):
            m.step_counters = s
        user_model.cpu_kernel_shapes = shapes


def _pipeline(args: tuple) -> Any:
    fns, kwargs = tiny_pipeline(*args)
    pipeline_plan.REPLAY = False
    counted = pipeline_plan.trace_pipeline(fns, kwargs, [])
    return {r: dataclasses.asdict(c) for r, c in sorted(counted.items())}


def _llama_8b() -> Any:
    import contextlib
    import io

    from vemesh.cli import main

    from vemesh.planning import fit

    fit._traced_llama3.cache_clear()  # a plan asked again traces nothing
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(LLAMA_8B)
    return json.loads(out.getvalue())


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--rounds", type=int, default=2, help="each plan this many times each way")
    opts = parser.parse_args(argv)
    cases = {name: (lambda a=args: _pipeline(a)) for name, args in PIPELINES.items()}
    cases["llama3:8b preset, fsdp x tp2, compile, float8, selective-op"] = _llama_8b
    cases[next(iter(cases))]()  # warm the process (imports, caches) before anything is timed
    rows = []
    for name, run in cases.items():
        times: dict[str, list[float]] = {"now": [], "before": []}
        results = {}
        for r in range(opts.rounds):
            for two in ((False, True) if r % 2 == 0 else (True, False)):
                with _way(two):
                    t0 = time.perf_counter()
                    results[two] = run()
                    times["before" if two else "now"].append(time.perf_counter() - t0)
        one, two = min(times["now"]), min(times["before"])
        rows.append(dict(plan=name, now_s=round(one, 2), before_s=round(two, 2), ratio=round(one / two, 3),
                         equal=json.dumps(results[False], sort_keys=True, default=str)
                         == json.dumps(results[True], sort_keys=True, default=str)))
        print(f"{name:62s} now {one:6.2f} s  before {two:6.2f} s  ratio {one / two:.3f}  "
              f"equal: {rows[-1]['equal']}", flush=True)
    if opts.json:
        opts.json.write_text(json.dumps(rows, indent=1) + "\n")
    if not all(r["equal"] for r in rows):
        raise SystemExit("the two ways counted differently")
    return {"rows": rows}


if __name__ == "__main__":
    main()
