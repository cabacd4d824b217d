"""A real run of the user's own functions, measured: the other side of ``vemesh plan --parallelize ... --step ...``.

Launched by ``bench/plan_accuracy.py`` under torchrun, with the planner's flags. It does what a training script
of the user's would: build the mesh with ``ParallelDims``, call the factory and the parallelize function, make
the optimizer ``--dp-mode`` names, and train 3 steps (``zero_grad``, the step per micro-batch with ``no_sync``
but on the last, or on none with ``--gradient-sync each``, ``optimizer.step``), inside vemesh's ``RunMeter`` (torch's MemTracker, and the collectives
by mesh dim). Rank 0 writes the report; with MoE it also writes the run's expert load: the busiest EP rank's
arriving slots over the slots it sent (the balanced share), the largest of any layer and step.

    torchrun --nproc_per_node 4 bench/plan_user_run.py --model module:test/models/llama_jobs.py:make_dense \\
        --parallelize test/models/llama_jobs.py:parallelize_fsdp --step test/models/llama_jobs.py:step --tp 2 \\
        --global-batch-size 8 --report /tmp/report.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from vemesh import VESCALE_DEVICE_MESH as mesh  # noqa: E402
from vemesh.parallel import ParallelDims  # noqa: E402
from vemesh.planning.measure import RunMeter, report  # noqa: E402
from vemesh.planning.user_code import resolve  # noqa: E402

STEPS = 3


def _expert_load() -> dict[str, float]:
    """Wrap ExpertParallel's dispatch to keep the largest arrivals / sent of this rank."""
    import vemesh.parallel.experts.style as style

    real, seen = style.dispatch, {"load": 0.0}

    def dispatch(tokens, counts, group):  # type: ignore[no-untyped-def]
        out = real(tokens, counts, group)
        seen["load"] = max(seen["load"], sum(out[2].recv) / max(1, sum(out[2].send)))
        return out

    style.dispatch = dispatch
    return seen


