"""The parallel run of ``vemesh check``: N gloo processes it starts itself (:func:`run_parallel`, each rank
:func:`_worker`), from the seeds of the one-process run (:mod:`vemesh.check.reference`); what each rank records goes
back to the caller through files in a temporary directory."""

from __future__ import annotations

import json
import logging
import os
import signal
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from vemesh import local_ranks
from vemesh.check.clones import set_clones
from vemesh.check.heads import LocalHeads, counts_of, head_counts, head_tables, set_heads, shard_tables, unsharded, \
    watch_inputs
from vemesh.check.partial import ShardedInput, SummedFeatures, apply, sum_features
from vemesh.check.recipes import Swap, swapped
from vemesh.check.precision import autocast_off, in_full_precision
from vemesh.check.record import (Deterministic, Recorder, column_split_linears, data_parallel, gradients, on_tp,
                                 outside_fsdp, parts, plain_name, quiet_shape_inference, unsynced)
from vemesh.check.result import CheckInputError
from vemesh.check.stuck import Stalls, record_stacks
from vemesh.layout.parallel_dims import ParallelDims
from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
from vemesh.parallel.hf_stages import unchecked
from vemesh.parallel.schedules import MULTI_STAGE, schedule_class, stages_per_rank
from vemesh.parallel.ties import BrokenTieError, tie_groups
from vemesh.parallel import plan_keys, tp_replicas
from vemesh.parallel.tp_split import head_dims
from vemesh.planning.pipeline_trace import pipeline_stages
from vemesh.planning.known_causes import FSDP1_INSTEAD, known_cause
from vemesh.planning.user_code import UserFunctions, compiled_module, on_this_cpu, unbindable, user_frame

__all__ = ["SEED", "Spec", "Timeout", "UserError", "call", "dims", "errors", "functions", "loss_of", "run_parallel"]

#: the first seed: the model's weights; DP rank ``d``'s inputs are drawn from ``seed + 1 + d``
SEED = 1234


@dataclass(frozen=True)
class Spec:
    """What every process of the check needs, picklable: references (or module-level callables) and sizes."""

    model: Any
    parallelize: Any
    step: Any
    model_kwargs: dict[str, Any]
    world_size: int
    degrees: dict[str, int]
    dp_replicate: int
    micro_batch_size: int
    cwd: str
    timeout_s: float
    #: recipes in the place of the plan's own styles (:mod:`vemesh.check.recipes`: the hint's tries)
    swaps: tuple[Swap, ...] = ()
    #: torch's SequenceParallel on modules as built, before the user's parallelize function (:mod:`vemesh.check.partial`)
    sharded: tuple[ShardedInput, ...] = ()
    #: head counts set to this rank's after the user's parallelize function (:mod:`vemesh.check.heads`)
    heads: tuple[LocalHeads, ...] = ()
    #: the modules whose output a forward hook copies (:mod:`vemesh.check.clones`)
    cloned: tuple[str, ...] = ()
    #: SumGradOverTP on features of modules, after the user's parallelize function (:mod:`vemesh.check.partial`)
    summed: tuple[SummedFeatures, ...] = ()
    replica_check: bool = True  #: False: vemesh DDP's and FSDP2's check of the replicas over TP off (their gradients)
    loss: Any = None  #: under PP: the schedule's ``loss_fn(output, target)`` reference
    pp_schedule: str = "1f1b"  #: and the schedule (``--pp-schedule``)
    #: under PP, the model's modules' parameters by name, from the one-process run: a stage's modules are recorded
    #: where they are the model's (:class:`~vemesh.check.record.Recorder`)
    model_params: dict[str, frozenset] | None = None

    @property
    def micro_batches(self) -> int:
        """Under PP, the micro-batches a DP rank's batch is split into: two per stage (every schedule takes that
        many); else 1 (the step runs one micro-batch)."""
        return 2 * self.degrees.get("PP", 1) * stages_per_rank(self.pp_schedule) if self.degrees.get("PP", 1) > 1 else 1


def functions(spec: Spec) -> tuple[Any, Any, Any, tuple[str, str, str]]:
    if spec.parallelize is None:
        raise CheckInputError("--parallelize MODULE:FUNCTION is required: the check compares what it builds with "
                              "one process")
    try:
        fns = UserFunctions.of(spec.model, spec.parallelize, spec.step, spec.loss, spec.pp_schedule)
    except ValueError as e:
        raise CheckInputError(str(e)) from None
    # said here, before any process starts: the parallel run would report it as where the runs differ
    if (wrong := unbindable("--parallelize", fns.names[1], fns.parallelize, "model", "mesh")) is not None:
        raise CheckInputError(wrong)
    return fns.factory, fns.parallelize, fns.step, fns.names


