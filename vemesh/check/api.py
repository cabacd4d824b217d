"""``vemesh check``: does the parallelized model compute what one process computes?

It runs the user's three functions (the planner's: ``make()``, ``parallelize(model, mesh)``,
``step(model, micro_batch_size)``) twice on this machine, for real:

1. in this process, once for each data-parallel rank's inputs, the gradients summed and divided by DP (what DP's
   averaging gives);
2. on ``world_size`` gloo processes that it starts itself, with the mesh that ``ParallelDims`` builds for the degrees
   (as ``vemesh plan`` builds it), each rank stepping the inputs of its DP rank.

Both build the model from the same seed. Before each step the RNG is seeded with ``seed + 1 + d`` for DP rank ``d``,
so a step that draws its tokens with ``torch.randint`` draws DP rank ``d``'s batch in both runs, and the TP (CP, EP)
peers of a DP rank draw the same batch. Dropout draws nothing in either run (:class:`~vemesh.check.record.
Deterministic`); another random op inside a module's forward is named as the cause when the runs differ, never as a
wrong plan.

It compares every module's outputs in forward order (DTensors gathered whole; a TP rank's plain shard joined with its
TP peers'), and every parameter's gradient by name (gathered whole), and names any tie that parallelizing broke.

What it proves: one step, at the size the factory builds, on CPU in fp32 (or the model's own dtype), computes the
one-process forward and gradients within ``rtol``. What it does not: other sizes or steps, the optimizer (ZeRO-1's
step, a learning-rate schedule), CUDA kernels, or a PP schedule (PP > 1 is refused).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import socket
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from vemesh.check.record import Deterministic, Recorder, gradients, plain_name, unwrap

__all__ = ["CheckInputError", "CheckResult", "check"]

#: the first seed: the model's weights; DP rank ``d``'s inputs are drawn from ``seed + 1 + d``
SEED = 1234


class CheckInputError(ValueError):
    """Bad input to the check (a reference, a degree, a step that raises in one process): one line, exit 2."""


@dataclass
class CheckResult:
    """What ``vemesh check`` found; :meth:`render` is the text it prints, :meth:`to_json` its ``--json``."""

    #: ``"exact"``, ``"differs"`` (a wrong plan), or ``"random"`` (a random op in the forward makes them differ)
    verdict: str
    degrees: dict[str, int]
    world_size: int
    micro_batch_size: int
    rtol: float
    #: the largest relative difference over everything compared, and where it was
    largest: float = 0.0
    largest_at: str = ""
    outputs_compared: int = 0
    gradients_compared: int = 0
    #: outputs the parallel run made in another shape that no join over TP gives (left out, counted)
    outputs_not_comparable: int = 0
    #: the first module whose output differs: name, call, DP rank, relative difference; and the modules before it
    first_module: dict[str, Any] | None = None
    matched_before: list[str] = field(default_factory=list)
    #: ``(parameter, relative difference)`` of the gradients that differ, worst first
    gradients: list[tuple[str, float]] = field(default_factory=list)
    broken_ties: list[list[str]] = field(default_factory=list)
    #: the parallel run raised where one process did not (the plan's error, or vemesh's tie or TP-replica check)
    error: str = ""
    dropouts: int = 0
    random_ops: list[tuple[str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def exact(self) -> bool:
        return self.verdict == "exact"

    def to_json(self) -> dict[str, Any]:
        return asdict(self) | {"exact": self.exact}

    def render(self) -> str:
        mesh = " x ".join(f"{k} {v}" for k, v in self.degrees.items() if v > 1) or "one rank"
        head = (f"{mesh} on {self.world_size} gloo processes against one process, micro-batch "
                f"{self.micro_batch_size}: {self.outputs_compared} module outputs and {self.gradients_compared} "
                "gradients compared")
        lines = []
        if self.exact:
            lines.append(f"vemesh check: exact. {head}; largest relative difference {self.largest:.1e}"
                         + (f" ({self.largest_at})" if self.largest_at else "") + f", within {self.rtol:g}")
        elif self.verdict == "random":
            lines.append(f"vemesh check: not comparable: random numbers drawn in the forward. {head}")
            ops = ", ".join(sorted({f"{op} in {m or 'the root'}" for m, op in self.random_ops}))
            lines.append(f"  {ops}: the two runs draw them differently, so they differ (not a verdict on the plan). "
                         "Make the forward deterministic for the check (a factory argument), and check again")
        else:
            lines.append(f"vemesh check: DIFFERS from one process. {head}")
        for names in self.broken_ties:
            lines.append(f"  tie broken: {' and '.join(names)} are one parameter in the model as built and several "
                         "after parallelize: shard both ends the same way with vemesh.parallel.parallelize_module, "
                         "or re-tie them")
        if self.error:
            lines.append(f"  the parallel run raised where one process did not: {self.error}")
        if self.first_module is not None:
            fm = self.first_module
            lines.append(f"  first module whose output differs: {fm['module'] or '(the root)'} (forward call "
                         f"{fm['call'] + 1}, DP rank {fm['dp_rank']}): relative difference {fm['difference']:.3g}")
            if self.matched_before:
                lines.append(f"  the modules just before it match: {', '.join(self.matched_before)}")
        if self.gradients and self.first_module is None and not self.broken_ties and not self.error:
            lines.append("  every output matches but gradients differ: a parameter whose gradient is each TP rank's "
                         "part only (a norm over its own heads, or between sequence-parallel regions, without "
                         "SequenceParallel), or a gradient that DP does not average")
        if self.gradients:
            lines.append(f"  gradients that differ ({len(self.gradients)}), worst first:")
            lines += [f"    {name}: {diff:.3g}" for name, diff in self.gradients[:12]]
            if len(self.gradients) > 12:
                lines.append(f"    and {len(self.gradients) - 12} more")
        if self.dropouts:
            lines.append(f"  dropout: {self.dropouts} calls drew nothing in either run (p taken as 0)")
        if self.seconds:
            lines.append("  time: " + ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items()))
        return "\n".join(lines)


@dataclass(frozen=True)
class _Spec:
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


def _functions(spec: _Spec) -> tuple[Any, Any, Any, tuple[str, str, str]]:
    from vemesh.planning.user_code import UserFunctions

    if spec.parallelize is None:
        raise CheckInputError("--parallelize MODULE:FUNCTION is required: the check compares what it builds with "
                              "one process")
    try:
        fns = UserFunctions.of(spec.model, spec.parallelize, spec.step)
    except ValueError as e:
        raise CheckInputError(str(e)) from None
    return fns.factory, fns.parallelize, fns.step, fns.names


def _call(what: str, name: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
    from vemesh.planning.user_code import user_frame

    try:
        return fn(*args, **kwargs)
    except Exception as e:
        raise _UserError(f"{what} {name} failed{user_frame(e)}: {type(e).__name__}: "
                         f"{' '.join(str(e).split())[:400]}") from e


class _UserError(Exception):
    """A user's function raised: one line naming it."""


