"""Replayed micro-batches (vemesh.planning.pipeline_replay) give the plan of tracing every micro-batch: the same peak,
the same bytes held by kind, the same collectives, FLOPs and memory-bound bytes, and the ops dispatched within a few
per replayed action (FakeTensor's device queries and FSDP2's profiler marks, which vary with their caches and state)."""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

import pytest

from models.tiny_llama3_pipelines import tiny_pipeline
from vemesh.planning import pipeline_plan
from vemesh.planning.fusion import Fusion
from vemesh.planning.pipeline_order import backward_contexts, gradients_may_change
from vemesh.planning.pipeline_replay import Effect, _alike, _balanced, _from_start


def _traced(schedule: str, mode: str, replay: bool, monkeypatch: pytest.MonkeyPatch, batch: int, pp: int,
            tp: int, traced_ranks: list[int] | None = None, **shape: Any) -> tuple:
    fns, kwargs = tiny_pipeline(schedule, mode, batch, pp, tp, **shape)
    monkeypatch.setattr(pipeline_plan, "REPLAY", replay)
    if traced_ranks is not None:  # the PP ranks traced again without replay: a replayed backward had no record
        def trace_user(*args, trace_user=pipeline_plan.trace_user, **kwargs):
            if replay and not kwargs["exchange"].replay:
                traced_ranks.append(kwargs["pp_rank"])
            return trace_user(*args, **kwargs)

        monkeypatch.setattr(pipeline_plan, "trace_user", trace_user)
    notes: list[str] = []
    return pipeline_plan.trace_pipeline(fns, kwargs, notes), notes


@pytest.mark.slow  # each pipeline traced twice, with and without replay: about a minute each on a loaded machine
@pytest.mark.parametrize("schedule, mode, batch, pp, tp", [("1f1b", "fsdp", 12, 4, 2), ("interleaved-1f1b", "fsdp", 16, 2, 1),
                                                          ("1f1b", "zero1", 12, 4, 1)])
def test_replayed_micro_batches_give_the_plan_of_tracing_every_one(schedule, mode, batch, pp, tp, monkeypatch) -> None:
    """6 micro-batches per DP rank under 1F1B, FSDP2 (as torchtitan shards for PP: no reshard after forward) and TP 2
    over PP 4, where PP ranks 1 and 2 hold alike stages and share their records, and the last stage returns DTensors
    (loss-parallel's logits), replayed as DTensors; 8 under interleaved 1F1B over PP 2, where another stage's first
    and last backwards fall between a micro-batch's forward and backward; 6 under 1F1B and ZeRO-1 over PP 4, whose
    backwards after the first start from the gradients it allocated.

    No PP rank is traced again without replay (no replayed forward meets a backward without a record: the first
    backward of a step, which allocates the gradients, is told from the others) and the second step replays from the
    first's records: more than a quarter of the actions are replayed. Before, the first pipeline replayed 9 of 76,
    the second 28 of 128, and 1F1B with FSDP2 over PP 4 without TP 21 of 100 and traced a rank twice."""
    from torch.distributed.tensor import DTensor

    from vemesh.planning import pipeline_replay

    kinds: set[type] = set()  # of the tensors replays made (not the tensors: holding them would change the peak)

    def make(*args, make=pipeline_replay._make):
        t = make(*args)
        kinds.add(type(t))
        return t

    monkeypatch.setattr(pipeline_replay, "_make", make)
    ranks: list[int] = []
    replayed, notes = _traced(schedule, mode, True, monkeypatch, batch, pp, tp, ranks)
    assert (DTensor in kinds) == (tp > 1), kinds
    shares = [re.search(r"(\d+) of (\d+) stage forwards", n) for n in notes]
    done, total = next(map(int, m.groups()) for m in shares if m)  # the shortcut was taken
    assert ranks == [], ranks
    assert done > total / 4, notes
    whole, _ = _traced(schedule, mode, False, monkeypatch, batch, pp, tp)
    for rank, c in whole.items():
        r = replayed[rank]
        # the peak within 4 bytes: the first plan of a process holds one fp32 scalar more (made once, then cached)
        assert abs(r.peak - c.peak) <= 4, rank
        # and so each part's: what the plans by difference scale (a replayed backward's parts past what its forward
        # kept once peaked at the backward's start, 2 GiB over the trace on the 70B's last stage, 129.5 GiB for 61)
        assert r.phases.keys() == c.phases.keys(), rank
        assert {k: p for k, (p, _) in r.phases.items() if abs(p - c.phases[k][0]) > 4} == {}, rank
        assert (r.sent, r.flops, r.memory_bytes, r.optimizer_bytes, r.by_op, r.counts, r.dtensor_ops) == \
            (c.sent, c.flops, c.memory_bytes, c.optimizer_bytes, c.by_op, c.counts, c.dtensor_ops), rank
        assert abs(r.ops - c.ops) <= done, rank  # within one op per action replayed in the plan


