"""Alike middle PP ranks added by difference (vemesh.planning.pipeline_plan._rank_plan): under a one-stage schedule
each rank added equals its own trace, in every figure; a rank whose stages differ (a block more) starts
a run of its own; and where the checked rank is not the difference, the run is traced."""

from __future__ import annotations

from dataclasses import replace

import pytest

from models.tiny_llama3_pipelines import TINY, tiny_pipeline
from vemesh.models.llama3 import planned
from vemesh.planning import pipeline_plan
from vemesh.planning.pipeline_trace import MetaExchange
from vemesh.planning.results import Counted


def _plan_and_alone(schedule: str, mode: str, batch: int, pp: int, extra: int, monkeypatch: pytest.MonkeyPatch) -> tuple:
    """The plan with alike middle ranks added by difference, and each rank it added traced on its own: from what the
    ranks before and after it sent, with the records the plan's traces made (as a plan tracing every rank replays
    them)."""
    fns, kwargs = tiny_pipeline(schedule, mode, batch, pp, 1)
    if extra:  # the first ``extra`` stages hold a block more (split_layers)
        fns = replace(fns, factory=planned.factory(replace(TINY, n_layers=pp + extra)))
    traced: list[int] = []
    exchanges: list[MetaExchange] = []

    def trace_user(*args, trace_user=pipeline_plan.trace_user, **kw):
        traced.append(kw["pp_rank"])
        return trace_user(*args, **kw)

    class Exchange(MetaExchange):
        def __init__(self, *args, **kw) -> None:
            super().__init__(*args, **kw)
            exchanges.append(self)

    monkeypatch.setattr(pipeline_plan, "trace_user", trace_user)
    monkeypatch.setattr(pipeline_plan, "MetaExchange", Exchange)
    notes: list[str] = []
    counted = pipeline_plan.trace_pipeline(fns, kwargs, notes)
    by_difference = {r: pipeline_plan._slots(c, r, fns, pp) for r, c in counted.items()}
    (used,) = exchanges
    alone = MetaExchange(replay=pipeline_plan.REPLAY)
    alone.records, alone.forward, alone.backward = used.records, dict(used.forward), dict(used.backward)
    planned_traced = sorted(set(traced))
    derived = [r for r in range(pp) if r not in planned_traced]
    whole = {r: pipeline_plan._slots(pipeline_plan._trace_rank(fns, r, alone, kwargs), r, fns, pp) for r in derived}
    return by_difference, notes, planned_traced, whole


@pytest.mark.slow  # 10 and 12 s alone: started with the other long runs (conftest.py)
@pytest.mark.parametrize("schedule, mode, pp, batch, extra", [("1f1b", "zero1", 7, 24, 0), ("gpipe", "fsdp", 8, 8, 2)])
def test_alike_middle_ranks_by_difference_equal_their_own_traces(schedule, mode, pp, batch, extra,
                                                                  monkeypatch) -> None:
    """PP x DP 2, micro-batches of 1: 1F1B under ZeRO-1 over PP 7, 12 micro-batches, a block a stage (PP ranks 1 to 3
    and 5 traced, 4 by difference; with 8, gloo's hold of a warm-up send past its backward
    (:class:`~vemesh.planning.pipeline_trace._Held`) reaches the peak of PP ranks 2 to 5 but not of PP rank 1, so they
    are not on one line, and the plan's check traces them all), GPipe under FSDP2 over PP 8, 4 micro-batches, the first
    two stages holding a block more (PP rank 1 alone; 2 to 4 and 6 traced, 5 by difference). Every figure of each rank
    added by difference equals that rank's own trace (from what its neighbours sent): the peak, the bytes held by kind,
    the FLOPs, the bytes moved, the collectives, each action's part. (The ranks the plan traces are traced as a plan
    tracing every rank traces them.)"""
    by_difference, notes, traced, whole = _plan_and_alone(schedule, mode, batch, pp, extra, monkeypatch)
    first = 2 if extra else 1
    assert traced == sorted({0, 1, first, first + 1, first + 2, pp - 2, pp - 1})
    derived = sorted(whole)
    assert derived == list(range(first + 3, pp - 2))
    assert any(n.startswith(("PP ranks", "PP rank")) and f"difference of PP ranks {first} and {first + 1}" in n
               for n in notes), notes
    for r in derived:
        assert by_difference[r] == whole[r], r
    forwards = [max(p for k, (p, _) in by_difference[r].phases.items() if " F@0" in k) for r in (first, derived[-1])]
    # the highest bytes in a forward: 1F1B, a micro-batch fewer in flight a rank; GPipe, every one on every rank
    assert forwards[1] < forwards[0] if schedule == "1f1b" else forwards[1] == forwards[0]


