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
   per micro-batch (``no_sync`` / FSDP2's gradient sync off but the last), ``optimizer.step()``;
4. torch's ``MemTracker`` holds every storage the steps touch (each parameter's local shard, whatever made it; the
   gradients; the optimizer state; the activations) and the peak is taken during the steps, as
   :class:`~vemesh.planning.measure.RunMeter` measures a run; every collective is counted at the dispatcher by the
   mesh name of its group.

A model whose blocks are identical (the largest ``ModuleList``/``ModuleDict`` of equal children) is traced with 2
and with 3 of them, and the rest is added by difference, so an 80-layer model costs what 3 layers cost. A step of
several micro-batches is traced with 1 and 2, the rest by difference. What the planner cannot see is said in the
notes.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from vemesh.layout.data_dims import data_dims
from vemesh.optim import DistributedOptimizer
from vemesh.parallel import fully_shard
from vemesh.parallel.ddp import DistributedDataParallel
from vemesh.planning.estimate import RankMemory, load_object
from vemesh.planning.fake_world import Held, chunks_on_demand, fake_world, give_storage, real_mesh_tensors, to_bf16
from vemesh.planning.measure import CollectiveBytes, MemoryBoundBytes, StepTracker, by_mesh_name, ops_by_mesh_name
from vemesh.planning.results import Counted, MeshFit, RankClass, more_ops
from vemesh.planning.routing import routing

__all__ = ["UserFunctions", "repeated_blocks", "resolve", "trace_user"]

_MODES = ("ddp", "zero1", "fsdp")


def resolve(ref: Any, flag: str) -> tuple[Callable[..., Any], str]:
    """A callable and its name from ``ref``: a callable, or ``MODULE:FUNCTION`` (``module:`` first for ``--model``)."""
    if callable(ref):
        return ref, f"{getattr(ref, '__module__', '?')}:{getattr(ref, '__qualname__', repr(ref))}"

    text = str(ref)
    body = text.removeprefix("module:") if flag == "--model" else text
    module, colon, name = body.rpartition(":")
    if not colon or not module or not name:
        example = "module:mymodel:make" if flag == "--model" else f"mymodel:{flag.strip('-')}"
        raise ValueError(f"{flag} {text!r}: expected {'module:' if flag == '--model' else ''}MODULE:FUNCTION, a "
                         f"dotted module importable from the current directory or a file path (e.g. {example}, "
                         f"./mymodel.py:{example.rsplit(':', 1)[1]})")
    return load_object(module, name, f"{flag} {text}"), text


@dataclass(frozen=True)
class UserFunctions:
    """The user's three functions and the names they were given by."""

    factory: Callable[[], nn.Module]
    parallelize: Callable[[nn.Module, Any], nn.Module] | None
    step: Callable[[nn.Module, int], Any]
    names: tuple[str, str, str]
    #: the mesh keeps a DP dim of size 1 (as the GPT example's ``--mesh-shape 1,2`` does), not only the dims > 1
    keep_dp: bool = False

    @classmethod
    def of(cls, model: Any, parallelize: Any, step: Any) -> UserFunctions:
        if step is None:
            raise ValueError("--parallelize needs --step MODULE:FUNCTION too: the planner runs your step (one forward "
                             "and backward of a micro-batch) to count the activations")
        (f, fn), (p, pn), (s, sn) = resolve(model, "--model"), (resolve(parallelize, "--parallelize") if parallelize
                                                                else (None, "")), resolve(step, "--step")
        return cls(f, p, s, (fn, pn, sn))


def _signature(module: nn.Module) -> tuple:
    return (tuple((n, type(m).__name__) for n, m in module.named_modules()),
            tuple((n, tuple(p.shape), p.dtype) for n, p in module.named_parameters()),
            tuple((n, tuple(b.shape)) for n, b in module.named_buffers()))


