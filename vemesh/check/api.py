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

import os
import tempfile
import time
from typing import Any

import torch

from vemesh.check.compare import compare, fused_hints, modules_before, tolerance
from vemesh.check.result import CheckInputError, CheckResult
from vemesh.check.run import Spec, Timeout, UserError, dims, errors, functions, reference, run_parallel

__all__ = ["CheckInputError", "CheckResult", "check"]


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
        dims(world_size, degrees, dp_replicate)
        if dp * tp * cp != world_size:
            raise ValueError(f"DP x CP x TP = {dp} x {cp} x {tp} = {dp * cp * tp} is not the world size {world_size}")
    except ValueError as e:
        raise CheckInputError(f"the degrees do not fit --world-size {world_size}: {e}") from None
    if world_size == 1:
        raise CheckInputError("--world-size 1: a parallel run needs at least 2 ranks; give --world-size 2 or more "
                              "with the degrees to check")
    spec = Spec(model, parallelize, step, dict(model_kwargs or {}), world_size, degrees, dp_replicate,
                micro_batch_size, os.getcwd(), float(timeout_s))
    factory, _, step_fn, names = functions(spec)
    _check_size(factory, spec, names)
    result = CheckResult("exact", degrees, world_size, micro_batch_size, 0.0)
    t0 = time.monotonic()
    try:
        ref = reference(spec, factory, step_fn, names)
    except UserError as e:
        raise CheckInputError(f"{e} (in one process, before any parallelizing)") from None
    result.rtol = tol = tolerance(rtol, ref["dtypes"])
    t1, launched = time.monotonic(), time.time()
    with tempfile.TemporaryDirectory(prefix="vemesh-check-") as out:
        try:
            run_parallel(spec, out)
        except Timeout as e:
            result.verdict, result.error = "differs", str(e)
        t2 = time.monotonic()
        failed = errors(out)
        files = [os.path.join(out, f"rank{r}.pt") for r in range(world_size)]
        missing = [r for r, f in enumerate(files) if not os.path.exists(f)]
        gone = [r for r in missing if not os.path.exists(os.path.join(out, f"error{r}.json"))]
        ranks = [torch.load(f, weights_only=False) for f in files] if not (failed or missing or result.error) else []
    if failed and failed[0]["kind"] == "input":
        raise CheckInputError(failed[0]["message"])
    if gone and not result.error:  # a process gone without a word: the kernel's kill, or gloo's abort
        result.verdict, result.error = "differs", (
            f"rank(s) {gone} of the parallel run ended without a result or an error (killed, out of memory, or "
            "aborted by gloo: a collective of another size on each rank?)"
            + (f"; the others: {failed[0]['message']}" if failed else ""))
    elif failed:
        result.verdict, result.error = "differs", failed[0]["message"]
    result.dropouts = ref["dropouts"]
    result.random_ops = ref["random_ops"] + [op for r in ranks for op in r["random_ops"]]
    if ranks:
        result.broken_ties = ranks[0]["broken"]
        compare(result, ref, ranks, tol)
        if result.first_module is not None or result.gradients or result.broken_ties:
            result.verdict = "random" if result.random_ops and not result.broken_ties else "differs"
        if result.first_module is not None:
            result.hints = fused_hints(result.first_module["module"], ranks[0]["split"],
                                       modules_before(ref["outputs"], result.first_module))
    elif failed and failed[0].get("module") is not None:  # a forward that raised: what it read may be the cause
        result.hints = fused_hints(failed[0]["module"], failed[0]["split"])
    result.seconds = {"one process": t1 - t0, "parallel run": t2 - t1, **_phases(ranks, launched),
                      "compare": time.monotonic() - t2, "in all": time.monotonic() - started}
    return result


def _phases(ranks: list[dict], launched: float) -> dict[str, float]:
    """Where the parallel run's time went, on its slowest rank at each mark (after the first process started)."""
    if not ranks:
        return {}
    at = {k: max(r["marks"][k] for r in ranks) for k in ranks[0]["marks"]}
    return {"processes start": at["started"] - launched, "mesh": at["mesh"] - at["started"],
            "build and parallelize": at["parallelized"] - at["mesh"], "step": at["stepped"] - at["parallelized"],
            "gather": at["gathered"] - at["stepped"]}


def _check_size(factory: Any, spec: Spec, names: tuple[str, str, str]) -> None:
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