def _count(peak: int, flops: int = 10) -> Counted:
    return Counted({"params": 1, "grads": 0, "optimizer": 0, "activations": peak - 1}, peak, {"DP": 4}, "ddp", False,
                   flops=flops)


def test_a_run_whose_checked_rank_is_not_the_difference_is_traced(monkeypatch) -> None:
    """PP ranks 1, 2, 3 and 6 traced; where 3 is not 2 plus what 2 has over 1, or 6 is not 2 plus 4 times it (a
    figure that falls over ranks 1 to 3 and then stays flat), 4 and 5 are traced, not added."""
    fns, kwargs = tiny_pipeline("1f1b", "zero1", 28, 7, 1)
    monkeypatch.setattr(pipeline_plan, "_trace_rank", lambda fns, rank, exchange, kwargs: _count(1000 + rank))
    counted = {0: _count(50), 1: _count(30), 2: _count(20), 3: _count(11), 6: _count(-20), 7: _count(5)}
    notes: list[str] = []
    exchange = MetaExchange()
    exchange.forward.update({3: "3's", 4: "alike 2's", 5: "alike 2's"})  # filled from rank 2 while the others traced
    out = pipeline_plan._by_difference(fns, kwargs, exchange, counted, {4: (1, 2), 5: (1, 2)}, notes)
    assert (out[4].peak, out[5].peak) == (1004, 1005)
    assert exchange.forward == {3: "3's"}  # 4 and 5 traced from what 3, then 4, send
    assert notes == ["PP ranks 4 to 5: alike stages, but PP rank 3 is not on the difference of PP ranks 1 and 2; "
                     "traced"]
    counted[3], counted[6] = _count(10), _count(10)  # the kink: 10 fewer a rank to PP rank 3, then flat
    notes.clear()
    out = pipeline_plan._by_difference(fns, kwargs, exchange, counted, {4: (1, 2), 5: (1, 2)}, notes)
    assert (out[4].peak, out[5].peak) == (1004, 1005)
    assert notes == ["PP ranks 4 to 5: alike stages, but PP rank 6 is not on the difference of PP ranks 1 and 2; "
                     "traced"]
    counted[6] = _count(-20)
    out = pipeline_plan._by_difference(fns, kwargs, exchange, counted, {4: (1, 2), 5: (1, 2)}, notes)
    assert (out[4].peak, out[5].peak) == (0, -10)  # 10 fewer a rank, as the traced ranks said (a made-up count)


@pytest.mark.parametrize("preset", ["gpt", "llama3"])
def test_a_presets_own_cut_finds_the_alike_ranks_that_building_them_finds(preset, monkeypatch) -> None:
    """The presets say what each PP rank's stages hold from their own cut (``UserFunctions.stage_kinds``), where a
    user's functions build each rank's stages to compare them (``stage_signatures``, 2 s a rank at 70B width). 1F1B
    over PP 8 of 10 blocks, the first two stages holding a block more: both ways make PP rank 1 a run of its own, and
    of ranks 2 to 6 trace 2, 3, 4 and 6 and add 5 by difference. Llama 3's ``selective-2`` recomputes blocks by
    their number: with 3 blocks a stage, the PP ranks alternate, and the cut tells them apart."""
    from vemesh.models.llama3 import planned as llama3_planned
    from vemesh.planning import fit
    from vemesh.planning.user_model import trace_arguments

    pp = 8
    if preset == "gpt":
        fns = fit._preset_functions(f"gpt:n_layer={pp + 2},n_embd=32,n_head=2,vocab=64,seq_len=16", "zero1", "fp32",
                                    False, False, "1f1b", True)
        kwargs = trace_arguments(world_size=2 * pp, degrees={"PP": pp, "DP": 2, "CP": 1, "TP": 1, "EP": 1},
                                 dp_replicate=1, global_batch_size=16, micro_batch_size=1, dtype="fp32",
                                 dp_mode="zero1", load_factor=1.0, timed=False)
    else:
        cfg = replace(TINY, n_layers=pp + 2)
        fns, kwargs = tiny_pipeline("1f1b", "zero1", 16, pp, 1)
        fns = replace(fns, factory=planned.factory(cfg),
                      stage_kinds=llama3_planned.stage_kinds_for(cfg, "full", "1f1b"))
        alternating = llama3_planned.stage_kinds_for(replace(TINY, n_layers=3 * pp), "selective-2", "1f1b")
        assert alternating(1, pp) != alternating(2, pp) and alternating(1, pp) == alternating(3, pp)
    built = pipeline_plan._rank_plan(replace(fns, stage_kinds=None), kwargs)

    def stage_signatures(*args, **kw):
        raise AssertionError("a preset's stages were built to be compared")

    monkeypatch.setattr(pipeline_plan, "stage_signatures", stage_signatures)
    assert pipeline_plan._rank_plan(fns, kwargs) == built == {5: (2, 3)}
