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
    # beneath, the step's own ops: SiLU's backward is counted by its decomposition, run on meta tensors apart, and
    # runs as itself (torch's FlopCounterMode runs the decomposition in its place, whose temporaries a trace held)
    at = beneath_one.ops.index("aten.silu_backward.default")
    decomposed = len(beneath_two.ops) - len(beneath_one.ops) + 1  # its eight ops, the sigmoid and its products
    assert beneath_one.ops[:at] == beneath_two.ops[:at] and beneath_one.ops[at + 1:] == beneath_two.ops[at + decomposed:]
    assert beneath_two.ops[at] == "aten.sigmoid.default" and decomposed == 8


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


def test_a_timed_trace_holds_what_an_untimed_one_holds_where_an_op_is_counted_by_its_decomposition() -> None:
    """SiLU's backward is counted by its decomposition (as torch's FlopCounterMode counts it); its sigmoid and
    products must not be held by the trace: a GPU runs one kernel. They were: a ``llama3:8b`` plan with the compiled
    loss (whose peak is then in the blocks' backward) peaked 110 MiB higher timed than untimed."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from vemesh.planning.step_tracker import StepTracker

    def peak(timed: bool) -> int:
        tracker = StepTracker(module_hooks=False)
        with FakeTensorMode(), tracker:
            x = torch.empty(1024, 1024, requires_grad=True)
            tracker.in_step = True
            with step_counters(timed) as (flops, _):
                F.silu(x).backward(torch.empty(1024, 1024))
            tracker.in_step = False
        return tracker.step_peak

    assert peak(True) == peak(False) == 4 * 1024 * 1024 * 4  # x, its SiLU's output, its seed gradient, x's gradient


def test_a_decomposition_that_cannot_run_apart_runs_in_place_and_counts_the_same() -> None:
    """Where the fake mode apart fails (a decomposition reading a value only the step's fake tensors hold), the
    decomposition runs in place, as torch's FlopCounterMode runs it: the same counts and the same result."""

    class Refusing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
            raise RuntimeError("not here")

    def run(refuse: bool) -> tuple:
        beneath = _Seen()
        with beneath, step_counters(True) as (counted, moved):
            if refuse:
                moved._apart = Refusing()
            torch.manual_seed(0)
            x = torch.randn(8, 16, requires_grad=True)
            F.silu(x).backward(torch.ones(8, 16))
        return x.grad, moved.bytes, moved.ops, counted.get_total_flops(), beneath.ops

    apart, in_place = run(False), run(True)
    torch.testing.assert_close(apart[0], in_place[0])  # the kernel and its decomposition, alike to rounding
    assert apart[1:4] == in_place[1:4]
    assert "aten.silu_backward.default" in apart[4] and "aten.sigmoid.default" in in_place[4]
