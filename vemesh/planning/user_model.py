"""Will it fit, for the user's own model: the user's factory, parallelize function and step, run on a fake world.

``vemesh plan --model module:M:FACTORY --parallelize M:FUNCTION --step M:FUNCTION`` (or :func:`vemesh.planning.plan`)
answers with what the user's code does, not with a model of it:

1. a world of the planned size on torch's fake backend, rank 0 of it, with ``VESCALE_DEVICE_MESH`` built by
   :class:`~vemesh.parallel.ParallelDims` for the planned degrees (every derived dim: ``dp_cp``, ``EDP``, ...);
2. under torch's ``FakeTensorMode`` (shapes, no memory, no compute): ``FACTORY()`` on the meta device (as torchtitan
   builds models: an ``init_weights`` with ``trunc_normal_`` is a no-op there), given fake storage, then
   ``FUNCTION(model, VESCALE_DEVICE_MESH)``, which applies whatever the user applies (``parallelize_module``,
   ``context_parallel`` in the step, ``ExpertParallel``, activation checkpointing, FSDP2 or vemesh DDP);
3. the optimizer ``--dp-mode`` names on what the function returned (torch's AdamW, or vemesh's ZeRO-1
   ``DistributedOptimizer`` over the DDP model), and training steps: ``zero_grad``, ``STEP(model, micro_batch_size)``
   per micro-batch (``no_sync`` / FSDP2's gradient sync off but the last; each synced if ``UserFunctions.sync_each``),
   ``BEFORE_OPTIMIZER(model)`` if given (``--before-optimizer``: clipping, a loss all-reduce), ``optimizer.step()``;
4. torch's ``MemTracker`` holds every storage the steps touch (each parameter's local shard, whatever made it; the
   gradients; the optimizer state; the activations) and the peak is taken during the steps, as
   :class:`~vemesh.planning.measure.RunMeter` measures a run; every collective is counted at the dispatcher by the
   mesh name of its group (torch's default group as ``world``).

A model of 8 or more identical blocks (the largest ``ModuleList``/``ModuleDict`` of equal children) is traced with 3
and with 4 of them, and the rest is added by difference, each part of the step on its own
(:mod:`vemesh.planning.step_parts`), so an 80-layer model costs what 4 layers cost. A step of several micro-batches
is traced with 1 and 2, the rest by difference. What the planner cannot see is said in the notes.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

from vemesh.layout.data_dims import data_dims
from vemesh.layout.names import divisors, listed
from vemesh.parallel import fully_shard, plan_keys
from vemesh.parallel.ddp import DistributedDataParallel
from vemesh.parallel.tp_split import column_split_linears, head_dims, uneven_hint
from vemesh.planning.estimate import RankMemory
from vemesh.planning.fake_world import (Held, chunks_on_demand, copies_in_mode, cpu_kernel_shapes, fake_world,
                                       fakes_take_foreach, give_storage, local_shards, real_mesh_tensors, to_bf16)
from vemesh.planning.fusion import step_counters
from vemesh.planning.measure import CollectiveBytes, by_mesh_name, mesh_names, ops_by_mesh_name
from vemesh.planning.step_tracker import StepTracker
from vemesh.planning.pipeline_trace import MetaExchange, build_schedule, pipeline_stages, sends_hold_tensors
from vemesh.planning.results import Counted, MeshFit, RankClass, more_counts, more_ops
from vemesh.planning.routing import routing
from vemesh.planning.stage_signature import tensor_kinds
from vemesh.planning.step_parts import BY_DIFFERENCE_FROM, LOW_HIGH, pipeline_parts, step_parts
from vemesh.planning.library_branches import own_positions, tracing_branches
from vemesh.planning.known_causes import FSDP1_INSTEAD
from vemesh.planning.user_code import (UserFunctions, as_traced, call, compiled_module, fsdp_covers, made_gradients,
                                      idle_dims, sharded_by_fsdp, whole_reshards_only)
from vemesh.planning.torch_ddp import run_as_planned, shapes_not_compared, torch_ddps
from vemesh.planning.user_notes import user_notes
from vemesh.planning.user_optimizer import no_sync, optimizer_for, step_optimizer
from vemesh.planning.user_template import blocks_of, copy_of_template, keep_blocks, repeated_blocks

__all__ = ["predict_user", "stage_signatures", "trace_arguments", "trace_user"]

_MODES = ("ddp", "zero1", "fsdp")
def _data_parallel(parts: list[nn.Module], given: str | None, name: str, mesh: Any) -> tuple[str, list[Any]]:
    """The dp mode the function's wrappers mean, checked against ``--dp-mode``, ``none`` when it wrapped nothing on a
    mesh without data parallelism and none was asked for; and the vemesh DDP modules, if any.
    ``parts`` is the model, or with PP the modules of this rank's stages."""
    if any(isinstance(m, FSDP1) for part in parts for m in part.modules()):
        raise ValueError(f"--parallelize {name} wrapped torch's FullyShardedDataParallel (FSDP1), which the planner "
                         f"does not plan; {FSDP1_INSTEAD}")
    fsdp = sharded_by_fsdp(parts, name)  # refuses FSDP2's CPU offload, which it does not plan
    ddps = [m for part in parts for m in part.modules() if isinstance(m, DistributedDataParallel)]
    torchs = torch_ddps(parts)  # run as they are (vemesh.planning.torch_ddp)
    found = "fsdp" if fsdp else "ddp" if ddps or torchs else None
    grad = data_dims(mesh.layout).grad
    if given == "fsdp" and found is None and (grad is None or mesh.size(grad) == 1):
        raise ValueError(f"--dp-mode fsdp, but the mesh has no data-parallel ranks (DP x CP = 1) for FSDP2 to shard "
                         f"over, and --parallelize {name} wrapped nothing; plan this mesh with --dp-mode ddp (no "
                         "wrapper: the model in --dtype)")
    if given == "fsdp" and found != "fsdp":
        raise ValueError(f"--dp-mode fsdp, but --parallelize {name} did not call fully_shard "
                         f"(it wrapped {'vemesh DDP' if ddps else 'torch DDP' if torchs else 'no data parallelism'}); "
                         "give --dp-mode ddp or zero1, or leave --dp-mode out")
    if found == "fsdp" and grad is not None and mesh.size(grad) > 1:
        fsdp_covers(parts, name, mesh.size(grad), grad)
    if given in ("ddp", "zero1") and found == "fsdp":
        raise ValueError(f"--dp-mode {given}, but --parallelize {name} sharded the model with FSDP2 (fully_shard); "
                         "give --dp-mode fsdp, or leave --dp-mode out")
    if found is None:
        if grad is not None and mesh.size(grad) > 1:
            raise ValueError(f"--parallelize {name} wrapped no data parallelism, but the mesh has "
                             f"{mesh.size(grad)} data-parallel ranks ({grad}) whose "
                             "gradients would never be averaged; wrap the model in vemesh.ddp.DistributedDataParallel "
                             "or vemesh.parallel.fully_shard")
        if given == "zero1":
            raise ValueError(f"--dp-mode zero1 needs vemesh DDP, and --parallelize {name} wrapped none")
        return given or "none", []  # "none": no wrapper (DP x CP = 1), torch's AdamW over what the function returned
    if torchs and not ddps and found == "ddp":
        if given == "zero1":
            raise ValueError(f"--dp-mode zero1 needs vemesh DDP, and --parallelize {name} wrapped torch's "
                             "DistributedDataParallel: give --dp-mode ddp (torch's AdamW over its parameters) or "
                             "leave --dp-mode out, or wrap vemesh.ddp.DistributedDataParallel for ZeRO-1")
        return "ddp", []
    return given or ("fsdp" if fsdp else "zero1"), ddps


