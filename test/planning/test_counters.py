"""A timed trace's counters in one dispatch mode (vemesh.planning.fusion.MemoryBoundBytes with ``flops``) count what
torch's ``FlopCounterMode`` beneath the bytes-only mode counted: the same FLOPs by op, the same bytes, ops and
compile counts, and the modes beneath see the same ops (an op with a decomposition, SiLU's backward, decomposed)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from vemesh.planning.fusion import MemoryBoundBytes, step_counters
from vemesh.planning.measure import FLOP_FORMULAS, NoModules


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
    assert (moved_one.bytes, moved_one.ops, moved_one.dtensor_ops, moved_one.counts()) == \
        (moved_two.bytes, moved_two.ops, moved_two.dtensor_ops, moved_two.counts())
    assert beneath_one.ops == beneath_two.ops
    assert "aten.silu_backward.default" not in beneath_one.ops and "aten.sigmoid.default" in beneath_one.ops


def test_without_flops_the_mode_runs_each_op_as_given() -> None:
    """``vemesh calibrate`` counts ops on real runs: nothing decomposed there."""
    beneath = _Seen()
    with beneath, MemoryBoundBytes() as moved:
        _step(1)
    assert "aten.silu_backward.default" in beneath.ops and moved.get_total_flops() == 0