def repeated_blocks(model: nn.Module) -> tuple[str, int] | None:
    """``(path, count)`` of the largest ``ModuleList``/``ModuleDict`` of more than 3 identical children, or None."""
    best: tuple[int, str, int] | None = None
    for path, container in model.named_modules():
        if not isinstance(container, (nn.ModuleList, nn.ModuleDict)) or len(container) <= 3:
            continue
        children = list(container.children())
        if len(children) != len(container) or len({_signature(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in container.parameters())
        if best is None or size > best[0]:
            best = (size, path, len(children))
    return (best[1], best[2]) if best else None


def _keep_blocks(model: nn.Module, path: str, k: int) -> None:
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    container = getattr(parent, attr)
    if isinstance(container, nn.ModuleDict):
        setattr(parent, attr, nn.ModuleDict(dict(list(container.items())[:k])))
    else:
        setattr(parent, attr, nn.ModuleList(list(container)[:k]))


def _user_frame(error: BaseException) -> str:
    """`` at file:line in function`` of the innermost frame outside torch and vemesh (from the current directory
    when it is under it), or ''."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if "/torch/" not in frame.filename and "/vemesh/" not in frame.filename and "<" not in frame.filename:
            where = os.path.relpath(frame.filename)
            return f" at {frame.filename if where.startswith('..') else where}:{frame.lineno} in {frame.name}"
    return ""


def _call(what: str, name: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``; its failure becomes one line naming the function, the user's frame and the exception."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException

    try:
        return fn(*args)
    except (DataDependentOutputException, DynamicOutputShapeException) as e:
        raise ValueError(f"{what} {name} needs a tensor's values{_user_frame(e)} ({e.func}): a plan runs on fake "
                         "tensors, which have shapes but no values; keep .item(), .tolist(), printing and "
                         "value-dependent shapes out of it") from None
    except ValueError as e:
        if str(e).startswith(("--", "the step ran")):
            raise
        raise ValueError(f"{what} {name} failed{_user_frame(e)}: {type(e).__name__}: {e}") from e
    except Exception as e:
        raise ValueError(f"{what} {name} failed{_user_frame(e)}: {type(e).__name__}: {e}") from e


def _data_parallel(model: nn.Module, given: str | None, name: str, mesh: Any) -> tuple[str, Any]:
    """The dp mode the function's wrappers mean, checked against ``--dp-mode``; and the vemesh DDP module, if any."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, torch.nn.parallel.DistributedDataParallel) and not isinstance(model, DistributedDataParallel):
        raise ValueError(f"--parallelize {name} wrapped torch's DistributedDataParallel; the planner counts vemesh's "
                         "(vemesh.ddp.DistributedDataParallel) and FSDP2 (fully_shard), whose buffers it knows")
    fsdp = any(isinstance(m, FSDPModule) for m in model.modules())
    ddp = next((m for m in model.modules() if isinstance(m, DistributedDataParallel)), None)
    found = "fsdp" if fsdp else "ddp" if ddp is not None else None
    if given == "fsdp" and found != "fsdp":
        raise ValueError(f"--dp-mode fsdp, but --parallelize {name} did not call fully_shard "
                         f"({'it wrapped vemesh DDP' if ddp is not None else 'it wrapped no data parallelism'}); "
                         "give --dp-mode ddp or zero1, or leave --dp-mode out")
    if given in ("ddp", "zero1") and found == "fsdp":
        raise ValueError(f"--dp-mode {given}, but --parallelize {name} sharded the model with FSDP2 (fully_shard); "
                         "give --dp-mode fsdp, or leave --dp-mode out")
    grad = data_dims(mesh.layout).grad
    if found is None:
        if grad is not None and mesh.size(grad) > 1:
            raise ValueError(f"--parallelize {name} wrapped no data parallelism, but the mesh has "
                             f"{mesh.size(grad)} data-parallel ranks ({grad}) whose "
                             "gradients would never be averaged; wrap the model in vemesh.ddp.DistributedDataParallel "
                             "or vemesh.parallel.fully_shard")
        if given == "zero1":
            raise ValueError(f"--dp-mode zero1 needs vemesh DDP, and --parallelize {name} wrapped none")
        return given or "ddp", None
    return given or ("fsdp" if fsdp else "zero1"), ddp


def _optimizer(model: nn.Module, mode: str, ddp: Any) -> torch.optim.Optimizer:
    if mode == "zero1":

        return DistributedOptimizer(torch.optim.AdamW, models=[ddp])
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])


def _no_sync(model: nn.Module, last: bool) -> contextlib.AbstractContextManager[Any]:
    """Gradient accumulation as torch users write it: no gradient sync but on the last micro-batch."""
    from torch.distributed.fsdp import FSDPModule

    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()
    if not last and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def _unknown(counter: Any, mesh: Any) -> str | None:
    """One line for collectives on groups that are none of the mesh's names, or None."""
    known = set()
    for n in mesh.layout.names:
        with contextlib.suppress(ValueError, RuntimeError, KeyError):
            known.add(mesh.get_group(n).group_name)
    strange = [g for g in counter.bytes if g not in known]
    if not strange:
        return None
    g = strange[0]
    ranks = dist.get_process_group_ranks(counter.groups[g])
    return (f"the step ran {', '.join(sorted(counter.ops[g]))} on a group of ranks {ranks[:8]}"
            f"{'...' if len(ranks) > 8 else ''} that is none of the mesh's dims ({', '.join(mesh.layout.names)}); "
            "the planner names each collective by its mesh dim: take groups from VESCALE_DEVICE_MESH "
            "(mesh.get_group(name), mesh[name])")