@pytest.mark.slow  # the pipeline traced twice, with and without replay (about 15 s alone)
def test_stages_of_one_shape_that_recompute_other_blocks_do_not_share_records(monkeypatch) -> None:
    """Under ``selective-3`` over PP 4 with 2 blocks a stage (4 micro-batches), PP ranks 1 and 2 hold stages of the
    same parameters, but rank 1 recomputes its second block (block 3) and rank 2 none: each keeps other activations.
    Each rank replays only its own records, and every PP rank's peak is its whole trace's. Before, rank 2 replayed
    rank 1's records and planned the activations rank 1 keeps (on ``llama3:8b`` over PP 8 under ``selective-3``, PP
    rank 3 at 2% over)."""
    shape = dict(blocks=2, ac="selective-3")
    replayed, notes = _traced("1f1b", "zero1", True, monkeypatch, 8, 4, 1, **shape)
    assert any("replayed from two traced alike" in n for n in notes), notes
    whole, _ = _traced("1f1b", "zero1", False, monkeypatch, 8, 4, 1, **shape)
    assert whole[1].peak != whole[2].peak  # the two stages do keep other activations
    # within 4 bytes: the first plan of a process holds one fp32 scalar more (made once, then cached)
    assert {r: c.peak for r, c in whole.items() if abs(replayed[r].peak - c.peak) > 4} == {}


def test_the_backward_context_is_read_from_torchs_action_list() -> None:
    """1F1B on PP rank 0 of 2 with 4 micro-batches: F0 F1 B0 F2 B1 F3 B2 B3; each backward follows a forward but the
    last, which follows a backward."""
    assert backward_contexts("1f1b", 2, 0, 4) == {(0, 0): "F", (0, 1): "F", (0, 2): "F", (0, 3): "B"}
    last = backward_contexts("1f1b", 2, 1, 4)  # the last rank alternates F and B throughout
    assert set(last.values()) == {"F"}


def test_the_action_list_says_which_backwards_follow_another_and_when_the_ranks_gradients_change() -> None:
    """Interleaved 1F1B on PP rank 0 of 2 with 4 micro-batches runs 0F0 0F1 2F0 2F1 0F2 2B0 0F3 2B1 2F2 0B0 2F3 0B1
    2B2 2B3 0B2 0B3: stage 2's first backward (2B0) falls between stage 0's forward and backward of micro-batches 0
    and 1, its last (2B3) between those of 2 and 3, and stage 0's first (0B0) between stage 2's of micro-batch 2. A
    replayed forward of those would meet its backward holding other gradient bytes than its record started from."""
    assert gradients_may_change("interleaved-1f1b", 2, 0, 4) == {(0, 0), (0, 1), (0, 2), (0, 3), (2, 2)}
    assert gradients_may_change("1f1b", 2, 0, 4) == set()  # one stage a rank: no other stage's backward
    assert backward_contexts("1f1b", 2, 0, 4, after_backward=True) == {(0, 0): False, (0, 1): True, (0, 2): True,
                                                                        (0, 3): True}


def _effect(net: int, ops: int = 10, returned: tuple = ((4,), (1,), None, True)) -> Effect:
    import torch

    meta = (returned[0], returned[1], torch.float32, returned[3], None) if returned else None
    return Effect(rises=(("", net + 64),), net=net, parts=((), ()), state=((), ()), counters=((), (100, ops, 0), (), (), ()),
                  returned=(meta,), single=True, fusion=())