def _dims(world_size: int, degrees: dict[str, int], dp_replicate: int) -> Any:
    from vemesh.layout.parallel_dims import ParallelDims

    names = tuple(n for n in ("DP", "CP", "TP") if degrees[n] > 1) or None
    return ParallelDims(world_size, dp_replicate=dp_replicate, cp=degrees["CP"], tp=degrees["TP"], ep=degrees["EP"],
                        mesh_dims=names)


def _tolerance(rtol: float | None, dtypes: set[torch.dtype]) -> float:
    if rtol is not None:
        return rtol
    return 2e-2 if dtypes & {torch.bfloat16, torch.float16} else 1e-4


#: a tensor is measured against its own largest value, but never against less than this share of the median
#: tensor's largest value: a gradient that is zero in exact arithmetic (the key bias's: softmax ignores a constant
#: per query) is rounding in both runs, and its "relative" difference would be 1
FLOOR = 1e-2


def _difference(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """``max |a - b| / max(max |b|, floor)`` in fp64 (``inf`` when one has non-finite values the other has not)."""
    a, b = a.double(), b.double()
    if not torch.equal(torch.isfinite(a), torch.isfinite(b)):
        return math.inf
    a, b = torch.nan_to_num(a), torch.nan_to_num(b)
    scale = b.abs().max().item() if b.numel() else 0.0
    return (a - b).abs().max().item() / max(scale, floor, 1e-30) if b.numel() else 0.0


def _floor(tensors: list[torch.Tensor]) -> float:
    """:data:`FLOOR` times the median of the tensors' largest absolute values."""
    peaks = sorted(t.detach().abs().max().item() for t in tensors if t is not None and t.numel())
    return FLOOR * peaks[len(peaks) // 2] if peaks else 0.0


@contextlib.contextmanager
def _one_rank_world() -> Iterator[None]:
    """A world of one gloo rank with ``VESCALE_DEVICE_MESH`` built on it, for a step that asks the mesh (its CP
    degree, its groups): every degree is 1 there. Undone after."""
    import torch.distributed as dist

    from vemesh.layout.parallel_dims import ParallelDims
    from vemesh.mesh import VESCALE_DEVICE_MESH as mesh
    from vemesh.planning.fake_world import _forget_meshes

    if dist.is_initialized():
        raise CheckInputError("vemesh check runs both worlds itself: call it before init_process_group (or from "
                              "another process), not inside a distributed job")
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        ParallelDims(1).build("cpu", mesh)
        yield
    finally:
        mesh.reset()
        dist.destroy_process_group()
        _forget_meshes()


def _reference(spec: _Spec, factory: Any, parallelize_name: str, step: Any, names: tuple[str, str, str]) -> dict:
    with _one_rank_world():
        return _reference_run(spec, factory, step, names)


def _reference_run(spec: _Spec, factory: Any, step: Any, names: tuple[str, str, str]) -> dict:
    torch.manual_seed(SEED)
    model = _call("--model", names[0], factory, **spec.model_kwargs)
    if not isinstance(model, torch.nn.Module):
        raise CheckInputError(f"--model {names[0]} returned {type(model).__name__}, not an nn.Module")
    dp = spec.degrees["DP"]
    outputs, dropouts, random_ops = [], 0, []
    for d in range(dp):
        torch.manual_seed(SEED + 1 + d)
        with Recorder(model) as rec, Deterministic(rec) as det:
            _call("--step", names[2], step, model, spec.micro_batch_size)
        outputs.append(rec.outputs)
        dropouts += det.dropouts
        random_ops += det.random_ops
    grads = {n: None if g is None else g / dp for n, g in gradients(model).items()}
    dtypes = {p.dtype for p in model.parameters()}
    return {"outputs": outputs, "grads": grads, "dropouts": dropouts, "random_ops": random_ops, "dtypes": dtypes}


def _worker(rank: int, spec: _Spec, port: int, out: str) -> None:
    import torch.distributed as dist

    from vemesh.parallel.ties import BrokenTieError, tie_groups
    from vemesh.parallel.tp_replicas import TPReplicaError

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE=str(spec.world_size), LOCAL_WORLD_SIZE=str(spec.world_size))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // spec.world_size))
    # gathering a 2-D (FSDP2 x TP) gradient whole warns that it takes two all-gathers: the check's own, not the user's
    logging.getLogger("torch.distributed.tensor._redistribute").setLevel(logging.ERROR)
    logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)  # a wrong plan's shape error: ours
    os.chdir(spec.cwd)
    try:
        factory, parallelize, step, names = _functions(spec)
        dist.init_process_group("gloo", rank=rank, world_size=spec.world_size,
                                timeout=timedelta(seconds=spec.timeout_s))
        from vemesh.mesh import VESCALE_DEVICE_MESH as mesh

        _dims(spec.world_size, spec.degrees, spec.dp_replicate).build("cpu", mesh)
        torch.manual_seed(SEED)
        model = _call("--model", names[0], factory, **spec.model_kwargs)
        ties = tie_groups(model)
        model = _call("--parallelize", names[1], parallelize, model, mesh)
        if not isinstance(model, torch.nn.Module):
            raise _UserError(f"--parallelize {names[1]} returned {type(model).__name__}, not the model (an nn.Module)")
        params = {plain_name(n): p for n, p in unwrap(model).named_parameters(remove_duplicate=False)}
        broken = [[plain_name(n) for n in group] for group in ties
                  if len({id(params.get(plain_name(n))) for n in group}) > 1]
        data_rank = mesh.get_local_rank("DP") if mesh.layout.has("DP") else 0
        torch.manual_seed(SEED + 1 + data_rank)
        with Recorder(model) as rec, Deterministic(rec) as det:
            try:
                _call("--step", names[2], step, model, spec.micro_batch_size)
            except _UserError as e:
                if not rec.stack:
                    raise
                raise _UserError(f"{e} (in the forward of {rec.stack[-1] or 'the root'})") from e.__cause__
        grads = gradients(model)
        coords = {n: mesh.get_local_rank(n) for n in mesh.layout.dim_names}
        torch.save({"outputs": rec.outputs, "grads": grads, "coords": coords, "data_rank": data_rank,
                    "broken": broken, "dropouts": det.dropouts, "random_ops": det.random_ops},
                   os.path.join(out, f"rank{rank}.pt"))
        dist.barrier()
        dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 -- written for the parent, then raised so that the others stop
        cause = e.__cause__ if isinstance(e, _UserError) and e.__cause__ is not None else e
        kind = ("tie" if isinstance(cause, BrokenTieError) else "tp_replicas" if isinstance(cause, TPReplicaError)
                else "input" if isinstance(e, CheckInputError) else "user" if isinstance(e, _UserError) else "other")
        text = str(e) if isinstance(e, (_UserError, CheckInputError)) else f"{type(e).__name__}: {e}"
        with open(os.path.join(out, f"error{rank}.json"), "w") as f:
            json.dump({"kind": kind, "message": " ".join(text.split()),
                       "trace": traceback.format_exc(limit=-6)}, f)
        raise


