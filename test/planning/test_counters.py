"""A timed trace's counters in one dispatch mode (vemesh.planning.fusion.MemoryBoundBytes with ``flops``) count what
torch's ``FlopCounterMode`` beneath the bytes-only mode counted: the same FLOPs by op, the same bytes, ops and
compile counts, and the modes beneath see the same ops (an op with a decomposition, SiLU's backward, decomposed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from vemesh.planning.fusion import MemoryBoundBytes, step_counters
from vemesh.planning.measure import FLOP_FORMULAS
from vemesh.planning.speedups import ATTENTION_IN, FLOPS_IN
from vemesh.planning.step_tracker import NoModules


class _Seen(TorchDispatchMode):
    """What reaches the modes beneath the counters."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _step(seed: int) -> None:
    torch.manual_seed(seed)
    w1 = torch.randn(32, 64, requires_grad=True)
    w2 = torch.randn(64, 32, requires_grad=True)
    x = torch.randn(2, 8, 32)
    h = F.silu(F.layer_norm(x, (32,)) @ w1) @ w2  # SiLU's backward has a decomposition
    q = h.view(2, 8, 2, 16).transpose(1, 2)
    out = F.scaled_dot_product_attention(q, q, q, is_causal=True)
    (out.float().pow(2).mean() + h.sum()).backward()


def test_one_mode_counts_what_torchs_flop_counter_beneath_the_bytes_mode_counted() -> None:
    beneath_two = _Seen()
    with beneath_two:
        flops = FlopCounterMode(display=False, custom_mapping=FLOP_FORMULAS)
        flops.mod_tracker = NoModules()
        with flops, MemoryBoundBytes() as moved_two:
            _step(0)
    beneath_one = _Seen()
    with beneath_one, step_counters(True) as (counted, moved_one):
        _step(0)
    assert counted is moved_one
    assert dict(counted.flop_counts["Global"]) == dict(flops.flop_counts["Global"])
    assert counted.get_total_flops() == flops.get_total_flops() > 0
    # the one mode also counts each FLOP by the dtype it ran in (what the bytes mode alone cannot)
    ran = {k: v for k, v in moved_one.counts().items() if k.startswith((FLOPS_IN, ATTENTION_IN))}
    assert ran == {"flops_in@float32": counted.get_total_flops(),
                   "attention_in@float32": moved_one.counts()["attention_flops"]}
    assert (moved_one.bytes, moved_one.ops, moved_one.dtensor_ops,
            {k: v for k, v in moved_one.counts().items() if k not in ran}) == \
        (moved_two.bytes, moved_two.ops, moved_two.dtensor_ops, moved_two.counts())
    assert beneath_one.ops == beneath_two.ops
    assert "aten.silu_backward.default" not in beneath_one.ops and "aten.sigmoid.default" in beneath_one.ops


def test_without_flops_the_mode_runs_each_op_as_given() -> None:
    """``vemesh calibrate`` counts ops on real runs: nothing decomposed there."""
    beneath = _Seen()
    with beneath, MemoryBoundBytes() as moved:
        _step(1)
    assert "aten.silu_backward.default" in beneath.ops and moved.get_total_flops() == 0


def test_a_fake_tensors_device_query_stops_at_the_first_mode_and_the_tracker_still_samples_what_it_missed() -> None:
    """``prim.device`` (autograd asks it of every fake tensor from C++) is answered by the outermost of the planner's
    modes, and no mode beneath sees it; the tracker still samples the bytes held there when they changed since its
    last op (a storage FSDP2 grows with ``resize_``, between ops), and samples a step's phase as it begins."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vemesh.planning.step_tracker import StepTracker

    tracker, seen = StepTracker(module_hooks=False), _Seen()
    with FakeTensorMode(), tracker, seen, MemoryBoundBytes(flops=True):
        x = torch.empty(1024, dtype=torch.uint8)
        tracker.in_step = True
        tracker.phase = "step"  # no op yet: the phase holds what is held as it begins
        assert tracker.phase_peaks["step"][0] == 1024
        x.untyped_storage().resize_(4096)  # not an op: no mode sees it
        assert tracker.step_peak == 1024
        assert torch.ops.prim.device.default(x) == torch.device("cpu")
        x.untyped_storage().resize_(1024)
        torch.ops.prim.device.default(x)  # nothing changed since: nothing sampled
        tracker.phase = None
    assert tracker.step_peak == 4096 and tracker.phase_peaks["step"][0] == 4096
    assert seen.ops == ["aten.empty.memory_format"], seen.ops


def test_an_in_place_op_that_returns_nothing_is_counted_writing_what_its_schema_marks() -> None:
    """torch's foreach ops and its fused AdamW write in place and return nothing: they were counted reading their
    tensors only. AdamW's step now moves the same bytes as a loop over tensors (``foreach=False``) as with foreach
    (21 x the parameter's bytes here, each op reading and writing), and fused AdamW moves 7 x: it reads the parameter,
    its gradient and both moments once and writes the parameter and the moments (its schema marks the gradients as
    written too, for unscaling them in place, which it does only with a grad_scale)."""
    p = torch.nn.Parameter(torch.zeros(1000))
    p.grad = torch.ones(1000)
    moved = {}
    for name, how in (("for-loop", dict(foreach=False)), ("foreach", dict(foreach=True)), ("fused", dict(fused=True))):
        opt = torch.optim.AdamW([p], **how)
        opt.step()  # the state made
        with MemoryBoundBytes() as counted:
            opt.step()
        moved[name] = round(counted.bytes / p.nbytes)
    assert moved == {"for-loop": 21, "foreach": 21, "fused": 7}, moved
    m = [torch.zeros(100) for _ in range(3)]
    with MemoryBoundBytes() as counted:
        torch._foreach_mul_(m, 0.9)
    assert counted.bytes == 2 * 3 * 400  # each list read and written