def test_effects_alike_but_for_the_ops_count_and_balanced_forward_and_backward() -> None:
    assert _alike(_effect(32, ops=10), _effect(32, ops=12))
    assert not _alike(_effect(32), _effect(48))
    forward = _effect(16 + 64)  # returns 16 bytes (4 fp32), keeps 64
    assert _balanced(forward, _effect(16 - 64))  # its backward frees the 64 and returns an input gradient of 16
    assert not _balanced(forward, _effect(16 - 60))
    assert _from_start(forward)  # a forward part below its start would be played at its start: traced instead
    assert not _from_start(replace(forward, rises=(("", 64), (" blocks", -8))))


def test_a_new_storage_at_a_dead_ones_address_pays_none_of_its_writes() -> None:
    """Fusion keys a storage by its address: an allocation clears what a dead storage there left unpaid, so that a
    plan's compile bytes do not depend on where the allocator put things."""
    import torch

    fusion = Fusion()
    dead = torch.empty(1024)
    fusion._pending[dead.untyped_storage()._cdata] = 4096  # a region's write nobody read, left by a dead tensor
    fusion.see(torch.ops.aten.empty.memory_format, ((1024,),), {}, dead, matmul=False, collective=False)
    fusion.see(torch.ops.aten.mm.default, (dead.view(32, 32), dead.view(32, 32)), {}, torch.empty(32, 32),
               matmul=True, collective=False)
    assert fusion.fused_bytes == 0


def test_a_storage_written_by_a_region_is_forgotten_when_it_dies() -> None:
    """Whatever allocates the next storage at its address (an op's output, a collective's buffer not dispatched here):
    the dead storage's unpaid write is not paid by a read of the new one. Two alike micro-batches counted fused bytes
    4 KiB apart when it was."""
    import gc

    import torch

    fusion = Fusion()
    x, y = torch.ones(1024), torch.ones(1024)
    out = torch.empty(1024)
    fusion.see(torch.ops.aten.mul.Tensor, (x, y), {}, out, matmul=False, collective=False)  # a region writes ``out``
    key = out.untyped_storage()._cdata
    assert fusion.writer_of(out) == (fusion.region, 4096)
    del out
    gc.collect()
    assert key not in fusion._pending and key not in fusion._producer


@pytest.mark.slow  # half a minute alone: started with the other long runs (conftest.py)
def test_a_replayed_backward_peaks_in_each_part_where_its_trace_did() -> None:
    """The GPT preset cut at its blocks (PP 2 x DP 2 x TP 2, 3 blocks a stage, 8 micro-batches of 1): a replayed
    backward's parts past the blocks' (its ``tail``) hold less than at its start, once what its forward kept is
    freed. Every part of every action peaks as in the trace without replay (within the 4 bytes of a process's first
    plan), as the plans by difference, which scale each part, need: the replay had held those parts at the start,
    and the 70B's PP 2 x TP 8 plan (blocks and micro-batches by difference) said 129.5 GiB where it holds 61.2."""
    from vemesh.planning import fit
    from vemesh.planning.user_model import trace_arguments
    from vemesh.planning.user_template import blocks_of

    spec = "gpt:n_layer=8,n_embd=256,n_head=4,vocab=512,seq_len=128"
    fns = fit._preset_functions(spec, "zero1", "bf16", False, False, "1f1b", True)
    path, _ = blocks_of(fns.factory, fns.names[0])
    kwargs = dict(trace_arguments(world_size=8, degrees={"PP": 2, "DP": 2, "CP": 1, "TP": 2, "EP": 1},
                                  global_batch_size=16, micro_batch_size=1, dtype="bf16", dp_mode="zero1",
                                  load_factor=1.0), blocks=(path, 6))
    plans = {}
    for replay in (True, False):
        pipeline_plan.REPLAY = replay
        try:
            notes: list[str] = []
            plans[replay] = pipeline_plan.trace_pipeline(fns, kwargs, notes)
        finally:
            pipeline_plan.REPLAY = True
        assert any("replayed" in n for n in notes) == replay, notes
    for rank, whole in plans[False].items():
        replayed = plans[True][rank].phases
        assert replayed.keys() == whole.phases.keys() and any(k.endswith(" tail") for k in replayed), rank
        assert {k: (p, whole.phases[k][0]) for k, (p, _) in replayed.items() if abs(p - whole.phases[k][0]) > 4} == {}


