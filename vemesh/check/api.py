"""``vemesh check``: does the parallelized model compute what one process computes?

It runs the user's three functions (the planner's: ``make()``, ``parallelize(model, mesh)``,
``step(model, micro_batch_size)``) twice on this machine, for real:

1. in this process, once for each data-parallel rank's inputs, the gradients summed and divided by DP (on DP processes
   of the model as built where the step's own collectives couple the DP ranks: :mod:`vemesh.check.reference`);
2. on ``world_size`` gloo processes that it starts itself, with the mesh ``ParallelDims`` builds for the degrees.

Both build the model from the same seed. Before each step the RNG is seeded with ``seed + 1 + d`` for DP rank ``d``, so
a step that draws its tokens with ``torch.randint`` draws DP rank ``d``'s batch in both runs, and the TP (CP, EP) peers
of a DP rank draw the same batch. Dropout draws nothing in either run (:class:`~vemesh.check.record.Deterministic`);
another random op inside a module's forward is named as the cause when the runs differ, never as a wrong plan; so is a
step that chose its batch by its rank (the verdict ``by_rank``).

It compares every module's outputs in forward order (DTensors gathered whole; a TP rank's plain shard joined with its TP
peers'), and every parameter's gradient by name (gathered whole), and names any tie that parallelizing broke. Where the
layouts given torch's styles are the cause (:mod:`vemesh.check.layouts`), it says so and tries nothing. Where the run
went wrong in the scope of a Linear that looks fused and is split as torch's ``ColwiseParallel`` splits, it runs again
with the fused recipes in that style's place and says which one made it exact (:mod:`vemesh.check.recipes`); where the
module that went wrong holds parameters of a split Linear's whole output width (OLMo 2's q/k norms), it tries the
gathered layout on that Linear's scope. Before those, where that scope's module counts heads by the whole model's count
(Falcon's ``num_heads``), it tries the counts set to this rank's, with what the module keeps per head sharded over TP
(T5's relative position bias, GPT-OSS's sinks; alone where it counts no heads; the tensors of every head it is handed
sliced: Bloom's ALiBi) (:mod:`vemesh.check.heads`), and where a forward changed a TP style's output in place, a copy of
it (:mod:`vemesh.check.clones`); where the counts clear the forward and gradients differ, the gradients' recipes below,
with the counts kept. Where every output matches and gradients differ, it says whether DP's average is missing, or tries
``SumGradOverTP`` on the features of an unsplit Linear whose gradient differs in those rows alone (DeepSeek-V3's k_pe),
and torch's ``SequenceParallel`` on the modules run on this TP rank's part of their input (Qwen3's q/k norms)
(:mod:`vemesh.check.partial`).

What it proves: one step, at the size the factory builds, on CPU in fp32 (or the model's own dtype), computes the
one-process forward and gradients within ``rtol``. What it does not: other sizes or steps, the optimizer (ZeRO-1's step,
a learning-rate schedule), CUDA kernels. Under PP it runs torch's schedule over the stages your parallelize function
returns, against the same step given torch's GPipe over the whole model as one stage: module outputs of the model's own
modules each stage holds whole, every gradient, and the parameters no stage holds.
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from vemesh.check.compare import compare, modules_before, tolerance, vanishing, widths_of
from vemesh.check.clones import candidate as clones_candidate, hint as clones_hint
from vemesh.check.heads import candidate as heads_candidate, hint as heads_hint
from vemesh.check.layouts import layout_hint
from vemesh.check.partial import candidates as partial_candidates, dp_hint, first_shapes, scale_hint, \
    hint as partial_hint, on_every_stage, outside_fsdp_hint, row_candidates, stage_scales, summed_hint, twice_hint, \
    unsynced_hint, zero_bubble_hint
from vemesh.check.positions import positions_hint, sequence_positions_hint
from vemesh.check.recipes import RECIPES, Swap, all_stages, candidates, hint, near, refused_hint, width_candidates, width_hint
from vemesh.check.result import CheckInputError, CheckResult, check_pipeline, check_size, phases, went_wrong
from vemesh.check.reference import reference
from vemesh.check.rerun import run_once_more
from vemesh.check.whole_input import Tries, raised, siblings
from vemesh.check.run import Spec, Timeout, UserError, dims, errors, functions
from vemesh.layout.names import divisors, listed
from vemesh.parallel.tp_split import uneven_hint

__all__ = ["CheckInputError", "CheckResult", "check"]


def check(model: Any, parallelize: Any, step: Any, *, world_size: int, dp: int | None = None, tp: int = 1,
          cp: int = 1, ep: int = 1, pp: int = 1, dp_replicate: int = 1, micro_batch_size: int = 2,
          model_kwargs: dict[str, Any] | None = None, rtol: float | None = None,
          timeout_s: float = 300.0, loss: Any = None, pp_schedule: str = "1f1b") -> CheckResult:
    """Run ``parallelize`` on ``world_size`` gloo processes and one process, and compare (see the module docstring).

    Args:
        model: ``module:MODULE:FACTORY`` (or ``MODULE:FACTORY``, or a module-level callable): builds the model.
        parallelize: ``MODULE:FUNCTION``: ``parallelize(model, mesh)`` returns the model to step.
        step: ``MODULE:FUNCTION``: ``step(model, micro_batch_size)``, one forward and backward; under PP
            ``step(schedule, batch_size)``, a DP rank's batch through torch's schedule (``vemesh plan``'s PP step).
        world_size, dp, tp, cp, ep, pp, dp_replicate: the degrees, as ``vemesh plan`` takes them (``dp`` fills the
            rest). Under PP ``parallelize`` returns this PP rank's ``PipelineStage`` objects, as for the plan.
        loss, pp_schedule: under PP, the schedule's ``loss_fn(output, target)`` (``MODULE:FUNCTION``) and
            ``--pp-schedule``. A DP rank's batch is ``2 x stages`` micro-batches of ``micro_batch_size``; one process
            runs the same step with torch's GPipe over one stage, the whole model.
        model_kwargs: given to the factory: a small configuration of the same code (``n_layer=2``).
        rtol: the largest relative difference (``max |a - b| / max |b|``, with ``max |b|`` at least 1% of the
            median tensor's: :data:`FLOOR`) called exact; default 1e-4 (2e-2 with bf16 or fp16 parameters).

    Raises:
        CheckInputError: a bad reference or degree, a model too large for this machine, or a step that raises in
            one process (one line that names the value).
    """
    started = time.monotonic()
    for flag, value in (("--world-size", world_size), ("--tp", tp), ("--cp", cp), ("--ep", ep), ("--pp", pp),
                        ("--dp-replicate", dp_replicate), ("--micro-batch-size", micro_batch_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise CheckInputError(f"{flag} {value!r}: expected a positive integer")
    check_pipeline(pp, loss, pp_schedule)
    if world_size % (pp * tp * cp):
        dims_of = [("PP", pp)] * (pp > 1) + [("TP", tp), ("CP", cp)]
        names, sizes = " x ".join(n for n, _ in dims_of), " x ".join(str(v) for _, v in dims_of)
        raise CheckInputError(f"--world-size {world_size} is not divisible by {names} = {sizes} = {pp * tp * cp}; "
                              f"choose {names} from {listed(divisors(world_size), 64)} (DP fills the rest)")
    dp = world_size // (pp * tp * cp) if dp is None else dp
    degrees = {"PP": pp, "DP": dp, "CP": cp, "TP": tp, "EP": ep} if pp > 1 else {"DP": dp, "CP": cp, "TP": tp, "EP": ep}
    try:
        dims(world_size, degrees, dp_replicate)
        if pp * dp * tp * cp != world_size:
            raise ValueError(f"PP x DP x CP x TP = {pp} x {dp} x {cp} x {tp} = {pp * dp * cp * tp} is not the world "
                             f"size {world_size}")
    except ValueError as e:
        raise CheckInputError(f"the degrees do not fit --world-size {world_size}: {e}") from None
    if world_size == 1:
        raise CheckInputError("--world-size 1: a parallel run needs at least 2 ranks; give --world-size 2 or more "
                              "with the degrees to check")
    spec = Spec(model, parallelize, step, dict(model_kwargs or {}), world_size, degrees, dp_replicate,
                micro_batch_size, os.getcwd(), float(timeout_s), loss=loss, pp_schedule=pp_schedule)
    factory, _, step_fn, names = functions(spec)
    check_size(factory, spec, names)
    result = CheckResult("exact", degrees, world_size, micro_batch_size, 0.0, dp_replicate=dp_replicate)
    t0 = time.monotonic()
    try:
        ref = reference(spec, factory, step_fn, names)
    except UserError as e:
        raise CheckInputError(f"{e} (in one process, before any parallelizing)" + (
            "; with --pp the step is given torch's schedule, not the model: step(schedule, batch_size) runs "
            "schedule.step(inputs, target=targets)" if pp > 1 else "")) from None
    result.rtol, result.autocast = (tol := tolerance(rtol, ref["dtypes"])), ref["autocast"]
    result.coupled = (ref["coupled"], ref["apart"], ref["unsplit"])
    spec = replace(spec, model_params=ref["params"]) if pp > 1 else spec
    t1, launched = time.monotonic(), time.time()
    ranks, failed, compared = _parallel(spec, ref, tol, result)
    t2, result.dropouts = time.monotonic(), ref["dropouts"]
    result.hints, tries = _hints(spec, ref, tol, result, ranks, failed) if result.verdict != "by_rank" else ([], 0)
    result.seconds = {"one process": t1 - t0, "parallel run": t2 - t1 - compared, **phases(ranks, launched),
                      "compare": compared}
    result.seconds |= {"recipes tried": time.monotonic() - t2} if tries else {}
    result.seconds["in all"] = time.monotonic() - started
    return result


def _parallel(spec: Spec, ref: dict, tol: float, result: CheckResult) -> tuple[list[dict], list[dict], float]:
    """The parallel run of ``spec``, compared with ``ref`` into ``result``; its ranks' records and errors, and the
    seconds the comparison took."""
    with tempfile.TemporaryDirectory(prefix="vemesh-check-") as out:
        stopped: list[int] = []
        try:
            stopped, result.reruns = run_once_more(spec, out)
        except Timeout as e:
            result.verdict, result.error = "differs", str(e)
        failed = errors(out)
        files = [os.path.join(out, f"rank{r}.pt") for r in range(spec.world_size)]
        missing = [r for r, f in enumerate(files) if not os.path.exists(f)]
        # gone without a word; not a rank stopped by the check after another had failed (on a loaded machine it may
        # not have reached the same error in the 5 s it was given)
        gone = [r for r in missing if not os.path.exists(os.path.join(out, f"error{r}.json"))
                and not (failed and r in stopped)]
        if gone and not any(os.path.exists(os.path.join(out, f"started{r}")) for r in range(spec.world_size)):
            raise CheckInputError(NOT_STARTED)  # no rank reached vemesh's code: nothing of the plan was run
        ranks = [torch.load(f, weights_only=False) for f in files] if not (failed or missing or result.error) else []
    if failed and failed[0]["kind"] == "input":
        raise CheckInputError(failed[0]["message"])
    result.skipped_plan = (ranks or failed or [{}])[0].get("skipped", [])  # the plan entries torch skipped
    if gone and not result.error:  # a process gone without a word: the kernel's kill, or gloo's abort
        result.verdict, result.error = "differs", (
            f"rank(s) {gone} of the parallel run ended without a result or an error (killed, out of memory, or "
            "aborted by gloo: a collective of another size on each rank?)"
            + (f"; the others: {failed[0]['message']}" if failed else ""))
    elif failed:  # the user's code raised before the step ("failed": nothing compared), or a wrong plan did
        before = failed[0]["kind"] == "user" and failed[0].get("before_step")
        result.verdict, result.error = "failed" if before else "differs", failed[0]["message"]
    result.random_ops = ref["random_ops"] + [op for r in ranks for op in r["random_ops"]]
    started = time.monotonic()
    if ranks:
        result.broken_ties, result.compiled = ranks[0]["broken"], ranks[0]["compiled"]
        result.stage_clips = max(r["clips"] for r in ranks) if spec.degrees.get("PP", 1) > 1 else 0
        compare(result, ref, ranks, tol)
        if result.first_module is not None or result.gradients or result.broken_ties or result.pipeline_cut_wrong:
            result.verdict = "random" if result.random_ops and not result.broken_ties else \
                "by_rank" if result.dp_batch_by_rank and not result.broken_ties else "differs"
        result.stage_scales = stage_scales(ref, ranks, tol) if result.stage_clips and result.gradients else {}
    return ranks, failed, time.monotonic() - started


#: every rank of the parallel run ended before it reached vemesh's code
NOT_STARTED = ("the parallel run's processes ended while they started, before any ran your functions (their own error "
               "is printed above): each starts by importing your main script again, as Python's multiprocessing and "
               "torch's spawn do, so a script that calls vemesh check at its top level must call it under "
               "`if __name__ == \"__main__\":`")
MAX_TRIES = 8  #: at most this many parallel runs with a recipe in the plan's place (:mod:`vemesh.check.recipes`)


def _located(ref: dict, result: CheckResult, ranks: list[dict],
             failed: list[dict]) -> tuple[str, set[str] | None, list, dict] | None:
    """Where a run went wrong, for :func:`~vemesh.check.recipes.candidates`: the first module that differs (and the
    modules before it) or the one whose forward raised, the Linears split in plain blocks, and where the plan's
    styles went; None where no module is named."""
    differs = bool(ranks) and result.first_module is not None  # else raised, where failed[0] says (or nowhere)
    if not (records := ranks if differs else failed[:1] if failed and failed[0].get("module") is not None else []):
        return None
    split, went = all_stages(records, ref["grads"]) if "PP" in result.degrees else (records[0]["split"], records[0]["went"])
    return (result.first_module["module"], modules_before(ref["outputs"], result.first_module), split, went) \
        if differs else (failed[0]["module"], None, split, went)


def _hints(spec: Spec, ref: dict, tol: float, result: CheckResult, ranks: list[dict],
           failed: list[dict]) -> tuple[list[str], int]:
    """For a Linear that may be a fused projection split in plain blocks where the run went wrong, the recipes tried
    in its place (each a parallel run: :mod:`vemesh.check.recipes`) and which cleared it; with the runs made."""
    if failed and failed[0].get("went", {}).get("refused"):  # torch's style refused a module
        return [refused_hint(*failed[0]["went"]["refused"])], 0
    if (layouts := layout_hint(spec.degrees["TP"], ref, result, failed)) is not None:
        return [layouts], 0  # the layouts given torch's styles, not how a Linear is split: no recipe helps
    if failed and (uneven := uneven_hint(failed[0].get("module"), failed[0]["split"], failed[0].get("head_dims", {}))):
        return [uneven], 0  # a TP degree that does not divide a projection's heads: no recipe helps
    tries = Tries(lambda swaps: _run(replace(spec, swaps=swaps), ref, tol, result), MAX_TRIES,
                              lambda swaps, trial, t_ranks, out: _partial_hints(replace(spec, swaps=swaps), ref, tol,
                                                                                trial, t_ranks, None, out),
                              list(dict.fromkeys(k[0] for k in ref["outputs"][0])) if ref.get("outputs") else [])
    if failed and (said := raised(failed[0], ref.get("grads", {}), tries)) is not None:
        return said  # a RowwiseParallel Linear handed its whole input, or a whole one handed its part
    if (sequence := sequence_positions_hint(spec, ref, failed, tries)) is not None:
        return sequence
    positions = positions_hint(spec, ref, result)
    if positions and spec.degrees["TP"] == 1:  # with TP, a TP plan's recipe is tried first (below)
        return [positions], 0
    located = _located(ref, result, ranks, failed) if result.verdict == "differs" else None
    fixes = _module_fixes(spec, ref, tol, result, located, (failed or ranks or [{}])[0])
    if fixes is not None and fixes[1]:  # the whole model's head counts, or a change in place, were the cause
        return fixes[0], len(fixes[0])
    if fixes is None and located and (said := siblings(located[0], located[3], located[2],
                                                                   ref.get("grads", {}), tries)):
        return said, 1  # a Linear left out of the plan beside one it splits by columns
    counts = () if fixes is None or fixes[2] is None else (fixes[2],)  # tried with the fused recipe too
    hints: list[str] = []
    swaps: tuple[Swap, ...] = ()
    cloned: tuple[str, ...] = ()
    done: set[str] = set()
    runs = 0 if fixes is None else len(fixes[0])
    while located is not None and runs < MAX_TRIES:
        first, before, split, went = located
        # a RowwiseParallel Linear's bias is its own output's width, not a norm over another's
        widths = set() if first in went.get("rowwise", ()) else widths_of(ref, first)
        found = width_candidates(first, split, widths, before, done) or \
            candidates(first, split, before, done, ref)
        if not found:
            break
        cand, tried, fixed = found[0], [], None
        done.update(cand.names)
        if not set(cand.names) <= set(went["colwise"]):  # split by another style: no recipe can take its place
            hints.append(hint(cand, before is None, [], False))
            break
        local_heads = ("local-heads",) * any(cand.name.rpartition(".")[0] in c.modules for c in counts)
        for recipe in (RECIPES[0], *local_heads, *RECIPES[1:]) if cand.parts > 1 else ("gathered",):
            swap = Swap(cand.names, cand.parts, recipe)  # (a whole-width Linear: the gathered recipe alone)
            if recipe == "gathered" and not any(r.rpartition(".")[0] in swap.scopes() for r in went["rowwise"]):
                continue  # no RowwiseParallel in its scope to take the gathered output
            if runs == MAX_TRIES:
                break
            heads = counts if any(s.recipe == "local-heads" for s in (*swaps, swap)) else ()
            trial, t_ranks, t_failed, now, copies, n = _copied(replace(spec, heads=heads), ref, tol, result,
                                                               swaps + (swap,), cloned)
            runs += n
            replaced = (t_ranks[0]["went"] if t_ranks else t_failed[0]["went"] if t_failed else {}).get("swapped", [])
            tried.append((swap, replaced, "" if trial.exact else went_wrong(trial, now)))
            if trial.exact or (now is not None and not any(near(now[0], n) for n in cand.names)):
                fixed = now
                break
        if not tried:
            continue
        cleared = tried[-1][2] == "" or fixed is not None
        copied = cleared and copies[0] != cloned  # the recipe cleared it with a copy of a TP output (clones)
        hints.append(hint(cand, before is None, tried, cleared, copied) if cand.parts > 1 else
                     width_hint(cand, first, tried, cleared))
        if cleared and tried[-1][0].recipe == "local-heads":  # which counts, and how to set them
            hints.append(heads_hint(counts[0], before is None, "", fused=f"FusedColwiseParallel({cand.parts})"))
        if copied:
            cloned = copies[0]
            hints.append(clones_hint(cloned, copies[1], tried[-1][2]))
        if not cleared or tried[-1][2] == "":
            break
        swaps, located = swaps + (tried[-1][0],), fixed
    replicas = failed[0] if failed and failed[0].get("kind") == "tp_replicas" else None  # vemesh DDP's or FSDP2's check
    # a clip by each PP stage's own norm scales its gradients: said (CheckResult.stage_clips), no recipe tried
    if runs < MAX_TRIES and not result.broken_ties and not result.stage_clips and (replicas is not None or (
            result.verdict == "differs" and result.gradients and result.first_module is None and not result.error)):
        runs += _partial_hints(spec, ref, tol, result, ranks, replicas, hints)[0]
    if positions and not hints:
        hints.append(positions)
    if fixes is not None and not hints:  # tried, not the cause: said where nothing else is
        hints += fixes[0]
    return hints, runs


def _run(spec: Spec, ref: dict, tol: float, result: CheckResult) -> tuple[CheckResult, list, list, tuple | None]:
    """A recipe's parallel run (``spec`` carries it): its result, its ranks' records and errors, where it went wrong."""
    trial = CheckResult("exact", result.degrees, result.world_size, result.micro_batch_size, tol)
    t_ranks, t_failed, _ = _parallel(spec, ref, tol, trial)
    return trial, t_ranks, t_failed, _located(ref, trial, t_ranks, t_failed) if not trial.exact else None


def _copied(spec: Spec, ref: dict, tol: float, result: CheckResult, swaps: tuple[Swap, ...],
            cloned: tuple[str, ...]) -> tuple[CheckResult, list, list, tuple | None, tuple, int]:
    """The parallel run with ``swaps`` (and the copies ``cloned``); where a forward then changed a TP style's output in
    place, again with a copy of it too (:mod:`vemesh.check.clones`), kept where that went further. The run, its
    records, where it went wrong, the copies made and where the first one was needed, and the runs made."""
    trial, t_ranks, t_failed, now = _run(replace(spec, swaps=swaps, cloned=cloned), ref, tol, result)
    more = None if trial.exact or cloned or not t_failed else \
        clones_candidate(t_failed[0].get("message", ""), now and now[0], t_failed[0]["went"])
    if more:
        again = _run(replace(spec, swaps=swaps, cloned=more), ref, tol, result)
        if again[0].exact or again[3] != now:
            return (*again, (more, now[0]), 2)
    return trial, t_ranks, t_failed, now, (cloned, ""), 1 + bool(more)


def _module_fixes(spec: Spec, ref: dict, tol: float, result: CheckResult, located: tuple | None,
                  record: dict) -> tuple[list[str], bool, Any] | None:
    """Where the run went wrong in the scope of a split Linear whose module counts heads by the whole model's count
    (``record``: a rank's), the parallel run again with those counts divided by TP (:mod:`vemesh.check.heads`);
    where a forward changed a TP style's output in place, first or then, again with a copy of it
    (:mod:`vemesh.check.clones`), with the counts where they cleared their scope. The hints, and whether the last
    run was exact, and the head counts' recipe (None where there is none); None where neither applies."""
    if located is None:
        return None
    recipe = heads_candidate(located[0], located[2], located[3].get("colwise", []), record.get("heads", {}),
                             record.get("tables", {}), record.get("handed", {}))
    copied = clones_candidate(record.get("message", ""), located[0], located[3])
    heads = (recipe,) if recipe is not None and not copied else ()  # a change in place raised first: the copy first
    tries, hints, exact = [(heads, copied or (), located[0], "")] if heads or copied else [], [], False
    while tries:
        heads, cloned, where, before = tries.pop()  # before: where the counts alone left the run
        trial, t_ranks, t_failed, now = _run(replace(spec, heads=heads, cloned=cloned), ref, tol, result)
        exact, outcome = trial.exact, "" if trial.exact else went_wrong(trial, now)
        if cloned and exact and heads:  # the counts cleared their scope, and the copy did the rest
            hints[-1] = heads_hint(recipe, located[1] is None, before, cleared=True)
        hints.append(clones_hint(cloned, where, outcome) if cloned else heads_hint(recipe, located[1] is None, outcome))
        if exact or now is None or not t_failed or len(hints) > 1:
            break
        if heads and (more := clones_candidate(t_failed[0].get("message", ""), now[0], t_failed[0]["went"])):
            tries.append((heads, more, now[0], outcome))
    if hints and heads and not (exact or cloned or trial.error or trial.first_module) and trial.gradients:
        more_hints: list[str] = []  # the counts cleared the forward; gradients left (Persimmon's norms over its heads)
        exact = _partial_hints(replace(spec, heads=heads), ref, tol, trial, t_ranks, None, more_hints)[1]
        hints = hints[:-1] + [heads_hint(recipe, located[1] is None, outcome, cleared=exact)] + more_hints
    return (hints, exact, recipe) if hints else None


def _partial_hints(spec: Spec, ref: dict, tol: float, result: CheckResult, ranks: list[dict], replicas: dict | None,
                   hints: list[str]) -> tuple[int, bool]:
    """Every output matched and gradients differ (or vemesh's DDP or FSDP2 raised that replicas over TP got other
    gradients on each TP rank: ``replicas``, the failed rank's record): DP's missing average; an unsplit Linear's
    features read by every head, tried with SumGradOverTP (:func:`_summed_hints`); or modules with replicated
    parameters run on this TP rank's part of their input, tried with torch's SequenceParallel on them
    (:mod:`vemesh.check.partial`). Where a wrapper raised, the SequenceParallel tries come first, then a run without its
    check of the replicas gives the gradients the SumGradOverTP tries read. The hints are added to ``hints``; returns
    the parallel runs made, and whether the last made the check exact."""
    if replicas is None:
        wrapped = any(r.get("data_parallel", False) for r in ranks)
        zero = sorted(n for n in vanishing(ref["grads"]) - {n for n, _ in result.gradients} if n in ranks[0]["grads"])
        said = (zero_bubble_hint(spec.pp_schedule, result.degrees["DP"], wrapped) if "PP" in result.degrees else None) \
            or unsynced_hint(ranks) or outside_fsdp_hint(result.degrees, [n for n, _ in result.gradients], ranks) \
            or scale_hint(result, ref, ranks, tol) \
            or dp_hint(result.degrees, len(result.gradients), result.gradients_compared, wrapped, zero)
        if said is not None:
            hints.append(said)
            return 0, False
        params, shapes = [n for n, _ in result.gradients], first_shapes(ranks)
    else:  # under PP, one stage's rank said it: the others' alike too
        params, shapes = on_every_stage(replicas.get("params", []), replicas.get("shapes", {}), ref) \
            if "PP" in result.degrees else (replicas.get("params", []), replicas.get("shapes", {}))
    runs, said = _summed_hints(spec, ref, tol, result, ranks, hints) if replicas is None else (0, None)
    if said:
        return runs, said == "exact"
    kept: tuple = ()  # the recipes that made their own modules' gradients match, kept in the tries after them
    for recipe in partial_candidates(params, ref, shapes, result.degrees["TP"])[:MAX_TRIES - runs]:
        trial = CheckResult("exact", result.degrees, result.world_size, result.micro_batch_size, tol)
        t_ranks, t_failed, _ = _parallel(replace(spec, sharded=(*kept, recipe)), ref, tol, trial)
        runs += 1
        located = _located(ref, trial, t_ranks, t_failed) if not trial.exact else None
        still = [n for n, _ in trial.gradients] if t_ranks else params  # a run that raised compared none
        still = [n for n in still if n.rpartition(".")[0] in recipe.modules]
        hints.append(partial_hint(recipe, "" if trial.exact else went_wrong(trial, located), still, len(kept)))
        kept += () if still else (recipe,)
        if trial.exact:
            return runs, True
    if replicas is not None and runs < MAX_TRIES - 1:  # the gradients, from a run without vemesh's replica check
        seen, seen_ranks, _, _ = _run(replace(spec, replica_check=False), ref, tol, result)
        runs += 1 + _summed_hints(spec, ref, tol, seen, seen_ranks, hints, MAX_TRIES - runs - 1)[0]
    return runs, False


def _summed_hints(spec: Spec, ref: dict, tol: float, result: CheckResult, ranks: list[dict], hints: list[str],
                  tries: int = MAX_TRIES) -> tuple[int, str | None]:
    """Unsplit Linears whose gradient differs in one block of rows (``result``, ``ranks``: a run's), tried with
    SumGradOverTP on those features (:func:`vemesh.check.partial.row_candidates`), or said summed twice; the hints are
    added to ``hints``. Returns the parallel runs made, and why nothing else is to be tried ("exact", or "said": no recipe
    to try), or None."""
    params = [n for n, _ in result.gradients]
    found = row_candidates(params, ref, ranks, ranks[0]["went"], tol) if ranks else []
    if ranks and not found and (twice := twice_hint(params, ref, ranks, ranks[0]["went"], tol, result.degrees["TP"])):
        hints.append(twice)
        return 0, "said"
    for runs, summed in enumerate(found[:tries], 1):
        trial, _, _, located = _run(replace(spec, summed=(summed,)), ref, tol, result)
        hints.append(summed_hint(summed, "" if trial.exact else went_wrong(trial, located)))
        if trial.exact:
            return runs, "exact"
    return min(len(found), tries), None