def trace_user(fns: UserFunctions, *, world_size: int, degrees: dict[str, int], dp_replicate: int = 1,
               micro_batch_size: int, passes: int, dtype: str = "fp32", dp_mode: str | None = None,
               load_factor: float = 1.0, blocks: tuple[str, int] | None = None, timed: bool = False) -> Counted:
    """One trace on rank 0 (see the module docstring); ``blocks=(path, k)`` keeps the first ``k`` blocks; ``timed``
    also counts what a step-time prediction needs (FLOPs, memory-bound bytes, ops: about 10% more tracing)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    tracker, counter = StepTracker(module_hooks=False), CollectiveBytes()
    factory_name, parallelize_name, step_name = fns.names
    with fake_world(world_size, degrees, dp_replicate, keep_dp=fns.keep_dp) as mesh, \
            FakeTensorMode(allow_non_fake_inputs=True), \
            real_mesh_tensors(), routing(load_factor) as routed, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # your code's warnings are your run's to print, not the plan's
        with torch.device("meta"):  # as torchtitan builds a model: any __init__ that runs on meta runs here
            model = _call("--model", factory_name, fns.factory)
        if not isinstance(model, nn.Module):
            raise ValueError(f"--model {factory_name} returned a {type(model).__name__}, not an nn.Module")
        if blocks is not None:  # first, so that only the blocks kept get storage
            _keep_blocks(model, *blocks)
        give_storage(model)  # then fake storage for the parallelize function and the step, as to_empty gives
        if dtype == "bf16":  # as a training script's model.to(torch.bfloat16), before it parallelizes
            to_bf16(model)
        with chunks_on_demand(), tracker:
            model = _wrap(fns, model, mesh, degrees, dp_mode)
            mode, ddp = _data_parallel(model, dp_mode, parallelize_name, mesh)
            tracker.on_step_peak = Held(model, ddp)
            optimizer = _optimizer(model, mode, ddp)
            with counter:  # the collectives are counted in the steps; nothing dispatches through it before
                sent: list[dict[str, int]] = []
                ops: list[dict[str, dict[str, tuple[int, int]]]] = []
                flops: list[int] = []
                moved: list[int] = []
                stepped: list[int] = []
                dispatched: list[tuple[int, int]] = []
                for n in (1, 1, 2) if passes > 1 else (1, 1):  # a warm-up step, then 1 and 2 micro-batches
                    counter.bytes.clear()
                    counter.by_op.clear()
                    counter.counting = tracker.in_step = True
                    with _counting(timed) as (flop_counter, memory_bound):
                        optimizer.zero_grad()
                        for i in range(n):
                            with _no_sync(model, i == n - 1):
                                _call("--step", step_name, fns.step, model, micro_batch_size)
                        before = memory_bound.bytes
                        optimizer.step()
                        stepped.append(memory_bound.bytes - before)
                    counter.counting = tracker.in_step = False
                    sent.append(by_mesh_name(counter.bytes, mesh))
                    ops.append(ops_by_mesh_name(counter.by_op, mesh))
                    flops.append(flop_counter.get_total_flops())
                    moved.append(memory_bound.bytes)
                    dispatched.append((memory_bound.ops, memory_bound.dtensor_ops))
                    if (line := _unknown(counter, mesh)) is not None:
                        raise ValueError(line)
    held = dict(tracker.step_peak_parts, optimizer=tracker.step_peak_by_kind.get("Optstate", 0))
    held["activations"] = tracker.step_peak - sum(held.values())
    one = Counted(held, tracker.step_peak, sent[1], mode, routed["used"], flops[1], moved[1], stepped[1],
                  *dispatched[1], ops[1])
    if passes > 1:  # the per-micro-batch bytes and FLOPs by difference; the peak does not grow after the second
        one = replace(one, sent={k: v + (passes - 1) * (sent[2].get(k, 0) - v) for k, v in sent[1].items()},
                      flops=flops[1] + (passes - 1) * (flops[2] - flops[1]),
                      memory_bytes=moved[1] + (passes - 1) * (moved[2] - moved[1]),
                      ops=dispatched[1][0] + (passes - 1) * (dispatched[2][0] - dispatched[1][0]),
                      dtensor_ops=dispatched[1][1] + (passes - 1) * (dispatched[2][1] - dispatched[1][1]),
                      by_op=more_ops(ops[2], ops[1], passes - 2) if passes > 2 else ops[2])
    return one


@contextlib.contextmanager
def _counting(timed: bool) -> Any:
    """torch's FlopCounterMode and the memory-bound bytes while a timed step runs; counters of nothing otherwise."""
    from torch.utils.flop_counter import FlopCounterMode

    if not timed:
        yield _Nothing(), _Nothing()
        return
    with FlopCounterMode(display=False) as flops, MemoryBoundBytes() as moved:
        yield flops, moved


