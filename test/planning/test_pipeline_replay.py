"""Replayed micro-batches (vemesh.planning.pipeline_replay) give the plan of tracing every micro-batch: the same peak,
the same bytes held by kind, the same collectives, FLOPs and memory-bound bytes, and the ops dispatched within a few
per replayed action (FakeTensor's device queries and FSDP2's profiler marks, which vary with their caches and state)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from vemesh.models.llama3 import planned
from vemesh.models.llama3.config import Llama3Config
from vemesh.parallel.schedules import stages_per_rank
from vemesh.planning import pipeline_plan
from vemesh.planning.fusion import Fusion
from vemesh.planning.pipeline_replay import Effect, _alike, _balanced, backward_contexts
from vemesh.planning.user_code import UserFunctions
from vemesh.planning.user_model import trace_arguments

TINY = Llama3Config(dim=32, n_layers=4, n_heads=2, n_kv_heads=2, hidden_dim=64, vocab_size=128, seq_len=16)


def _traced(schedule: str, mode: str, replay: bool, monkeypatch: pytest.MonkeyPatch, batch: int, pp: int,
            tp: int) -> tuple:
    cfg = replace(TINY, n_layers=pp * stages_per_rank(schedule))  # a block a stage
    fns = UserFunctions(planned.factory(cfg), planned.parallelize_for(mode, "bf16", "full", schedule),
                        planned.pipeline_step_for(schedule), (f"llama3 {cfg}", "p", "s"), loss=planned.loss_fn,
                        pp_schedule=schedule)
    job = dict(world_size=2 * pp * tp, degrees={"PP": pp, "DP": 2, "CP": 1, "TP": tp, "EP": 1}, dp_replicate=1,
               global_batch_size=batch, micro_batch_size=1, dtype="fp32" if mode == "fsdp" else "bf16", dp_mode=mode,
               load_factor=1.0, timed=True)
    monkeypatch.setattr(pipeline_plan, "REPLAY", replay)
    notes: list[str] = []
    return pipeline_plan.trace_pipeline(fns, trace_arguments(**job), notes), notes


@pytest.mark.parametrize("schedule, mode, batch, pp, tp", [("1f1b", "fsdp", 12, 4, 2), ("interleaved-1f1b", "zero1", 12, 2, 1)])
def test_replayed_micro_batches_give_the_plan_of_tracing_every_one(schedule, mode, batch, pp, tp, monkeypatch) -> None:
    """6 micro-batches per DP rank under 1F1B, FSDP2 (as torchtitan shards for PP: no reshard after forward) and TP 2
    over PP 4, where PP ranks 1 and 2 hold alike stages and share their records, and the last stage returns DTensors
    (loss-parallel's logits), replayed as DTensors; 6 under interleaved 1F1B and ZeRO-1 over PP 2."""
    from torch.distributed.tensor import DTensor

    from vemesh.planning import pipeline_replay

    kinds: set[type] = set()  # of the tensors replays made (not the tensors: holding them would change the peak)

    def make(*args, make=pipeline_replay._make):
        t = make(*args)
        kinds.add(type(t))
        return t

    monkeypatch.setattr(pipeline_replay, "_make", make)
    replayed, notes = _traced(schedule, mode, True, monkeypatch, batch, pp, tp)
    assert (DTensor in kinds) == (tp > 1), kinds
    whole, _ = _traced(schedule, mode, False, monkeypatch, batch, pp, tp)
    assert any("replayed" in n for n in notes), notes  # the shortcut was taken
    for rank, c in whole.items():
        r = replayed[rank]
        # the peak within 4 bytes: the first plan of a process holds one fp32 scalar more (made once, then cached)
        assert abs(r.peak - c.peak) <= 4, rank
        assert (r.sent, r.flops, r.memory_bytes, r.optimizer_bytes, r.by_op, r.counts, r.dtensor_ops) == \
            (c.sent, c.flops, c.memory_bytes, c.optimizer_bytes, c.by_op, c.counts, c.dtensor_ops), rank
        assert r.ops == pytest.approx(c.ops, rel=2e-3), rank


def test_the_backward_context_is_read_from_torchs_action_list() -> None:
    """1F1B on PP rank 0 of 2 with 4 micro-batches: F0 F1 B0 F2 B1 F3 B2 B3; each backward follows a forward but the
    last, which follows a backward."""
    assert backward_contexts("1f1b", 2, 0, 4) == {(0, 0): "F", (0, 1): "F", (0, 2): "F", (0, 3): "B"}
    last = backward_contexts("1f1b", 2, 1, 4)  # the last rank alternates F and B throughout
    assert set(last.values()) == {"F"}


def _effect(net: int, ops: int = 10, returned: tuple = ((4,), (1,), None, True)) -> Effect:
    import torch

    meta = (returned[0], returned[1], torch.float32, returned[3], None) if returned else None
    return Effect(rise=net + 64, net=net, parts=((), ()), state=((), ()), counters=((), (100, ops, 0), (), (), ()),
                  returned=(meta,), single=True, fusion=())


def test_effects_alike_but_for_the_ops_count_and_balanced_forward_and_backward() -> None:
    assert _alike(_effect(32, ops=10), _effect(32, ops=12))
    assert not _alike(_effect(32), _effect(48))
    forward = _effect(16 + 64)  # returns 16 bytes (4 fp32), keeps 64
    assert _balanced(forward, _effect(16 - 64))  # its backward frees the 64 and returns an input gradient of 16
    assert not _balanced(forward, _effect(16 - 60))


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