def _same_plans(plans: dict, expected: dict) -> None:
    """Every figure of every PP rank and of each part of its actions the same in both (each ``{rank: Counted}``)."""
    for rank, c in expected.items():
        r = plans[rank]
        assert (r.peak, r.phases.keys()) == (c.peak, c.phases.keys()), rank
        assert {k: p for k, (p, _) in r.phases.items() if p != c.phases[k][0]} == {}, rank
        assert (r.held, r.sent, r.flops, r.memory_bytes, r.optimizer_bytes, r.by_op, r.counts, r.dtensor_ops) == \
            (c.held, c.sent, c.flops, c.memory_bytes, c.optimizer_bytes, c.by_op, c.counts, c.dtensor_ops), rank


@pytest.mark.slow  # 20 s alone: started with the other long runs (conftest.py)
def test_the_second_micro_batch_pipeline_replays_the_firsts_records(monkeypatch) -> None:
    """Many micro-batches are planned as two pipelines of the same stages (``m mod PP + 2 PP`` and ``+ PP``
    micro-batches, the rest by difference: ``pipeline_plan._micro_batches``); the second replays what the first
    recorded. 1F1B under FSDP2 over PP 2, 12 micro-batches: the same plan as with a record store of its own, every
    figure of every rank and every part, with fewer actions traced."""
    fns, kwargs = tiny_pipeline("1f1b", "fsdp", 24, 2, 1)
    monkeypatch.setattr(pipeline_plan, "WHOLE_UP_TO", 1)  # by difference, not one pipeline of every micro-batch
    # a process's first plan holds a scalar more (made once, then cached), which the difference would scale by 3
    pipeline_plan.trace_pipeline(*tiny_pipeline("1f1b", "fsdp", 4, 2, 1))
    calls: list[dict] = []
    original = pipeline_plan.trace_pipeline
    plans, notes = {}, {}
    for shared in (True, False):
        def trace_pipeline(fns, kwargs, notes, derived, records, shared=shared):
            calls.append(records if shared else {})  # unshared: a store of its own, as a pipeline had before
            return original(fns, kwargs, notes, derived, calls[-1])

        monkeypatch.setattr(pipeline_plan, "trace_pipeline", trace_pipeline)
        notes[shared] = []
        plans[shared] = pipeline_plan._micro_batches(fns, kwargs, notes[shared])
    assert calls[0] is calls[1] and calls[2] is not calls[3]
    assert any("4 and 6 traced" in n for n in notes[True]), notes[True]
    traced = {s: [int(t) - int(d) for d, t in re.findall(r"(\d+) of (\d+) stage forwards", "\n".join(n))]
              for s, n in notes.items()}
    assert traced[True][0] == traced[False][0] and traced[True][1] < traced[False][1], traced
    _same_plans(plans[True], plans[False])