def _unknown(counter: Any, mesh: Any) -> str | None:
    """One line for collectives on groups that are none of the mesh's names, or None."""
    known = mesh_names(mesh)  # the mesh's names, and torch's default group
    if (g := next((g for g in counter.bytes if g not in known), None)) is None:
        return None
    ranks = dist.get_process_group_ranks(counter.groups[g])
    return (f"the step ran {', '.join(sorted(counter.ops[g]))} on a group of ranks {ranks[:8]}"
            f"{'...' if len(ranks) > 8 else ''} that is none of the mesh's dims ({', '.join(mesh.layout.names)}) nor the world; "
            "the planner names each collective by its mesh dim: take groups from VESCALE_DEVICE_MESH "
            "(mesh.get_group(name), mesh[name]), or torch's default group")


def trace_user(fns: UserFunctions, *, world_size: int, degrees: dict[str, int], dp_replicate: int = 1,
               micro_batch_size: int, passes: int, dtype: str = "fp32", dp_mode: str | None = None,
               load_factor: float = 1.0, blocks: tuple[str, int] | None = None, timed: bool = False,
               device: str = "cpu", pp_rank: int = 0, exchange: MetaExchange | None = None,
               cut_at_blocks: bool = True, optimizer_implementation: str | None = None) -> Counted:
    """One trace on rank 0 (see the module docstring); ``blocks=(path, k)`` keeps the first ``k`` blocks and (unless
    not ``cut_at_blocks``) cuts each phase at them; ``timed`` also counts what a step-time prediction needs (FLOPs,
    memory-bound bytes, ops: about 10% more tracing).

    With PP, the first rank of PP rank ``pp_rank``: the parallelize function returns its stages, torch's schedule
    for ``fns.pp_schedule`` runs ``passes`` micro-batches of them in each step (``fns.step(schedule, batch)``), and
    the stages' shapes travel through ``exchange`` (:mod:`vemesh.planning.pipeline_trace`)."""
    pp = degrees.get("PP", 1)
    tracker, counter = StepTracker(module_hooks=False), CollectiveBytes(gloo=device == "cpu")
    factory_name, parallelize_name, step_name = fns.names
    with _rank_model(fns, blocks, world_size=world_size, degrees=degrees, dp_replicate=dp_replicate, pp_rank=pp_rank,
                     dtype=dtype, load_factor=load_factor) as (mesh, routed, box):
        model = box.pop()  # the caller's alone: a stage cut from it drops the rest
        with chunks_on_demand(), local_shards(), as_traced(device), tracker, contextlib.ExitStack() as held_sends, \
                tracing_branches() as branches:
            stack = model.get_submodule(blocks[0]) if blocks is not None and pp == 1 else None
            kind = (blocks[0], type(next(model.get_submodule(blocks[0]).children()))) \
                if blocks is not None and cut_at_blocks else None  # no module held
            with plan_keys.skipped_plan_keys() as skipped:
                wrapped = _wrap(fns, model, mesh, degrees, dp_mode)
            if pp > 1:
                stages = pipeline_stages(wrapped, parallelize_name, pp_rank, pp, fns.pp_schedule)
                parts = [stage.submod for stage in stages]
            else:  # the step's peak cut at the blocks kept, each part scaled on its own
                parts = [wrapped]
                held_sends.enter_context(step_parts(tracker, list(stack.children()) if stack is not None else []))
            del model  # the function's result holds what it kept (a stage cut from the model drops the rest)
            cache = held_sends.enter_context(own_positions(parts))  # a model making its own positions packs none
            mode, ddps = _data_parallel(parts, dp_mode, parallelize_name, mesh)
            tracker.on_step_peak = held_now = Held(parts, ddps)
            torchs = torch_ddps(parts)  # torch's own DDPs, run as they are: their buckets are gradients
            run_as_planned(torchs, held_now.buffers, parallelize_name)
            optimizer = optimizer_for(parts, mode, ddps, device, optimizer_implementation)
            held_now.param_buffers = [s.param_data for s in getattr(optimizer, "shards", ())]
            tracker.track_weights(*parts, grads=False)  # built before the tracker: counted as in a run
            if pp > 1:
                run = build_schedule(stages, fns.pp_schedule, passes, fns.loss, exchange)
                replay = exchange.replay_for(stages, tracker, counter, mesh, fns.pp_schedule, pp, pp_rank, passes)
                for context in (sends_hold_tensors(device), pipeline_parts(tracker, stages, kind)):
                    held_sends.enter_context(context)  # each action a phase, cut at its blocks (step_parts)
                steps = (passes, passes)  # a warm-up step (the stages infer their shapes), then the step
            else:
                steps = (1, 1, 2) if passes > 1 else (1, 1)  # a warm-up step, then 1 and 2 micro-batches
            with counter:  # the collectives are counted in the steps; nothing dispatches through it before
                sent: list[dict[str, int]] = []
                ops: list[dict[str, dict[str, tuple[int, int]]]] = []
                flops: list[int] = []
                moved: list[int] = []
                stepped: list[int] = []
                dispatched: list[tuple[int, int]] = []
                counts: list[dict[str, int]] = []
                unwaited: list[tuple[int, int]] = []
                for index, n in enumerate(steps):
                    first = "first " if index == 0 else ""  # the first step's own work (shapes, state) is a part too
                    # every count from zero: a replay's record of an action is the change in each (replay_counters)
                    for by_group in (counter.bytes, counter.calls, counter.ops, counter.by_op):
                        by_group.clear()
                    counter.unwaited()  # from this step's start (measure.CollectiveBytes.unwaited)
                    counter.counting = tracker.in_step = True
                    with step_counters(timed) as (flop_counter, memory_bound):
                        if pp > 1:  # replayed micro-batches advance this step's counters
                            replay.begin_step(flop_counter, memory_bound)
                        optimizer.zero_grad()
                        tracker.phase = first + "step"
                        if pp > 1:  # the schedule splits the batch and runs every micro-batch
                            call("--step", step_name, fns.step, run, n * micro_batch_size)
                        for i in range(n if pp == 1 else 0):
                            with no_sync(wrapped, i == n - 1 or fns.sync_each), _said_uneven_heads(wrapped):
                                call("--step", step_name, fns.step, wrapped, micro_batch_size)
                        if pp == 1 and index == 0:  # a step without its backward would plan a forward alone
                            made_gradients(parts, step_name)
                        if fns.before_optimizer is not None:  # the loop's own end of the step: clipping, a loss
                            # not held to the peak in the warm-up: DTensor's first propagation of a foreach op (a norm
                            # of every gradient) runs it on fakes of every global shape at once, where a run's does not
                            tracker.in_step = index > 0
                            call("--before-optimizer", fns.before_optimizer_name, fns.before_optimizer, wrapped)
                            tracker.in_step = True
                        before = memory_bound.bytes
                        tracker.phase = first + "optimizer"
                        step_optimizer(optimizer, device, fns.names[1], optimizer_implementation)
                        stepped.append(memory_bound.bytes - before)
                    counter.counting = tracker.in_step = False
                    tracker.phase = None
                    sent.append(by_mesh_name(counter.bytes, mesh))
                    ops.append(ops_by_mesh_name(counter.by_op, mesh))
                    flops.append(flop_counter.get_total_flops())
                    moved.append(memory_bound.bytes)
                    dispatched.append((memory_bound.ops, memory_bound.dtensor_ops))
                    counts.append(memory_bound.counts())
                    unwaited.append(counter.unwaited())
                    if (line := _unknown(counter, mesh)) is not None:
                        raise ValueError(line)
                    if index == 0:
                        idle_dims(parts, sent[0], degrees, fns.names)
    phases = {}
    for phase, (peak, kinds, categories) in tracker.phase_peaks.items():
        held = dict(categories, optimizer=kinds.get("Optstate", 0))
        held["activations"] = peak - sum(held.values())
        phases[phase] = (peak, held)
    one = replace(Counted.of_phases(phases, sent[1], mode, routed["used"], flops[1], moved[1], stepped[1],
                                    *dispatched[1], ops[1], counts=counts[1]), largest_buffer=held_now.largest_buffer,
                  compiled=compiled_module(parts), skipped_plan=tuple(sorted(set(skipped))),
                  branches=tuple(sorted(branches)), training_cache=cache.bytes, torch_ddp=bool(torchs),
                  split_graph=pp > 1 and any(hasattr(stage, "pipe_info") for stage in stages),
                  # with PP, what the traced actions left (a replayed action runs no collective)
                  unwaited=unwaited[1] if pp == 1 else max(unwaited, key=lambda u: u[1]))
    if passes > 1 and pp == 1:  # the per-micro-batch bytes and FLOPs by difference; the peak does not grow after 2
        one = replace(one, sent={k: v + (passes - 1) * (sent[2].get(k, 0) - v) for k, v in sent[1].items()},
                      flops=flops[1] + (passes - 1) * (flops[2] - flops[1]),
                      memory_bytes=moved[1] + (passes - 1) * (moved[2] - moved[1]),
                      ops=dispatched[1][0] + (passes - 1) * (dispatched[2][0] - dispatched[1][0]),
                      dtensor_ops=dispatched[1][1] + (passes - 1) * (dispatched[2][1] - dispatched[1][1]),
                      by_op=more_ops(ops[2], ops[1], passes - 2) if passes > 2 else ops[2],
                      counts=more_counts(counts[2], counts[1], passes - 2),
                      unwaited=tuple(a + (passes - 1) * (b - a) for a, b in zip(unwaited[1], unwaited[2])))
    return one


