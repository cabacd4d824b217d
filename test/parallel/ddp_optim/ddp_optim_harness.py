"""Shared pieces for the DDP / DistributedOptimizer tests: a small tensor-parallel MLP and the
single-process ``torch.optim.AdamW`` reference.

Workers (launched by ``test/launch.py``) run many scenarios in one process group (spawning 4
ranks costs seconds of torch import on 2 cores) and report ``{scenario: None | error text}``.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

Results = dict[str, str | None]

D_IN, D_HID, D_MID, D_OUT = 16, 32, 16, 8
GLOBAL_BATCH = 16
WEIGHT_DECAY = 0.1
TP_PLAN = {"fc1": ColwiseParallel(), "fc2": RowwiseParallel(), "fc3": ColwiseParallel(), "fc4": RowwiseParallel()}


class Net(nn.Module):
    """Two column/row-parallel pairs around a LayerNorm (which stays a plain, TP-replicated module)."""

    def __init__(self, with_unused: bool = False) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_MID)
        self.norm = nn.LayerNorm(D_MID)
        self.fc3 = nn.Linear(D_MID, D_HID)
        self.fc4 = nn.Linear(D_HID, D_OUT)
        self.unused = nn.Parameter(torch.randn(D_OUT)) if with_unused else None

    def forward(self, x: torch.Tensor, use_extra: bool = False) -> torch.Tensor:
        x = self.norm(self.fc2(F.relu(self.fc1(x))))  # B, D_MID
        out = self.fc4(F.relu(self.fc3(x)))  # B, D_OUT
        return out + self.unused if use_extra and self.unused is not None else out


def make_net(seed: int = 0, with_unused: bool = False, dtype: torch.dtype = torch.float32) -> Net:
    torch.manual_seed(seed)
    return Net(with_unused).to(dtype)


def batch(step: int, micro: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of one micro-step (same on every rank)."""
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(GLOBAL_BATCH, D_IN, generator=g)
    y = torch.randn(GLOBAL_BATCH, D_OUT, generator=g)
    return x.to(dtype), y.to(dtype)


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Weight decay on matrices only (biases, norms and ``unused`` get none)."""
    decay = [p for p in model.parameters() if p.ndim >= 2]
    rest = [p for p in model.parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor, chunk: int, partial_extra: bool) -> torch.Tensor:
    """MSE on one (DP-local) batch; with ``partial_extra`` only DP chunk 0 uses ``unused``."""
    return F.mse_loss(model(x, use_extra=partial_extra and chunk == 0), y)


def reference_run(
    steps: int,
    micro: int,
    make_opt: Callable[[Any], torch.optim.Optimizer],
    clip: float | None,
    groups: bool,
    with_unused: bool,
    dp: int = 1,
    partial_extra: bool = False,
    make_sched: Callable[[torch.optim.Optimizer], Any] | None = None,
    skip: tuple[int, ...] = (),
) -> tuple[Net, list[dict[str, torch.Tensor]], list[float]]:
    """Single process, global batch, a plain torch optimizer from ``make_opt(params)``.

    With ``partial_extra`` the loss is the mean of ``dp`` equal chunk losses where only chunk 0
    uses the extra parameter (what DP rank 0 does in the distributed run); otherwise it is the
    plain MSE over the global batch. Steps in ``skip`` compute gradients but do not step (as a
    GradScaler skipping a step with non-finite gradients).

    Returns:
        The trained model, the gradients of step 0 (after accumulation), and each step's grad norm.
    """
    model = make_net(with_unused=with_unused)
    params: Any = param_groups(model, WEIGHT_DECAY) if groups else model.parameters()
    opt = make_opt(params)
    sched = make_sched(opt) if make_sched else None
    first_grads: list[dict[str, torch.Tensor]] = []
    norms: list[float] = []
    for step in range(steps):
        opt.zero_grad()
        for m in range(micro):
            x, y = batch(step, m)
            if partial_extra:
                chunks = zip(x.chunk(dp), y.chunk(dp))
                (sum(loss_of(model, xc, yc, c, True) for c, (xc, yc) in enumerate(chunks)) / dp).backward()
            else:
                F.mse_loss(model(x), y).backward()
        if step == 0:
            first_grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
        if clip:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip)))
        if step not in skip:
            opt.step()
            if sched is not None:
                sched.step()
    return model, first_grads, norms


def tp_model(tp_mesh: Any, seed: int = 0, with_unused: bool = False, dtype: torch.dtype = torch.float32) -> nn.Module:
    model = make_net(seed, with_unused, dtype)
    return parallelize_module(model, tp_mesh, TP_PLAN) if tp_mesh.size() > 1 else model


def full(t: torch.Tensor) -> torch.Tensor:
    """The unsharded value (all-gathers over TP for DTensors; every rank must call it)."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def max_param_diff(model: nn.Module, ref: nn.Module) -> float:
    ref_params = dict(ref.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        worst = max(worst, (full(p.detach()).float() - ref_params[name.removeprefix("module.")].detach()).abs().max().item())
    return worst


def check(results: Results, name: str, fn: Callable[[], None]) -> None:
    """Run one scenario; record None on success or the traceback text on failure."""
    try:
        fn()
        results[name] = None
    except Exception:  # noqa: BLE001 - reported back to pytest
        results[name] = traceback.format_exc()