@pytest.mark.slow  # the pipeline planned twice, with its prelude and without (about 12 s alone)
def test_a_long_pipeline_replays_its_first_step_from_its_preludes_records(monkeypatch) -> None:
    """1F1B under ZeRO-1 over PP 5, 6 micro-batches, with the prelude's thresholds lowered to them (it runs from
    PP 8 and 18 micro-batches, where it saves more than it costs): PP
    ranks 0 and 1 of a pipeline of 4 alike stages run first (``pipeline_plan._prelude``), so that the pipeline's own PP
    ranks 0 and 1, the first of their roles, replay their first step too. Each traces 8 actions or fewer (the first
    and last micro-batch of each step, forward and backward), where without the prelude they trace 18 and 16 (their
    first step, and the ends of the second); every figure of every rank and part is the plan's without it (which the tests above
    hold equal to tracing every action)."""
    from vemesh.planning.pipeline_trace import MetaExchange

    fns, kwargs = tiny_pipeline("1f1b", "zero1", 12, 5, 1)
    assert kwargs["passes"] < pipeline_plan.PRELUDE_FROM[1]  # so lowered below
    replays: list[tuple[int, int, object]] = []

    def replay_for(self, stages, tracker, counter, mesh, schedule, pp, pp_rank, n, original=MetaExchange.replay_for):
        replays.append((pp, pp_rank, original(self, stages, tracker, counter, mesh, schedule, pp, pp_rank, n)))
        return replays[-1][2]

    monkeypatch.setattr(MetaExchange, "replay_for", replay_for)
    plans, traced = {}, {}
    for prelude in (True, False):
        monkeypatch.setattr(pipeline_plan, "PRELUDE_FROM", (5, 6) if prelude else (10**9, 10**9))
        replays.clear()
        plans[prelude] = pipeline_plan._micro_batches(fns, kwargs, [])
        traced[prelude] = {(pp, rank): r.traced for pp, rank, r in replays}
    assert {rank for pp, rank in traced[True] if pp == pipeline_plan.PRELUDE[0]} == {0, 1}, traced
    assert traced[True][5, 0] <= 8 and traced[True][5, 1] <= 8, traced
    assert traced[False][5, 0] >= 12 and traced[False][5, 1] >= 12, traced
    _same_plans(plans[True], plans[False])


@pytest.mark.slow  # a pipeline planned once (about 5 s alone)
def test_a_parallelize_function_that_fails_on_the_preludes_model_plans_without_a_prelude(monkeypatch) -> None:
    """A user's parallelize function may cut its stages by the model's configured depth and fail on a shorter model
    (an IndexError in the user's code). The prelude's model is shorter: the plan is made without a prelude, as
    before it, not refused."""
    from vemesh.planning.pipeline_trace import MetaExchange

    fns, kwargs = tiny_pipeline("1f1b", "zero1", 12, 5, 1)

    def parallelize(model, mesh, parallelize=fns.parallelize):
        if len(model.layers) != 5:
            raise IndexError(f"this function cuts 5 layers; the model has {len(model.layers)}")
        return parallelize(model, mesh)

    pps: list[int] = []

    def replay_for(self, stages, tracker, counter, mesh, schedule, pp, *rest, original=MetaExchange.replay_for):
        pps.append(pp)
        return original(self, stages, tracker, counter, mesh, schedule, pp, *rest)

    monkeypatch.setattr(MetaExchange, "replay_for", replay_for)
    monkeypatch.setattr(pipeline_plan, "PRELUDE_FROM", (5, 6))
    plan = pipeline_plan._micro_batches(replace(fns, parallelize=parallelize), kwargs, [])
    assert sorted(plan) == [0, 1, 2, 3, 4] and set(pps) == {5}, pps