@contextlib.contextmanager
def _said_uneven_heads(model: nn.Module) -> Iterator[None]:
    """A step that raises where TP splits a projection's heads unevenly (2 KV heads over TP 4: each rank part of a
    head) says so after its error, as ``vemesh check`` does (:func:`vemesh.parallel.tp_split.uneven_hint`): a search
    rejects such a mesh with the reason, not the attention's view error alone."""
    try:
        yield
    except ValueError as e:
        split = column_split_linears(model)
        said = uneven_hint(None, split, head_dims(model, split))
        if said is None:
            raise
        raise ValueError(f"{e}; {said}") from e


@contextlib.contextmanager
def _rank_model(fns: UserFunctions, blocks: tuple[str, int] | None, *, world_size: int, degrees: dict[str, int],
                dp_replicate: int, pp_rank: int, dtype: str, load_factor: float) -> Iterator[tuple[Any, Any, list[nn.Module]]]:
    """``(mesh, routing, [model])``: the fake world of the mesh's rank (the first rank of PP rank ``pp_rank``), and in it,
    under fake tensors, the factory's model with its first ``k`` blocks (``blocks=(path, k)``), given storage, in the
    job's dtype, in a list that the caller empties (nothing here holds it then); the parallelize function is the
    caller's to run."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    model = copy_of_template(fns, blocks)  # the factory's model, built once on meta (the factory is called if not)
    with fake_world(world_size, degrees, dp_replicate, keep_dp=fns.keep_dp, pp_rank=pp_rank) as mesh, \
            FakeTensorMode(allow_non_fake_inputs=True) as fake_mode, cpu_kernel_shapes(), copies_in_mode(fake_mode), \
            real_mesh_tensors(), fakes_take_foreach(), routing(load_factor) as routed, warnings.catch_warnings(), \
            whole_reshards_only():
        warnings.simplefilter("ignore")  # your code's warnings are your run's to print, not the plan's
        if model is None:
            with torch.device("meta"):  # as torchtitan builds a model: any __init__ that runs on meta runs here
                model = call("--model", fns.names[0], fns.factory)
            if not isinstance(model, nn.Module):
                raise ValueError(f"--model {fns.names[0]} returned a {type(model).__name__}, not an nn.Module")
            if blocks is not None:  # first, so that only the blocks kept get storage
                keep_blocks(model, *blocks)
        # then fake storage for the parallelize function and the step, as to_empty gives, and in bf16 as a training
        # script's model.to(torch.bfloat16) before it parallelizes (a tensor the factory placed itself, too)
        give_storage(model, dtype=torch.bfloat16 if dtype == "bf16" else None)
        if dtype == "bf16":
            to_bf16(model)
        box, model = [model], None
        yield mesh, routed, box


def stage_signatures(fns: UserFunctions, *, pp_rank: int, world_size: int, degrees: dict[str, int],
                     dp_replicate: int = 1, dtype: str = "fp32", dp_mode: str | None = None, load_factor: float = 1.0,
                     blocks: tuple[str, int] | None = None, **_: Any) -> tuple:
    """What the stages of PP rank ``pp_rank`` are, without a step: for each, whether it is the first or the last, its
    modules' classes, and its parameters' and buffers' classes, shapes, dtypes and placements (no names: a stage cut
    from the model keeps its blocks' numbers). Two PP ranks whose stages are alike by it run alike steps.
    ``trace_user``'s keywords (those for the step are ignored)."""
    with _rank_model(fns, blocks, world_size=world_size, degrees=degrees, dp_replicate=dp_replicate, pp_rank=pp_rank,
                     dtype=dtype, load_factor=load_factor) as (mesh, _, box), chunks_on_demand(), local_shards():
        stages = pipeline_stages(_wrap(fns, box.pop(), mesh, degrees, dp_mode), fns.names[1], pp_rank, degrees["PP"],
                                 fns.pp_schedule)
        return tuple((s.is_first, s.is_last, tuple(type(m).__name__ for m in s.submod.modules()),
                      tensor_kinds(s.submod.parameters()), tensor_kinds(s.submod.buffers())) for s in stages)


