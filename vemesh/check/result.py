"""What ``vemesh check`` found (:class:`CheckResult`: its verdict, the text it prints and its JSON), and its input error."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from vemesh.parallel.plan_keys import describe

__all__ = ["CheckInputError", "CheckResult", "built", "check_size", "phases", "went_wrong"]

#: the parallel run's phases in :attr:`CheckResult.seconds`, on its slowest rank
_PHASES = ("processes start", "your code's imports", "mesh", "build and parallelize", "step", "gather")


#: what a plan entry that torch skipped means for the verdict, in a run that computed the model and in one that did not
_SKIPPED_THEN = {True: "the numbers are right; the memory and the speed are not what the plan meant",
                 False: "beside the modules the plan did shard"}


class CheckInputError(ValueError):
    """Bad input to the check (a reference, a degree, a step that raises in one process): one line, exit 2."""


@dataclass
class CheckResult:
    """What ``vemesh check`` found; :meth:`render` is the text it prints, :meth:`to_json` its ``--json``."""

    #: ``"exact"``, ``"differs"`` (a wrong plan), ``"random"`` (a random op in the forward makes them differ),
    #: ``"by_rank"`` (the step chose its batch by its rank: the runs had other inputs), or ``"failed"`` (the user's
    #: code raised in the parallel run before its step: in the factory, the parallelize function or the stages'
    #: set-up; nothing was compared)
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
    #: the first of them that is TP times one process's along one dim, ``{"module", "dim", "length"}`` (``length``:
    #: one process's along it): a whole sequence read as this TP rank's part (:mod:`vemesh.check.positions`)
    repeated: dict[str, Any] | None = None
    #: under PP, the modules under a name of the model that a stage holds with other parameters than the model's
    #: module of that name (the base model's module over the stage's layers, a stand-in): left out (counted)
    outputs_partial: int = 0
    #: under PP, the parameters of the model as built that no stage holds (their gradients were never computed)
    unheld: list[str] = field(default_factory=list)
    #: under PP, the stages' parameters whose names the model as built does not have (nothing to pair them with)
    unknown: list[str] = field(default_factory=list)
    #: under PP, the ties of the model as built whose ends the stages hold apart (each trains on its own part)
    split_ties: list[tuple[str, ...]] = field(default_factory=list)
    #: the first module whose output differs: name, call, DP rank, relative difference; and the modules before it
    first_module: dict[str, Any] | None = None
    matched_before: list[str] = field(default_factory=list)
    #: ``(parameter, relative difference)`` of the gradients that differ, worst first
    gradients: list[tuple[str, float]] = field(default_factory=list)
    broken_ties: list[list[str]] = field(default_factory=list)
    #: the likeliest fix, where the check can see one (a fused projection split as torch's ColwiseParallel splits)
    hints: list[str] = field(default_factory=list)
    #: the parallel run raised where one process did not (the plan's error, or vemesh's tie or TP-replica check)
    error: str = ""
    #: under CP, no module's output was a part of the sequence: every CP rank ran the whole of it (the step does not
    #: cut it), so the check compared data parallelism, not CP's
    cp_whole_sequence: bool = False
    #: under TP, no parameter was a DTensor on the TP dim on any rank, and every gradient had one process's shape: the
    #: parallelize function applied no TP, so each TP rank ran the whole model and the check compared DP alone
    tp_whole_model: bool = False
    #: under DP, one process's module outputs were the same for every DP rank's step: the step drew the same batch
    #: for each (not from torch's RNG, which the check seeds per DP rank), so DP's average was not checked
    dp_same_batch: bool = False
    #: and the parallel run's DP ranks drew other batches: the step chose its batch by its rank, which one process
    #: does not have (the verdict ``"by_rank"``: not comparable)
    dp_batch_by_rank: bool = False
    dropouts: int = 0
    #: under PP, the most calls of torch's ``clip_grad_norm_`` the step made on a PP rank: each clips its stages by
    #: their own norm, not the model's
    stage_clips: int = 0
    #: and where the gradients differ, each PP rank's factor over one process's (``{}``: not one factor a rank)
    stage_scales: dict[int, float] = field(default_factory=dict)
    #: the first module the user's functions compiled (torch.compile): both runs ran it eagerly
    compiled: str | None = None
    random_ops: list[tuple[str, str]] = field(default_factory=list)
    #: ``(key, token, owner class)`` of the TP plan entries that torch's ``parallelize_module`` skipped because their
    #: names match no submodule (:mod:`vemesh.parallel.plan_keys`): what they name ran unsharded
    skipped_plan: list[tuple[str, str, str]] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    dp_replicate: int = 1  #: HSDP's replica degree: DP is split into dp_replicate x dp_shard
    #: the dtypes below fp32 of FSDP2's ``MixedPrecisionPolicy`` in the parallel run (``param_dtype``,
    #: ``reduce_dtype``, ``output_dtype``: torchtitan's bf16), which it ran in the parameters' own dtype instead
    lowered: list[str] = field(default_factory=list)
    #: where DP > 1, the first collective the step ran itself (``allgather at job.py:32 in step``): one process ran
    #: the step on the DP ranks' batches together (:mod:`vemesh.check.reference`); and why not, where it then ran
    #: each DP rank's batch alone (``torch.randint at job.py:28 could not be drawn per DP rank``); and the module
    #: outputs of that run without the DP ranks' rows, not compared (a loss over them all); ``("", "", 0)``: none
    coupled: tuple[str, str, int] = ("", "", 0)
    #: the 16-bit dtypes of the step's ``torch.autocast``, which both runs entered disabled (in full precision)
    autocast: list[str] = field(default_factory=list)
    #: why the parallel run was run again (a rank gloo aborted, or the kernel killed: :mod:`vemesh.check.rerun`)
    reruns: list[str] = field(default_factory=list)

    @property
    def pipeline_cut_wrong(self) -> bool:
        """Under PP, the stages do not hold the model as built: a parameter no stage holds, one named otherwise, or
        a tie whose ends two stages hold."""
        return bool(self.unheld or self.unknown or self.split_ties)

    @property
    def exact(self) -> bool:
        """The parallel run computes what one process does (within :attr:`rtol`), and no tie was broken."""
        return self.verdict == "exact"

    def to_json(self) -> dict[str, Any]:
        """Every field, and ``exact``: what ``--json`` prints."""
        return asdict(self) | {"exact": self.exact}

    def render(self) -> str:
        """The verdict in words: what ``vemesh check`` prints."""
        mesh = " x ".join(f"{k} {v}" + (f" (dp_replicate {self.dp_replicate} x dp_shard {v // self.dp_replicate})"
                                          if k == "DP" and self.dp_replicate > 1 else "")
                          for k, v in self.degrees.items() if v > 1) or "one rank"
        head = (f"{mesh} on {self.world_size} gloo processes against one process, micro-batch "
                f"{self.micro_batch_size}: {self.outputs_compared} module outputs and {self.gradients_compared} "
                "gradients compared" + (f" ({self.outputs_not_comparable} outputs of another shape that no join of "
                                        "TP or CP shards explains left out)" if self.outputs_not_comparable else "")
                + (f" ({self.outputs_partial} module{'s' if self.outputs_partial > 1 else ''} of a stage that "
                   f"{'are' if self.outputs_partial > 1 else 'is'} not the model's of {'their' if self.outputs_partial > 1 else 'its'} "
                   "name, such as the base model over the stage's layers, left out)" if self.outputs_partial else ""))
        lines = []
        if self.exact:
            lines.append(f"vemesh check: exact. {head}; largest relative difference {self.largest:.1e}"
                         + (f" ({self.largest_at})" if self.largest_at else "") + f", within {self.rtol:g}")
        elif self.verdict == "random":
            lines.append(f"vemesh check: not comparable: random numbers drawn in the forward. {head}")
            ops = ", ".join(sorted({f"{op} in {m or 'the root'}" for m, op in self.random_ops}))
            lines.append(f"  {ops}: the two runs draw them differently, so they differ (not a verdict on the plan). "
                         "Make the forward deterministic for the check (a factory argument), and check again")
        elif self.verdict == "by_rank":
            lines.append(f"vemesh check: not comparable: the step chose its batch by its rank. {head}")
            lines.append(f"  in one process the {self.degrees['DP']} DP ranks' steps drew the same batch, and in the "
                         "parallel run each DP rank another: the step chose its inputs by what one process does not "
                         "have (its rank: torch.distributed.get_rank(), the mesh's get_local_rank('DP'), a "
                         "DistributedSampler), so the two runs had other inputs (not a verdict on the plan). The check "
                         "gives each DP rank its own batch by seeding torch's RNG with that rank's seed: draw the "
                         "step's inputs from it (torch.randint, torch.randn, a random index into your data), and "
                         "check again")
        elif self.verdict == "failed":
            lines.append(f"vemesh check: NOT CHECKED: the parallel run ({mesh} on {self.world_size} gloo processes) "
                         "failed before its step, so nothing was compared; one process ran the model as built")
        else:
            lines.append(f"vemesh check: DIFFERS from one process. {head}")
        if self.coupled[0]:
            dp, micro = self.degrees["DP"], self.micro_batch_size
            lines.append(f"  the step's own collectives couple the DP ranks' batches ({self.coupled[0]}), so one "
                         f"process ran it once on them together ({dp} x {micro} rows, each DP rank's drawn from its "
                         "seed): its gradients are one process's on the whole batch" + (
                             f"; {self.coupled[2]} module output(s) without those rows (a loss over them all) not "
                             "compared" if self.coupled[2] else "") if not self.coupled[1] else
                         f"  the step's own collectives couple the DP ranks' batches ({self.coupled[0]}), but "
                         f"{self.coupled[1]}, so one process ran each DP rank's batch alone, where each collective "
                         "has one rank: " + (
                             "what the coupling adds was not checked" if self.exact else "a difference may be that of "
                             "the coupling, not of the plan; check the plan at DP 1 (--dp 1)"))
        if self.exact and self.outputs_compared and not self.gradients_compared:
            lines.append("  but the step computed no gradient (no loss.backward(): no parameter had one after it in "
                         "one process), so only the forward was compared; what a plan gets wrong in the backward (a "
                         "norm over this rank's heads, a gradient DP does not average) was not checked")
        if self.cp_whole_sequence:
            lines.append(f"  {'but' if self.exact else 'and'} CP {self.degrees['CP']} cut no sequence: every module's "
                         "output on each CP rank is the whole sequence's, so each CP rank ran all of it and this "
                         "checked DP alone; cut the inputs in the step with vemesh.parallel.context_parallel "
                         "(docs/context-parallel.md)")
        if self.tp_whole_model:
            lines.append(f"  {'but' if self.exact else 'and'} TP {self.degrees['TP']} sharded nothing: no parameter is a "
                         "DTensor on the TP dim, so each TP rank ran the whole model and this checked DP alone; "
                         "shard it in --parallelize (parallelize_module on mesh['TP'])")
        if self.dp_same_batch and self.verdict != "by_rank":
            dp = self.degrees["DP"]
            lines.append(f"  {'but' if self.exact else 'and'} every DP rank's step drew the same batch (in one process "
                         f"the {dp} DP ranks' steps gave equal module outputs), so DP's average was not "
                         "checked: a plan without its data-parallel wrapper checks exact too. The check seeds torch's "
                         "RNG with each DP rank's seed; draw the step's inputs from it (torch.randint, torch.randn), "
                         "not from a torch.Generator of the step's own or fixed data")
        for names in self.broken_ties:
            lines.append(f"  tie broken: {' and '.join(names)} are one parameter in the model as built and several "
                         "after parallelize: shard every end the same way with vemesh.parallel.parallelize_module, "
                         "or re-tie them")
        if self.unheld:
            shown = _some(self.unheld, 6)
            them = "them" if len(self.unheld) > 1 else "it"
            lines.append(f"  held by no stage ({len(self.unheld)}): {shown}: the model as built has {them} and no PP "
                         f"rank's stages do, so the pipeline trains without {them}; give each to the stage whose part "
                         "of the forward uses it")
        for names in self.split_ties:
            lines.append(f"  tie split across stages: {' and '.join(names)} are one parameter in the model as built, "
                         "and two stages hold its ends: each gets its own part of the gradient and they train apart; "
                         "keep the ends on one stage, or untie them before cutting (tie_word_embeddings=False)")
        if self.unknown:
            shown = _some(self.unknown, 3)
            lines.append(f"  named otherwise than in the model ({len(self.unknown)}): {shown}: the check pairs each "
                         "stage's parameters with the model's by name, so a stage module must keep the model's names "
                         "(layer 3 as model.layers.3 on whichever stage holds it), as vemesh.parallel.DecoderStage does")
        if self.stage_clips:
            lines.append(f"  {'but' if self.exact else 'and'} the step called torch's clip_grad_norm_ on each PP rank "
                         "(over its stages' parameters): it takes the norm of that rank's gradients alone, so each "
                         "stage clips by its own norm where one process clips by the model's" + (
                             " (this step's norms stayed under max_norm, so it did not show)" if self.exact else
                             " (each PP rank's gradients are one factor times one process's: " + ", ".join(
                                 f"PP rank {r} {f:.3g}" for r, f in self.stage_scales.items()) + ")"
                             if self.stage_scales else " (the gradients that differ may be that)")
                         + "; clip with vemesh.optim.clip_grad_norm_(params, max_norm, groups=[mesh['PP'].get_group()])"
                         ", the model's norm over PP")
        if self.skipped_plan:
            lines.append(f"  {'but ' if self.exact else ''}{describe(self.skipped_plan, _SKIPPED_THEN[self.exact])}")
        if self.error:
            raised = "hung" if " did not finish " in self.error else "raised"
            said = "" if self.verdict == "failed" else f"the parallel run {raised} where one process did not: "
            lines.append(f"  {said}{self.error}")
        if self.first_module is not None:
            fm = self.first_module
            lines.append(f"  first module whose output differs: {fm['module'] or '(the root)'} (forward call "
                         f"{fm['call'] + 1}, DP rank {fm['dp_rank']}): relative difference {fm['difference']:.3g}")
            if self.matched_before:
                lines.append(f"  the modules just before it match: {', '.join(self.matched_before)}")
        lines += [f"  hint: {hint}" for hint in self.hints]
        if self.gradients and self.first_module is None and not self.broken_ties and not self.error and not self.hints \
                and not self.split_ties and not self.stage_clips:
            lines.append("  every output matches but gradients differ: a parameter whose gradient is each TP rank's "
                         "part only (a norm over its own heads, or between sequence-parallel regions, without "
                         "SequenceParallel), or a gradient that DP does not average")
        if self.gradients:
            lines.append(f"  gradients that differ ({len(self.gradients)}), worst first:")
            lines += [f"    {name}: {diff:.3g}" for name, diff in self.gradients[:12]]
            if len(self.gradients) > 12:
                lines.append(f"    and {len(self.gradients) - 12} more")
        if self.compiled:
            lines.append(f"  compiled: your functions compiled modules with torch.compile (the first: {self.compiled!r}); "
                         "both runs ran them eagerly, so this checked the parallelization, not inductor's code")
        if self.lowered:
            lines.append(f"  mixed precision: FSDP2's MixedPrecisionPolicy ({', '.join(self.lowered)}) ran in the "
                         "parameters' own dtype, as one process does, so this checked the parallelization, not "
                         f"{' and '.join(self.lowered)} rounding")
        if self.autocast:
            lines.append(f"  mixed precision: the step's torch.autocast ({', '.join(self.autocast)}) ran disabled in "
                         "both runs, in the parameters' own dtype, so this checked the parallelization, not "
                         f"{' and '.join(self.autocast)} rounding")
        if self.dropouts:
            lines.append(f"  dropout: {self.dropouts} calls drew nothing in either run (p taken as 0)")
        lines += [f"  {why}" for why in self.reruns]  # the parallel run run again, and why
        if self.seconds:
            parts = [f"{k} {v:.1f}s" for k, v in self.seconds.items()]
            inner = [p for p, k in zip(parts, self.seconds) if k in _PHASES]
            outer = [p for p, k in zip(parts, self.seconds) if k not in _PHASES]
            if inner:  # the parallel run's phases, in brackets after it
                at = next(i for i, k in enumerate(k for k in self.seconds if k not in _PHASES) if k == "parallel run")
                outer[at] += f" ({', '.join(inner)})"
            lines.append("  time: " + ", ".join(outer))
        return "\n".join(lines)


def _some(names: list[str], n: int) -> str:
    """The first ``n`` of ``names``, and how many more."""
    return ", ".join(names[:n]) + (f" and {len(names) - n} more" if len(names) > n else "")


def phases(ranks: list[dict], launched: float) -> dict[str, float]:
    """Where the parallel run's time went, on its slowest rank at each mark (after the first process started)."""
    if not ranks:
        return {}
    at = {k: max(r["marks"][k] for r in ranks) for k in ranks[0]["marks"]}
    return {"processes start": at["started"] - launched, "your code's imports": at["loaded"] - at["started"],
            "mesh": at["mesh"] - at["loaded"],
            "build and parallelize": at["parallelized"] - at["mesh"], "step": at["stepped"] - at["parallelized"],
            "gather": at["gathered"] - at["stepped"]}