@pytest.mark.slow  # 45 s alone: four pipelines of 32 blocks over 2 to 8 PP ranks
def test_a_search_replays_on_one_pp_mesh_what_another_recorded_of_the_same_stages(monkeypatch) -> None:
    """Inside ``shared_records`` (a search), a PP mesh replays the records of another whose stages have the same role
    and parameters' shapes and whose plan cuts its actions alike. The GPT preset of 32 blocks under ZeRO-1 over 16
    ranks: PP 4 x DP 4, then PP 2 x DP 8 (both by difference: 3 and 4 blocks a stage, each action cut at its blocks)
    replays PP 4's records, and has the plan it has alone, every figure of every rank and part, with fewer actions
    traced; then PP 8 x DP 2 (4 blocks a stage, traced whole: its actions are not cut) replays none of theirs: a
    record names the parts of its action, and played into an uncut trace its ranks' parts differ, so that its alike
    middle ranks failed their check and were all traced (until the cut was in the key)."""
    from vemesh.planning import fit
    from vemesh.planning.request import PlanRequest

    counted: list[dict] = []

    def micro_batches(*args, original=pipeline_plan._micro_batches):
        counted.append(original(*args))
        return counted[-1]

    monkeypatch.setattr(pipeline_plan, "_micro_batches", micro_batches)

    def plan(pp: int):
        job = PlanRequest(model="gpt:n_layer=32,n_embd=64,n_head=4,vocab=256,seq_len=64", world_size=16,
                          global_batch_size=32, micro_batch_size=1).job()
        fit._traced_preset.cache_clear()
        return fit.predict(job, dp=16 // pp, pp=pp), counted[-1]  # the last pipeline: 4 blocks a stage

    with pipeline_plan.shared_records():
        plan(4)
        (shared, ranks_shared), (whole, _) = plan(2), plan(8)
    alone, ranks_alone = plan(2)
    assert (shared.peak, shared.classes) == (alone.peak, alone.classes)
    assert ranks_shared == ranks_alone  # each rank's Counted, every action's part included
    traced = [[int(t) - int(d) for d, t in re.findall(r"(\d+) of (\d+) stage forwards", "\n".join(f.notes))]
              for f in (shared, alone)]
    assert max(traced[0]) < min(traced[1]), traced
    assert any("PP ranks 4 to 5: alike stages, added by difference" in n for n in whole.notes), whole.notes


def test_records_are_shared_across_pp_and_across_dp_sizes_under_ddp_and_zero1_only() -> None:
    """What a record depends on besides its key (``pipeline_plan._context``): not PP; under DDP and ZeRO-1 only whether
    the mesh has DP (their forward broadcasts the buffers); under FSDP2 and a user's own wrapping its DP size; and
    whether the plan cuts its actions at the blocks (by difference) or not."""
    fns = object()

    def context(mode: str | None, pp: int, dp: int, tp: int = 1, blocks: tuple | None = ("h", 12)) -> tuple:
        return pipeline_plan._context(fns, dict(degrees={"PP": pp, "DP": dp, "CP": 1, "TP": tp, "EP": 1}, blocks=blocks,
                                                dp_replicate=1, micro_batch_size=1, dtype="bf16", dp_mode=mode,
                                                load_factor=1.0, timed=True, device="cpu"))

    for mode in ("ddp", "zero1"):
        assert context(mode, 2, 4) == context(mode, 8, 16, blocks=("h", 32)) != context(mode, 8, 1)
        assert context(mode, 2, 4) != context(mode, 2, 4, tp=2)
        assert context(mode, 2, 4) != context(mode, 2, 4, blocks=None)
    for mode in ("fsdp", None):
        assert context(mode, 2, 4) == context(mode, 8, 4) != context(mode, 2, 8)
    assert context("ddp", 2, 4) != context("zero1", 2, 4)


def test_a_record_counts_the_collectives_its_action_ran_in_either_step() -> None:
    """Each record's collectives are its action's own, in the warm-up step as in the step: on each mesh dim, the calls
    its ops made and nothing carried from before (the counter starts each step from zero; a step's first collective
    on a dim once recorded every call of the step before it too, so that the first forward of the second step was never
    alike the first step's)."""
    fns, kwargs = tiny_pipeline("1f1b", "zero1", 4, 2, 1)
    exchange = pipeline_plan.MetaExchange(replay=True)
    for rank in range(2):
        pipeline_plan.trace_user(fns, pp_rank=rank, exchange=exchange, **kwargs)
    firsts = [e for key, effects in exchange.records.items() if key[1:3] == ("F", None) for e in effects]
    # alike but for the first forward's broadcast (below): each step's the same, the first step's with its broadcast
    assert len(firsts) == 4 and all(_alike(firsts[0], e) for e in firsts[1:]
                                    if e.returned == firsts[0].returned and e.counters[3] == firsts[0].counters[3])
    for effects in exchange.records.values():
        for effect in effects:
            for dim, (_, calls, ops) in effect.counters[3]:
                assert calls == sum(n for _, (_, n) in ops), (dim, effect.counters[3])
    # ZeRO-1's buffers broadcast in the first forward of the trace alone: torch's stages run every forward under
    # no_sync, after which DDP (torch's, and vemesh's as it) keeps each rank's buffers
    broadcasts = sorted((dict(e.counters[3]).get("DP", (0, 0, ()))[2] for e in firsts), key=len)
    assert broadcasts[:2] == [(), ()] and all(ops == (("broadcast_", ops[0][1]),) and ops[0][1][1] >= 1
                                               for ops in broadcasts[2:]), broadcasts