def _wrap(fns: UserFunctions, model: nn.Module, mesh: Any, degrees: dict[str, int], dp_mode: str | None) -> nn.Module:
    """The user's parallelize function, or the data parallelism ``--dp-mode`` names when there is none."""
    if fns.parallelize is not None:
        with shapes_not_compared():  # torch's DDP, built as on one rank (vemesh.planning.torch_ddp)
            out = call("--parallelize", fns.names[1], fns.parallelize, model, mesh)
        if degrees.get("PP", 1) > 1:  # the stages: checked by pipeline_stages
            return out
        if not isinstance(out, nn.Module):
            raise ValueError(f"--parallelize {fns.names[1]} returned {type(out).__name__}, not the model (an "
                             "nn.Module); return the model as you wrap it")
        return out
    shard = [n for n in ("TP", "CP", "EP") if degrees[n] > 1]
    if shard:
        raise ValueError(f"{' and '.join(shard)} > 1 need your parallelize function (--parallelize MODULE:FUNCTION): "
                         "the planner shards only what your code shards")
    if not data_dims(mesh.layout).batch:
        return model
    if dp_mode == "fsdp":  # as torchtitan applies it: each block, then the root

        found = repeated_blocks(model)
        for block in (model.get_submodule(found[0]).children() if found else ()):
            fully_shard(block)
        return fully_shard(model)

    return DistributedDataParallel(model)