def _run_parallel(spec: _Spec, out: str) -> None:
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)  # "terminating process": ours
    context = mp.start_processes(_worker, args=(spec, port, out), nprocs=spec.world_size, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + spec.timeout_s + 60
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise _Timeout(f"the parallel run did not finish in {spec.timeout_s + 60:.0f} s (a hang in the plan "
                               "or the step?); rerun with a longer --timeout, or see docs/debugging-hangs.md")
    except (mp.ProcessRaisedException, mp.ProcessExitedException):
        pass  # the error files say what
    finally:
        for p in context.processes:
            if p.is_alive():
                p.terminate()
        for p in context.processes:
            p.join(5)


class _Timeout(Exception):
    pass


def _errors(out: str) -> list[dict[str, str]]:
    found = []
    for path in sorted(Path(out).glob("error*.json")):
        found.append(json.loads(path.read_text()))
    order = {"tie": 0, "tp_replicas": 1, "input": 2, "user": 3, "other": 4}
    noise = ("Connection reset", "Connection closed", "Broken pipe", "NCCL", "gloo")
    return sorted(found, key=lambda e: (order[e["kind"]], any(n in e["message"] for n in noise)))


def _joined(values: list[torch.Tensor], shape: torch.Size) -> torch.Tensor | None:
    """The TP peers' shards joined along the one dim where they add up to ``shape``, or None."""
    first = values[0]
    if any(v.dim() != len(shape) for v in values):
        return None
    dims = [i for i in range(len(shape)) if first.shape[i] != shape[i]]
    if len(dims) != 1:
        return None
    joined = torch.cat(values, dim=dims[0])
    return joined if joined.shape == shape else None


def _compare(result: CheckResult, ref: dict, ranks: list[dict], tol: float) -> None:
    worst = (0.0, "")

    def seen(diff: float, where: str) -> None:
        nonlocal worst
        if diff > worst[0]:
            worst = (diff, where)

    # module outputs, in the one-process run's forward order, DP rank by DP rank
    for d, ref_out in enumerate(ref["outputs"]):
        floor = _floor(list(ref_out.values()))
        mine = [r for r in ranks if r["data_rank"] == d]
        first_group = [r for r in mine if all(r["coords"].get(k, 0) == 0 for k in r["coords"] if k not in ("TP", "DP"))]
        first_group.sort(key=lambda r: r["coords"].get("TP", 0))
        matched: list[str] = []
        for key, want in ref_out.items():
            got = [r["outputs"].get(key) for r in mine]
            got = [g for g in got if g is not None]
            if not got:
                continue
            same = [g for g in got if g.shape == want.shape]
            if same:
                diff = max(_difference(g, want, floor) for g in same)
            else:
                peers = [r["outputs"].get(key) for r in first_group]
                joined = _joined(peers, want.shape) if all(p is not None for p in peers) else None
                if joined is None:
                    result.outputs_not_comparable += 1
                    continue
                diff = _difference(joined, want, floor)
            result.outputs_compared += 1
            seen(diff, f"{key[0] or 'the root'}'s output")
            if diff > tol and result.first_module is None:
                result.first_module = {"module": key[0], "call": key[1], "dp_rank": d, "difference": diff}
                result.matched_before = matched[-3:]
            elif diff <= tol and (not matched or matched[-1] != key[0]):
                matched.append(key[0] or "(the root)")
    # gradients, by name, on every rank
    bad = []
    floor = _floor(list(ref["grads"].values()))
    for name, want in ref["grads"].items():
        diffs = []
        for r in ranks:
            if name not in r["grads"]:
                continue
            got = r["grads"][name]
            if (got is None) != (want is None):
                diffs.append(math.inf)
            elif got is not None and want is not None:
                diffs.append(_difference(got, want, floor) if got.shape == want.shape else math.inf)
        if not diffs:
            continue
        result.gradients_compared += 1
        diff = max(diffs)
        seen(diff, f"{name}'s gradient")
        if diff > tol:
            bad.append((name, diff))
    result.gradients = sorted(bad, key=lambda x: -x[1])
    result.largest, result.largest_at = worst


def check(model: Any, parallelize: Any, step: Any, *, world_size: int, dp: int | None = None, tp: int = 1,
          cp: int = 1, ep: int = 1, pp: int = 1, dp_replicate: int = 1, micro_batch_size: int = 2,
          model_kwargs: dict[str, Any] | None = None, rtol: float | None = None,
          timeout_s: float = 300.0) -> CheckResult:
    """Run ``parallelize`` on ``world_size`` gloo processes and one process, and compare (see the module docstring).

    Args:
        model: ``module:MODULE:FACTORY`` (or ``MODULE:FACTORY``, or a module-level callable): builds the model.
        parallelize: ``MODULE:FUNCTION``: ``parallelize(model, mesh)`` returns the model to step.
        step: ``MODULE:FUNCTION``: ``step(model, micro_batch_size)``, one forward and backward.
        world_size, dp, tp, cp, ep, dp_replicate: the degrees, as ``vemesh plan`` takes them (``dp`` fills the rest).
        model_kwargs: given to the factory: a small configuration of the same code (``n_layer=2``).
        rtol: the largest relative difference (``max |a - b| / max |b|``, with ``max |b|`` at least 1% of the
            median tensor's: :data:`FLOOR`) called exact; default 1e-4 (2e-2 with bf16 or fp16 parameters).

    Raises:
        CheckInputError: a bad reference or degree, a model too large for this machine, or a step that raises in
            one process (one line that names the value).
    """
    started = time.monotonic()
    if pp != 1:
        raise CheckInputError(f"--pp {pp}: the check compares one process with the parallel run at PP 1 (a "
                              "pipeline schedule splits the step across ranks); check the stages' TP and data plan "
                              "with --pp 1")
    for flag, value in (("--world-size", world_size), ("--tp", tp), ("--cp", cp), ("--ep", ep),
                        ("--dp-replicate", dp_replicate), ("--micro-batch-size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckInputError(f"{flag} {value!r}: expected a positive integer")
    if world_size % (tp * cp):
        raise CheckInputError(f"--world-size {world_size} is not divisible by TP x CP = {tp} x {cp} = {tp * cp}; "
                              f"choose degrees whose product divides it (DP fills the rest)")
    dp = world_size // (tp * cp) if dp is None else dp
    degrees = {"DP": dp, "CP": cp, "TP": tp, "EP": ep}
    try:
        _dims(world_size, degrees, dp_replicate)
        if dp * tp * cp != world_size:
            raise ValueError(f"DP x CP x TP = {dp} x {cp} x {tp} = {dp * cp * tp} is not the world size {world_size}")
    except ValueError as e:
        raise CheckInputError(f"the degrees do not fit --world-size {world_size}: {e}") from None
    if world_size == 1:
        raise CheckInputError("--world-size 1: a parallel run needs at least 2 ranks; give --world-size 2 or more "
                              "with the degrees to check")
    spec = _Spec(model, parallelize, step, dict(model_kwargs or {}), world_size, degrees, dp_replicate,
                 micro_batch_size, os.getcwd(), float(timeout_s))
    factory, _, step_fn, names = _functions(spec)
    _check_size(factory, spec, names)
    result = CheckResult("exact", degrees, world_size, micro_batch_size, 0.0)
    t0 = time.monotonic()
    try:
        ref = _reference(spec, factory, names[1], step_fn, names)
    except _UserError as e:
        raise CheckInputError(f"{e} (in one process, before any parallelizing)") from None
    result.rtol = tol = _tolerance(rtol, ref["dtypes"])
    t1 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vemesh-check-") as out:
        try:
            _run_parallel(spec, out)
        except _Timeout as e:
            result.verdict, result.error = "differs", str(e)
        t2 = time.monotonic()
        errors = _errors(out)
        ranks = [torch.load(os.path.join(out, f"rank{r}.pt"), weights_only=False) for r in range(world_size)] \
            if not errors and not result.error else []
    if errors:
        e = errors[0]
        if e["kind"] == "input":
            raise CheckInputError(e["message"])
        result.verdict, result.error = "differs", e["message"]
    result.dropouts = ref["dropouts"]
    result.random_ops = ref["random_ops"] + [op for r in ranks for op in r["random_ops"]]
    if ranks:
        result.broken_ties = ranks[0]["broken"]
        _compare(result, ref, ranks, tol)
        if result.first_module is not None or result.gradients or result.broken_ties:
            result.verdict = "random" if result.random_ops and not result.broken_ties else "differs"
    result.seconds = {"one process": t1 - t0, "parallel run": t2 - t1, "compare": time.monotonic() - t2,
                      "in all": time.monotonic() - started}
    return result


def _check_size(factory: Any, spec: _Spec, names: tuple[str, str, str]) -> None:
    """A model the machine cannot hold ``world_size + 1`` times (with gradients) is refused before it is built."""
    try:
        with torch.device("meta"):
            model = factory(**spec.model_kwargs)
        nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    except Exception:  # a factory that cannot run on meta is built for real: nothing to say in advance
        return
    need = nbytes * 3 * (spec.world_size + 1)  # parameters, gradients and a margin, in each process and this one
    available = _available_memory()
    if available and need > 0.8 * available:
        gib = 1 << 30
        raise CheckInputError(
            f"--model {names[0]} builds {nbytes / gib:.1f} GiB of parameters; the check holds it in "
            f"{spec.world_size + 1} processes with its gradients (about {need / gib:.0f} GiB), and this machine has "
            f"{available / gib:.0f} GiB available: check a smaller configuration of the same code, e.g. "
            "--model-kwargs n_layer=2,n_embd=128 (the plan's structure does not depend on depth or width)")


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0