def loss_of(spec: Spec) -> Any:
    """Under PP, the schedule's ``loss_fn`` (``--loss``), resolved; else None."""
    return UserFunctions.of(spec.model, spec.parallelize, spec.step, spec.loss, spec.pp_schedule).loss


def call(what: str, name: str, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
    if (wrong := unbindable(what, name, fn, *args, **kwargs)) is not None:
        raise UserError(wrong)
    try:
        return on_this_cpu(fn, *args, **kwargs)  # a function written for an accelerator runs on this machine's CPU
    except Exception as e:
        said = _raised_by_vemesh(e) or e  # not torch's pipeline stage's own error raised from it
        cause = known_cause(said)
        text = _said(said).rstrip(".!") if cause else _said(said)
        raise UserError(f"{what} {name} failed{user_frame(e)}: {type(said).__name__}: {text}{cause}") from e


def _said(error: BaseException) -> str:
    """``error``'s words on one line: whole when vemesh raised it (its advice comes last: a broken tie's said how to
    parallelize instead), else cut at 400 characters, with '...' where it was cut (torch's can hold a tensor)."""
    text = " ".join(str(error).split())
    return text if type(error).__module__.startswith("vemesh.") or len(text) <= 400 else text[:400] + "..."


class UserError(Exception):
    """A user's function raised: one line naming it."""


def dims(world_size: int, degrees: dict[str, int], dp_replicate: int) -> Any:
    names = tuple(n for n in ("PP", "DP", "CP", "TP") if degrees.get(n, 1) > 1) or None
    return ParallelDims(world_size, pp=degrees.get("PP", 1), dp_replicate=dp_replicate, cp=degrees["CP"],
                        tp=degrees["TP"], ep=degrees["EP"], mesh_dims=names)


def _raised_by_vemesh(error: BaseException) -> BaseException | None:
    """The tie or TP-replica error of vemesh's wrappers in ``error``'s chain of causes, or None: torch's pipeline
    stage raises its own ``RuntimeError`` ("Failed to run stage backward") from what the backward raised."""
    while error is not None and not isinstance(error, (BrokenTieError, tp_replicas.TPReplicaError)):
        error = error.__cause__ or error.__context__
    return error


def _worker(rank: int, spec: Spec, out: str) -> None:
    marks = {"started": time.time()}  # after the spawn and the imports it took to get here
    Path(out, f"started{rank}").touch()  # for the parent: this rank got past its start (api's NOT_STARTED)
    record_stacks(out, rank)  # where it waits, should it not finish when its peers have (vemesh.check.stuck)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(spec.world_size),
                      LOCAL_WORLD_SIZE=str(spec.world_size))
    torch.set_num_threads(1)  # as the one-process run: the same kernels, the same figures run after run
    # gathering a 2-D (FSDP2 x TP) gradient whole warns that it takes two all-gathers: the check's own, not the user's
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # a wrong plan's shape error: ours
    os.chdir(spec.cwd)
    split: list[tuple[str, int, int, int]] = []  # the Linears split as ColwiseParallel splits (for a hint)
    heads: dict[str, tuple[str, dict[str, int], dict[str, int]]] = {}  # the head counts of their scopes (for a hint)
    handed: dict[str, list] = {}  # the tensors each of those scopes was handed (for a hint)
    tables: dict[str, tuple[str, int]] = {}  # what is kept per head, by name: its scope, heads dim (for a hint)
    widths: dict[str, int] = {}  # and their head_dim (for a hint: a TP degree that does not divide the heads)
    failed_in, skipped = None, []  # the module whose forward raised in the step; the plan entries torch skipped
    went: dict[str, list[str]] = {}  # where the plan's ColwiseParallel and RowwiseParallel went (recipes.swapped)
    outputs: dict[tuple[str, int, int], torch.Tensor] = {}  # the step's module outputs so far (their shapes, on error)
    try:
        factory, parallelize, step, names = functions(spec)
        marks["loaded"] = time.time()  # the user's modules imported (a library's model: seconds of its own)
        # the rendezvous through a file of this run's own folder: a port chosen here and bound later by rank 0 could
        # be taken meanwhile (by another run's store, or a gloo connection), and a rank then met another job's store
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(out, 'store')}", rank=rank,
                                world_size=spec.world_size, timeout=timedelta(seconds=spec.timeout_s))
        dims(spec.world_size, spec.degrees, spec.dp_replicate).build("cpu", mesh)
        marks["mesh"] = time.time()
        torch.manual_seed(SEED)
        model = call("--model", names[0], factory, **spec.model_kwargs)
        ties = tie_groups(model)
        apply(spec.sharded, model, mesh["TP"] if spec.sharded else None)
        built = counts_of(model)  # the head counts as built (vemesh.check.heads)
        tables = head_tables(model, built)
        shard_tables(spec.heads, model, mesh)
        tp_replicas.CHECKING = spec.replica_check
        with swapped(spec.swaps, model) as went, plan_keys.skipped_plan_keys() as skipped, unchecked(bool(spec.heads or spec.sharded)):
            model = call("--parallelize", names[1], parallelize, model, mesh)
        stepped = model
        if piped := spec.degrees.get("PP", 1) > 1:  # this PP rank's stages: the step runs torch's schedule over them
            stepped, model = _schedule(spec, model, names[1])
        elif not isinstance(model, torch.nn.Module):
            raise UserError(f"--parallelize {names[1]} returned {type(model).__name__}, not the model (an nn.Module)")
        if any(isinstance(m, FSDP1) for part, _ in parts(model) for m in part.modules()):
            raise UserError(f"--parallelize {names[1]} wrapped torch's FullyShardedDataParallel (FSDP1), which vemesh "
                            f"check does not check (it gathers FSDP2's DTensor shards whole); {FSDP1_INSTEAD}")
        split = column_split_linears(model)
        heads = head_counts(model, split, built)  # as the user's function left them, before a recipe sets them
        widths = head_dims(model, split)
        set_heads(spec.heads, model, mesh)
        handed = watch_inputs(heads, model)  # the tensors each of them is handed, as the step runs
        set_clones(spec.cloned, model)
        lowered = in_full_precision(model)  # FSDP2's mixed precision off: one process computes in fp32
        sum_features(spec.summed, model, mesh)
        params = {plain_name(n): p for part, _ in parts(model) for n, p in part.named_parameters(remove_duplicate=False)}
        tables = unsharded(tables, params)  # those the user's function sharded over TP already are no recipe's
        ends = [[params.get(plain_name(n)) for n in group] for group in ties]  # None: not held here
        # a tie is broken where this rank holds its ends as several parameters; under PP, of the ends it holds (the
        # others are other stages': a tie split across stages)
        broken = [[plain_name(n) for n in group] for group, held in zip(ties, ends)
                  if len({id(p) for p in held if p is not None or not piped}) > 1]
        apart = [[plain_name(n) for n in group] for group, held in zip(ties, ends)
                 if piped and None in held and any(p is not None for p in held)]
        data_rank = mesh.get_local_rank("DP") if mesh.layout.has("DP") else 0
        marks["parallelized"] = time.time()
        torch.manual_seed(SEED + 1 + data_rank)
        # what the user's functions compiled runs eagerly in both runs (its recording hooks are not for dynamo to
        # trace): the check is of the parallelization, not of inductor's code
        with torch.compiler.set_stance("force_eager"), Recorder(model, spec.model_params) as rec, \
                Deterministic(rec) as det, autocast_off(set()):  # both runs in full precision (said from one process)
            outputs = rec.outputs
            try:
                call("--step", names[2], step, stepped, spec.micro_batch_size * spec.micro_batches)
            except UserError as e:
                if not rec.stack:
                    raise
                failed_in = rec.stack[-1]
                raise UserError(f"{e} (in the forward of {rec.stack[-1] or 'the root'})") from e.__cause__
        marks["stepped"], grads = time.time(), gradients(model)  # the step's end, then its gradients gathered
        coords = {n: mesh.get_local_rank(n) for n in mesh.layout.dim_names}
        marks["gathered"] = time.time()
        torch.save({"outputs": rec.outputs, "partial": rec.partial, "grads": grads, "coords": coords,
                    "data_rank": data_rank, "broken": broken, "apart": apart, "split": split, "heads": heads,
                    "handed": handed, "tables": tables, "went": went, "dropouts": det.dropouts, "clips": det.clips,
                    "data_parallel": data_parallel(model), "outside_fsdp": outside_fsdp(model),
                    "unsynced": unsynced(model), "lowered": lowered, "on_tp": on_tp(model),
                    "random_ops": det.random_ops, "marks": marks, "skipped": skipped,
                    "compiled": compiled_module([part for part, _ in parts(model)])},
                   os.path.join(out, f"rank{rank}.pt.part"))
        os.replace(os.path.join(out, f"rank{rank}.pt.part"), os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 -- written for the parent, then raised so that the others stop
        cause = _raised_by_vemesh(e) or (e.__cause__ if isinstance(e, UserError) and e.__cause__ is not None else e)
        kind = ("tie" if isinstance(cause, BrokenTieError) else "tp_replicas" if isinstance(cause, tp_replicas.TPReplicaError)
                else "input" if isinstance(e, CheckInputError) else "user" if isinstance(e, UserError) else "other")
        text = str(e) if isinstance(e, (UserError, CheckInputError)) else f"{type(e).__name__}: {e}"
        # whole or absent: the parent may terminate this process while it writes
        part = os.path.join(out, f"error{rank}.json.part")
        with open(part, "w") as f:
            json.dump({"kind": kind, "message": " ".join(text.split()), "module": failed_in, "split": split,
                       "heads": heads, "handed": handed, "tables": tables, "head_dims": widths, "went": went,
                       "trace": traceback.format_exc(limit=-6), "skipped": skipped,
                       "before_step": "parallelized" not in marks,  # the step not reached
                       # for a hint (vemesh.check.partial): the replicas whose grads differ over TP, each module's output shape
                       "params": [plain_name(n) for n in getattr(cause, "names", [])],
                       "shapes": {k[0]: list(v.shape) for k, v in outputs.items() if k[1:] == (0, 0)}}, f)
        os.replace(part, os.path.join(out, f"error{rank}.json"))
        raise


def _schedule(spec: Spec, returned: Any, name: str) -> tuple[Any, list[torch.nn.Module]]:
    """torch's ``--pp-schedule`` over the stages ``--parallelize`` returned on this PP rank (checked against the
    schedule's placement, as ``vemesh plan`` checks them), and their modules."""
    try:
        stages = pipeline_stages(returned, name, mesh.get_local_rank("PP"), spec.degrees["PP"], spec.pp_schedule)
    except ValueError as e:
        raise UserError(str(e)) from e
    for stage in stages:
        quiet_shape_inference(stage)
    many = spec.pp_schedule in MULTI_STAGE
    run = schedule_class(spec.pp_schedule)(stages if many else stages[0], spec.micro_batches, loss_fn=loss_of(spec))
    return run, [s.submod for s in stages]


#: how long the other ranks get, once one has failed, to end on their own (writing their own error) before SIGTERM
GRACE_S = 5.0


def run_parallel(spec: Spec, out: str) -> tuple[list[int], dict[int, int | None]]:
    """The parallel run of ``spec``, each rank writing its record or its error into ``out``; returns the ranks still
    running 5 s after another had failed, which it stopped (they write neither), and each rank's exit code."""
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "terminating process": ours
    fns = UserFunctions.of(spec.model, spec.parallelize, spec.step, spec.loss, spec.pp_schedule)
    libraries = local_ranks.libraries_of([fns.factory, fns.parallelize, fns.step, fns.loss])  # once, not a rank
    context = local_ranks.start(_worker, (spec, out), spec.world_size, join=False, preload=(__name__, *libraries))
    deadline = time.monotonic() + spec.timeout_s + 60
    stalls = Stalls(out, context.processes, time.monotonic())
    try:
        # on a rank's failure torch's join stops the others; the grace lets each reach and write its own error first
        # (the others' own errors are better words than a SIGTERM; without it, they were SIGTERMed at once and read
        # as ranks gone without a word)
        while not context.join(timeout=1.0, grace_period=GRACE_S):
            if time.monotonic() > deadline:
                raise Timeout(f"the parallel run did not finish in {spec.timeout_s + 60:.0f} s (a hang in the plan "
                               "or the step?); rerun with a longer --timeout, or see docs/debugging-hangs.md")
            if (stuck := stalls.poll()) is not None:
                raise Timeout(stuck)
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass  # the error files say what
    finally:
        grace = time.monotonic() + GRACE_S
        while any(p.is_alive() for p in context.processes) and time.monotonic() < grace:
            time.sleep(0.1)
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        for p in context.processes:
            p.join(5)
        local_ranks.discard_error_files(context)
    return ([rank for rank, p in enumerate(context.processes) if p.exitcode == -signal.SIGTERM],
            {rank: p.exitcode for rank, p in enumerate(context.processes)})


class Timeout(Exception):
    pass


def errors(out: str) -> list[dict[str, str]]:
    found = [json.loads(path.read_text()) for path in sorted(Path(out).glob("error*.json"))]
    order = {"tie": 0, "tp_replicas": 1, "input": 2, "user": 3, "other": 4}
    noise = ("Connection reset", "Connection closed", "Broken pipe", "NCCL", "gloo")
    return sorted(found, key=lambda e: (order[e["kind"]], any(n in e["message"] for n in noise)))