class _Nothing:
    """What an untimed trace counts: nothing."""

    bytes = ops = dtensor_ops = 0

    def get_total_flops(self) -> int:
        return 0


def _wrap(fns: UserFunctions, model: nn.Module, mesh: Any, degrees: dict[str, int], dp_mode: str | None) -> nn.Module:
    """The user's parallelize function, or the data parallelism ``--dp-mode`` names when there is none."""
    if fns.parallelize is not None:
        out = _call("--parallelize", fns.names[1], fns.parallelize, model, mesh)
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


@functools.lru_cache(maxsize=16)
def _blocks_of(factory: Callable[[], nn.Module], name: str) -> tuple[str, int] | None:
    with torch.device("meta"):
        model = _call("--model", name, factory)
    if not isinstance(model, nn.Module):
        raise ValueError(f"--model {name} returned a {type(model).__name__}, not an nn.Module")
    return repeated_blocks(model)


def predict_user(fns: UserFunctions, *, world_size: int, degrees: dict[str, int], dp_replicate: int = 1,
                 global_batch_size: int, micro_batch_size: int | None, dtype: str, dp_mode: str | None,
                 load_factor: float, timed: bool = False) -> Any:
    """The :class:`~vemesh.planning.fit.MeshFit` of the user's functions on one mesh (PP is not planned here)."""

    if degrees["PP"] > 1:
        raise ValueError("PP > 1 is planned for the GPT preset (--model gpt:...), whose stage cut the planner knows; "
                         "plan your model without --pp")
    if global_batch_size % degrees["DP"]:
        raise ValueError(f"DP {degrees['DP']} does not divide the global batch of {global_batch_size} sequences")
    per_dp = global_batch_size // degrees["DP"]
    mbs = micro_batch_size or per_dp
    if per_dp % mbs:
        raise ValueError(f"a micro-batch of {mbs} sequences does not divide the {per_dp} sequences per DP rank")
    kwargs = dict(world_size=world_size, degrees=degrees, dp_replicate=dp_replicate, micro_batch_size=mbs,
                  passes=per_dp // mbs, dtype=dtype, dp_mode=dp_mode, load_factor=load_factor, timed=timed)
    found = _blocks_of(fns.factory, fns.names[0])
    notes = []
    counted = None
    if found is not None:
        path, n = found
        try:
            two, three = (trace_user(fns, blocks=(path, k), **kwargs) for k in (2, 3))
            counted = three.scaled(two, n - 3)
            notes.append(f"blocks: {path} holds {n} identical blocks; 2 and 3 of them traced, the other {n - 3} "
                         "added by difference")
        except ValueError as e:  # a forward that counts its blocks itself (range(n_layers)): trace them all
            if not isinstance(e.__cause__, (IndexError, KeyError)):
                raise
            notes.append(f"blocks: {path} holds {n} identical blocks, but the model did not run with 2 of them "
                         f"({type(e.__cause__).__name__}); all {n} traced")
    if counted is None:
        counted = trace_user(fns, **kwargs)
    if counted.moe:
        notes.append(f"MoE routing: each expert gets an equal share of the slots, and the busiest EP rank receives "
                     f"{load_factor:g} x the balanced share (--moe-load-factor; 1 is balanced, a run's measured "
                     "expert_load is its own factor)")
    if counted.dp_mode == "zero1" and dtype == "bf16":
        notes.append("the optimizer column includes ZeRO-1's fp32 master weights")
    if dp_mode is None:
        notes.append(f"dp mode {counted.dp_mode}: from what the parallelize function returned (--dp-mode to say it)")
    held = counted.held
    static = RankMemory("every rank", held["params"], held["grads"], held["optimizer"], 0)
    return MeshFit(dict(degrees), [RankClass("every rank", static, held["activations"], 0, counted.sent, counted.flops,
                                             counted.memory_bytes, counted.optimizer_bytes, counted.ops,
                                             counted.dtensor_ops, counted.by_op)],
                   kwargs["passes"], mbs, notes=tuple(notes), dp_mode=counted.dp_mode)