def _train_step(model, optimizer, step, per_dp: int, mbs: int, fsdp: bool, each: bool = False) -> None:
    optimizer.zero_grad()
    if isinstance(model, _Pipeline):  # torch's schedule runs the micro-batches
        step(model.schedule, per_dp)
        optimizer.step()
        return
    for i in range(per_dp // mbs):
        last = each or i == per_dp // mbs - 1  # --gradient-sync each: every micro-batch averages its gradients
        composable = hasattr(model, "set_requires_gradient_sync")  # FSDP2, torch's composable replicate
        if composable:
            model.set_requires_gradient_sync(last)
        with model.no_sync() if not last and not composable else contextlib.nullcontext():
            step(model, mbs)
    optimizer.step()


class _Pipeline:
    """With PP: the stages the parallelize function returned and torch's schedule over them."""

    def __init__(self, stages, schedule) -> None:
        self.stages, self.schedule = stages, schedule
        self.parts = [s.submod for s in stages]


def _build(args, factory, parallelize, loss=None, n_microbatches: int = 1):
    """The user's model through their parallelize function (with PP: its stages, in torch's ``--pp-schedule``), and
    the optimizer ``--dp-mode`` names."""
    model = parallelize(factory(), mesh)
    if args.pp > 1:
        from vemesh.parallel.schedules import MULTI_STAGE, schedule_class

        stages = model if isinstance(model, (list, tuple)) else [model]
        run = schedule_class(args.pp_schedule)(stages if args.pp_schedule in MULTI_STAGE else stages[0],
                                               n_microbatches, loss_fn=loss)
        model = _Pipeline(stages, run)
    parts = model.parts if isinstance(model, _Pipeline) else [model]
    fsdp = isinstance(parts[0], torch.distributed.fsdp.FSDPModule)
    # as the planner reads the wrappers: ZeRO-1 over vemesh DDP, torch's AdamW over torch's own DDP
    from vemesh.planning.torch_ddp import torch_ddps

    mode = args.dp_mode or ("fsdp" if fsdp else "ddp" if torch_ddps(parts) else "zero1")
    if mode == "zero1":
        from vemesh.optim import DistributedOptimizer

        return model, DistributedOptimizer(torch.optim.AdamW, models=parts), fsdp
    return model, torch.optim.AdamW([p for part in parts for p in part.parameters()]), fsdp


def _seed_data(mesh) -> None:
    """The step functions draw their tokens at random: each data-parallel rank its own, and the ranks that share its
    rows (TP, CP and PP peers) the same ones, as a data loader gives them."""
    torch.manual_seed(1000 + (mesh.lookup_rank("DP") if mesh.layout.has("DP") else 0))


def _time_steps(args, dims, factory, parallelize, step, per_dp: int, mbs: int, build) -> None:
    """Time ``--time-steps`` steps after 3 warm-up steps; rank 0 writes the median (slowest rank's) and exits."""
    import statistics
    import time

    torch.manual_seed(0)
    model, optimizer, fsdp = build(args, factory, parallelize)
    _seed_data(mesh)
    times = []
    for i in range(3 + args.time_steps):
        dist.barrier()
        start = time.perf_counter()
        _train_step(model, optimizer, step, per_dp, mbs, fsdp, args.gradient_sync == "each")
        took = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
        dist.all_reduce(took, op=dist.ReduceOp.MAX)
        if i >= 3:
            times.append(took.item())
    if dist.get_rank() == 0:
        Path(args.report).write_text(json.dumps({"median_step_s": statistics.median(times), "steps_s": times}))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag in ("--model", "--parallelize", "--step", "--report"):
        parser.add_argument(flag, required=True)
    for flag, default in (("--pp", 1), ("--cp", 1), ("--tp", 1), ("--ep", 1), ("--dp", None), ("--global-batch-size", 32),
                          ("--micro-batch-size", None), ("--world-size", None)):
        parser.add_argument(flag, type=int, default=default)
    parser.add_argument("--dp-mode", choices=("ddp", "zero1", "fsdp"))
    parser.add_argument("--pp-schedule", default="1f1b")
    parser.add_argument("--gradient-sync", choices=("last", "each"), default="last",
                        help="which micro-batches' backward averages the gradients (as vemesh plan --gradient-sync)")
    parser.add_argument("--keep-dp", action="store_true", help="a DP dim of size 1 too (as the GPT preset's mesh)")
    parser.add_argument("--loss", help="with --pp: loss_fn(output, target) for the schedule, MODULE:FUNCTION")
    parser.add_argument("--expert-load", help="write the run's expert load factor here")
    parser.add_argument("--time-steps", type=int, help="instead of measuring memory: time this many steps after "
                        "3 warm-up steps (each after a barrier; a step's time is the slowest rank's) and write their "
                        "median to --report")
    args = parser.parse_args()

    dist.init_process_group("gloo")
    degrees = {"PP": args.pp, "DP": 0, "CP": args.cp, "TP": args.tp}
    names = tuple(n for n, d in degrees.items() if d != 1) if args.keep_dp else None  # DP (0: the rest) kept
    dims = ParallelDims(dist.get_world_size(), pp=args.pp, cp=args.cp, tp=args.tp, ep=args.ep, mesh_dims=names)
    dims.build("cpu", mesh)
    factory, _ = resolve(args.model, "--model")
    parallelize, _ = resolve(args.parallelize, "--parallelize")
    step, _ = resolve(args.step, "--step")
    loss = resolve(args.loss, "--loss")[0] if args.loss else None
    per_dp = args.global_batch_size // dims.dp
    pp = args.pp
    mbs = args.micro_batch_size or (per_dp // (2 * pp) if pp > 1 and per_dp % (2 * pp) == 0 else per_dp)
    build = functools.partial(_build, loss=loss, n_microbatches=per_dp // mbs)
    if args.time_steps:
        _time_steps(args, dims, factory, parallelize, step, per_dp, mbs, build)
    load = _expert_load()
    meter = RunMeter()
    with meter:
        torch.manual_seed(0)  # the same model on every rank
        model, optimizer, fsdp = build(args, factory, parallelize)
        _seed_data(mesh)
        for _ in range(STEPS):
            with meter.step():
                _train_step(model, optimizer, step, per_dp, mbs, fsdp, args.gradient_sync == "each")
    report(meter, mesh, f"PP rank {mesh.lookup_rank('PP')}" if pp > 1 else "every rank", args.report)
    loads = [None] * dist.get_world_size()
    dist.all_gather_object(loads, load["load"])
    if args.expert_load and dist.get_rank() == 0:
        Path(args.expert_load).write_text(json.dumps({"expert_load": max(loads)}))
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's threads can abort an interpreter's exit ("terminate called without an active exception")


if __name__ == "__main__":
    main()