def batch_split(global_batch_size: int, dp: int, micro_batch_size: int | None, pp: int) -> tuple[int, int]:
    """The sequences per DP rank and the micro-batch (default the DP rank's batch; with PP 2 x PP micro-batches where
    they divide it, else the fewest of at least PP, as torch's 1F1B needs), or a ``ValueError`` that names the value
    and the ones that would do."""
    if global_batch_size % dp:
        near = sorted({max(dp, global_batch_size // dp * dp), -(-global_batch_size // dp) * dp})
        raise ValueError(f"DP {dp} does not divide the global batch of {global_batch_size} sequences: choose a "
                         f"--global-batch-size that is a multiple of {dp} (the nearest: "
                         f"{', '.join(map(str, near))}), or a mesh whose DP divides {global_batch_size}")
    per_dp = global_batch_size // dp
    if micro_batch_size or pp == 1:
        mbs = micro_batch_size or per_dp
    else:
        mbs = per_dp // (2 * pp) if per_dp % (2 * pp) == 0 else \
            max((d for d in divisors(per_dp) if per_dp // d >= pp), default=per_dp)
    if per_dp % mbs:
        choices = listed(divisors(per_dp), 64)
        raise ValueError(f"a micro-batch of {mbs} sequences does not divide the {per_dp} sequences per DP rank "
                         f"(--global-batch-size {global_batch_size} / DP {dp}): choose --micro-batch-size from "
                         f"{choices}")
    return per_dp, mbs


def trace_arguments(*, world_size: int, degrees: dict[str, int], dp_replicate: int = 1, global_batch_size: int,
                    micro_batch_size: int | None, dtype: str, dp_mode: str | None, load_factor: float,
                    timed: bool = False, device: str = "cpu",
                    optimizer_implementation: str | None = None) -> dict[str, Any]:
    """:func:`trace_user`'s keywords: the micro-batch (default the DP rank's batch; with PP 2 x PP of them), checked."""
    per_dp, mbs = batch_split(global_batch_size, degrees["DP"], micro_batch_size, degrees.get("PP", 1))
    return dict(world_size=world_size, degrees=degrees, dp_replicate=dp_replicate, micro_batch_size=mbs,
                passes=per_dp // mbs, dtype=dtype, dp_mode=dp_mode, load_factor=load_factor, timed=timed, device=device,
                optimizer_implementation=optimizer_implementation)


def predict_user(fns: UserFunctions, **job: Any) -> Any:
    """The :class:`~vemesh.planning.fit.MeshFit` of the user's functions on one mesh without PP (one rank class);
    ``job``: :func:`trace_arguments`'. A mesh with PP: :func:`vemesh.planning.pipeline_plan.predict_pipeline`."""
    kwargs = trace_arguments(**job)
    if kwargs["degrees"].get("PP", 1) > 1:
        raise ValueError("a mesh with PP is planned by vemesh.planning.pipeline_plan.predict_pipeline")
    mbs = kwargs["micro_batch_size"]
    degrees = kwargs["degrees"]
    found = blocks_of(fns.factory, fns.names[0])
    notes = []
    counted = None
    if found is not None and found[1] >= BY_DIFFERENCE_FROM:
        path, n = found
        try:
            low, high = (trace_user(fns, blocks=(path, k), **kwargs) for k in LOW_HIGH)
            counted = high.scaled(low, n - LOW_HIGH[1])
            notes.append(f"blocks: {path} holds {n} identical blocks; {LOW_HIGH[0]} and {LOW_HIGH[1]} of them traced, "
                         f"the other {n - LOW_HIGH[1]} added by difference")
        except ValueError as e:  # a forward that counts its blocks itself (range(n_layers)): trace them all
            if not isinstance(e.__cause__, (IndexError, KeyError)):
                raise
            notes.append(f"blocks: {path} holds {n} identical blocks, but the model did not run with {LOW_HIGH[0]} "
                         f"of them ({type(e.__cause__).__name__}); all {n} traced")
    if counted is None:
        counted = trace_user(fns, **kwargs)
    notes += user_notes(counted, kwargs, fns.sync_each)
    held = counted.held
    static = RankMemory("every rank", counted.weights, held["grads"], held["optimizer"], 0)
    return MeshFit(dict(degrees), [RankClass("every rank", static, held["activations"], 0, counted.sent, counted.flops,
                                             counted.memory_bytes, counted.optimizer_bytes, counted.ops,
                                             counted.dtensor_ops, counted.by_op, counted.counts)],
                   kwargs["passes"], mbs, notes=tuple(notes), dp_mode=counted.dp_mode)