def built(model: Any, name: str) -> Any:
    """``model``, the factory's, as one process runs it; ``CheckInputError`` (one line) where it is no ``nn.Module``, or
    where its parameters are on the meta device (torchtitan builds there and materializes in its parallelize function:
    one process would run a model of no values, and the comparison failed on them)."""
    import torch

    if not isinstance(model, torch.nn.Module):
        raise CheckInputError(f"--model {name} returned {type(model).__name__}, not an nn.Module")
    if meta := [n for n, p in model.named_parameters() if p.is_meta][:2]:
        raise CheckInputError(
            f"--model {name} built its parameters on the meta device ({', '.join(meta)}, ...), with no values: the "
            "check compares one process's outputs with the parallel run's from the same weights, so its factory must "
            "build them (torch.device('cpu') in place of 'meta', then your init_weights()), and your parallelize "
            "function must keep them (to_empty and init_weights only where they are still on meta)")
    return model


def check_size(factory: Any, spec: Any, names: tuple[str, str, str]) -> None:
    """A model the machine cannot hold ``world_size + 1`` times (with gradients) is refused before it is built
    (``spec``: the check's :class:`~vemesh.check.run.Spec`)."""
    import torch  # here: this module is read without torch (the CLI's result types)

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


def check_pipeline(pp: int, loss: Any, pp_schedule: str) -> None:
    """``--pp``, ``--loss`` and ``--pp-schedule`` together, one line each where they do not go together."""
    if pp > 1 and loss is None:
        raise CheckInputError(f"--pp {pp} runs your stages through torch's pipeline schedule, which computes the loss "
                              "on the last stage: give --loss MODULE:FUNCTION (loss_fn(output, target), as the "
                              "schedule and vemesh plan take it)")
    if pp == 1 and loss is not None:
        raise CheckInputError("--loss is the pipeline schedule's loss_fn: give --pp N (2 or more) with it, or leave it "
                              "out (without PP your step computes its own loss)")
    from vemesh.parallel.schedules import schedule_class  # here: this module is read without torch

    try:
        schedule_class(pp_schedule)
    except ValueError as e:
        raise CheckInputError(f"--pp-schedule: {e}") from None


def went_wrong(trial: CheckResult, located: tuple | None) -> str:
    """Where a tried recipe's run still went wrong, in a few words (``located``: where it raised, if it did)."""
    if trial.first_module is not None:
        return f"differs at {trial.first_module['module']}"
    if located is not None:
        return f"raises in {located[0] or 'the root'}"
    if trial.gradients:
        return f"differs in {trial.gradients[0][0]}'s gradient"
    # the error's words, not its frame: a site-packages path filled the 160 characters before the error's own text
    return re.sub(r" failed at \S+ in [\w<>.]+: ", " failed: ", trial.error)[:160] if trial.error else "differs"
