"""The torch contract, run the way torch users write it: schedulers, GradScaler, DCP state dicts,
torch DDP interchange, veScale's call forms and the VeDeviceMesh doc's own snippet.

Called from ``ddp_optim_scenarios.worker`` on each mesh of the 4-rank gloo world; results are
checked by ``test_ddp_optim_parity.test_torch_contract``.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from ddp_optim_harness import GLOBAL_BATCH, TP_PLAN, Results, batch, check, full, make_net, max_param_diff, reference_run
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.parallel.ddp.grad_buffer import local_tensor
from vemesh.optim import DistributedOptimizer, GradScaler

LR, WD, STEPS, ATOL = 1e-3, 0.1, 5, 1e-5

CONTRACT = [
    "types[4x1]",
    "freed-when-dropped[4x1]",
    "lr-scheduler[4x1]",
    "grad-scaler[4x1-adamw]",
    "grad-scaler[4x1-zero]",
    "grad-scaler[2x2-zero-tp]",
    "dcp-round-trip[4x1]",
    "dcp-round-trip[2x2]",
    "dcp-zero-to-torch-ddp[4x1]",
    "vescale-call-form[2x2]",
    "seed-snippet[2x2]",
]


def _slice(mesh: DeviceMesh, t: torch.Tensor) -> torch.Tensor:
    dp, r = mesh["DP"].size(), mesh["DP"].get_local_rank()
    b = GLOBAL_BATCH // dp
    return t[r * b : (r + 1) * b]


def _loop(model: nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh, steps: range, *, scaler: Any = None, sched: Any = None, poison: int | None = None) -> None:
    """The torch loop; with ``poison``, DP rank 0's loss at that step is infinite (the others' are finite)."""
    for step in steps:
        x, y = batch(step, 0)
        opt.zero_grad()
        loss = F.mse_loss(model(_slice(mesh, x)), _slice(mesh, y))
        if step == poison and mesh["DP"].get_local_rank() == 0:
            loss = loss * float("inf")
        (scaler.scale(loss) if scaler else loss).backward()
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        if sched:
            sched.step()


def _adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def run_types(mesh: DeviceMesh) -> None:
    net = make_net()
    model = DDP(net, mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model])
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(model, nn.parallel.DistributedDataParallel)
    assert [p for g in opt.param_groups for p in g["params"]] == list(model.parameters())
    assert list(model.buffers()) == [] and list(model.named_buffers()) == []
    assert next(iter(model.state_dict())).startswith("module.")
    # like torch's DDP: .module is the user's own module (not a copy), and no gradient exists yet
    assert model.module is net and model.module.fc1 is net.fc1
    assert all(p.grad is None for p in model.parameters())


def run_freed_when_dropped(mesh: DeviceMesh) -> None:
    """Like torch's, a wrapper that nobody holds any more is freed, with its buffers and groups.

    The parameters keep hooks on the C++ side, where Python's collector cannot follow them: a hook
    holding its wrapper would keep wrapper and process groups alive until the interpreter is torn
    down, when gloo's worker threads can no longer take the GIL.
    """
    import gc
    import weakref

    for dtype in (torch.float32, torch.bfloat16):  # bf16: the tensor pre-hook that folds into fp32
        model = DDP(make_net(dtype=dtype), mesh["DP"])
        opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR)
        x, y = (_slice(mesh, t) for t in batch(0, 0, dtype))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
        refs = [weakref.ref(model), weakref.ref(opt), weakref.ref(model.grad_buffers[0])]
        module = model.module  # the user keeps the plain module
        del model, opt
        gc.collect()
        alive = [type(r()).__name__ for r in refs if r() is not None]
        assert not alive, f"{dtype}: still alive after del and gc.collect(): {alive}"
        assert not any(hasattr(p, "main_grad") for p in module.parameters()), "main_grad views keep the old buffer"
        hooks = [h for p in module.parameters() for h in ("_post_accumulate_grad_hooks", "_backward_hooks") if getattr(p, h, None)]
        assert not hooks, f"the freed wrapper's hooks are still on the parameters: {hooks}"
        F.mse_loss(module(x), y).backward()  # the dead wrapper's hooks are no-ops: plain local gradients
        assert all(p.grad is not None and p.grad.dtype == dtype for p in module.parameters())
        again = DDP(module, mesh["DP"])  # the freed wrapper no longer owns the parameters
        with pytest.raises(ValueError, match="already belongs to a vemesh DistributedDataParallel"):
            DDP(module, mesh["DP"])
        del again


def run_lr_scheduler(mesh: DeviceMesh) -> None:
    def sched(opt: torch.optim.Optimizer) -> Any:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS, eta_min=1e-5)

    ref, _, _ = reference_run(STEPS, 1, _adamw, None, False, False, make_sched=sched)
    model = DDP(make_net(), mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD)
    s = sched(opt)
    lrs = []
    for step in range(STEPS):
        _loop(model, opt, mesh, range(step, step + 1), sched=s)
        lrs.append(opt.param_groups[0]["lr"])
    expected = [1e-5 + (LR - 1e-5) * (1 + torch.cos(torch.tensor(torch.pi * (k + 1) / STEPS)).item()) / 2 for k in range(STEPS)]
    assert all(abs(a - b) < 1e-9 for a, b in zip(lrs, expected)), (lrs, expected)
    assert opt.optimizer.param_groups[0]["lr"] == lrs[-2], "the inner optimizer did not step with the scheduled lr"
    diff = max_param_diff(model, ref)
    assert diff <= ATOL, f"param max diff {diff:.3g} with CosineAnnealingLR"


def run_grad_scaler(mesh: DeviceMesh, zero: bool) -> None:
    """Step 0 is non-finite on DP rank 0 only: every rank skips it and halves the scale."""
    ref, _, _ = reference_run(STEPS, 1, _adamw, None, False, False, skip=(0,))
    model = DDP(make_net(), mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD) if zero else _adamw(model.parameters())
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    start = [p.detach().clone() for p in model.parameters()]
    _loop(model, opt, mesh, range(1), scaler=scaler, poison=0)
    _skipped_then_trained(model, opt, mesh, scaler, start, ref)


def _skipped_then_trained(model: nn.Module, opt: torch.optim.Optimizer, mesh: DeviceMesh, scaler: Any,
                          start: list[torch.Tensor], ref: nn.Module) -> None:
    """After a non-finite step 0: no rank stepped and the scale halved; the steps after it train as one process."""
    unchanged = all(torch.equal(a, full(p.detach())) for a, p in zip(start, model.parameters()))
    scale_after_skip = scaler.get_scale()
    _loop(model, opt, mesh, range(1, STEPS), scaler=scaler)
    diff = max_param_diff(model, ref)
    assert unchanged, "a rank stepped on the non-finite step"
    assert scale_after_skip == 2.0**9, scale_after_skip
    assert diff <= ATOL, f"param max diff {diff:.3g} after a skipped step"


def run_grad_scaler_tp(mesh: DeviceMesh) -> None:
    """DP 2 x TP 2 under ZeRO-1: the TP Linears are DTensors, the LayerNorm plain. torch's GradScaler refuses the mix
    ("mixed torch.Tensor and DTensor", as with torch's own optimizers); vemesh's skips step 0 on every rank, halves the
    scale, and trains as one process does. Step 0's infinity is in TP rank 0's shard of fc1's averaged gradient
    alone: its TP peer sees none in its own, and steps unless the two agree (the plain LayerNorm, a replica on both,
    would then differ between them)."""
    ref, _, _ = reference_run(STEPS, 1, _adamw, None, False, False, skip=(0,))
    model = DDP(_tp_model(mesh), mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD)
    x, y = batch(0, 0)
    torchs = torch.amp.GradScaler("cpu")
    torchs.scale(F.mse_loss(model(_slice(mesh, x)), _slice(mesh, y))).backward()
    with pytest.raises(RuntimeError, match="mixed torch.Tensor and DTensor"):
        torchs.unscale_(opt)
    opt.zero_grad()
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)
    start = [full(p.detach()).clone() for p in model.parameters()]
    scaler.scale(F.mse_loss(model(_slice(mesh, x)), _slice(mesh, y))).backward()
    if mesh["TP"].get_local_rank() == 0:
        model.module.fc1.weight.grad._local_tensor[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    _skipped_then_trained(model, opt, mesh, scaler, start, ref)


def _tp_model(mesh: DeviceMesh) -> nn.Module:
    net = make_net()
    return parallelize_module(net, mesh["TP"], TP_PLAN) if mesh["TP"].size() > 1 else net


def _clone(sd: Any) -> Any:
    return {k: _clone(v) for k, v in sd.items()} if isinstance(sd, dict) else [_clone(v) for v in sd] if isinstance(sd, list) else sd.clone() if torch.is_tensor(sd) else sd


def run_dcp_round_trip(mesh: DeviceMesh) -> None:
    """DCP's get_state_dict gives the unwrapped names; set_state_dict resumes bit-identically."""
    def build() -> tuple[DDP, DistributedOptimizer]:
        model = DDP(_tp_model(mesh), mesh["DP"])
        return model, DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD)

    model, opt = build()
    fresh_keys = get_state_dict(model, opt)[1]["state"].keys()  # before any step: DCP initializes the state
    opt.zero_grad()
    _loop(model, opt, mesh, range(2))
    msd, osd = get_state_dict(model, opt)
    names = [n for n, _ in make_net().named_parameters()]
    saved_m, saved_o = _clone(msd), _clone(osd)
    _loop(model, opt, mesh, range(2, 4))
    fresh, fresh_opt = build()
    set_state_dict(fresh, fresh_opt, model_state_dict=saved_m, optim_state_dict=saved_o)
    _loop(fresh, fresh_opt, mesh, range(2, 4))
    same = all(torch.equal(local_tensor(a), local_tensor(b)) for a, b in zip(model.parameters(), fresh.parameters()))
    assert list(msd) == names, list(msd)
    assert sorted(osd["state"]) == sorted(names) and sorted(fresh_keys) == sorted(names)
    assert set(osd["state"][names[0]]) == {"step", "exp_avg", "exp_avg_sq"}
    assert same, "set_state_dict did not resume the run exactly"


def run_zero_to_torch_ddp(mesh: DeviceMesh) -> None:
    """A ZeRO-1 state from DCP loads into torch's own DDP + AdamW, which continues the same run."""
    ref, _, _ = reference_run(4, 1, _adamw, None, False, False)
    model = DDP(make_net(), mesh["DP"])
    opt = DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD)
    _loop(model, opt, mesh, range(2))
    msd, osd = get_state_dict(model, opt)
    torch_ddp = nn.parallel.DistributedDataParallel(make_net(seed=7), process_group=mesh["DP"].get_group())
    torch_opt = _adamw(torch_ddp.parameters())
    set_state_dict(torch_ddp, torch_opt, model_state_dict=_clone(msd), optim_state_dict=_clone(osd))
    _loop(torch_ddp, torch_opt, mesh, range(2, 4))
    diff = max_param_diff(torch_ddp, ref)
    assert diff <= ATOL, f"torch DDP after loading vemesh ZeRO-1 state: param max diff {diff:.3g}"


def run_vescale_call_form(mesh: DeviceMesh) -> None:
    """veScale's keyword form, with clip_grad and overlap_param_gather, against one process."""
    ref, _, ref_norms = reference_run(STEPS, 2, _adamw, 0.05, False, False)
    model = DDP(_tp_model(mesh), mesh["DP"])
    opt = DistributedOptimizer(
        torch.optim.AdamW, models=[model], optimizer_kwargs={"lr": LR, "weight_decay": WD}, clip_grad=0.05,
        overlap_param_gather=True, grad_to_fp32=True,
    )
    norms = []
    for step in range(STEPS):
        opt.zero_grad()
        for m in range(2):
            x, y = batch(step, m)
            with model.no_sync() if m == 0 else nullcontext():
                F.mse_loss(model(_slice(mesh, x)), _slice(mesh, y)).backward()
        opt.step()
        norms.append(float(opt.grad_norm))
    with torch.no_grad():  # the next forward waits for the overlapped gather of the last step
        model(batch(0, 0)[0])
    diff = max_param_diff(model, ref)
    assert diff <= ATOL, f"param max diff {diff:.3g}"
    assert all(abs(a - b) <= 1e-5 * b for a, b in zip(norms, ref_norms)), (norms, ref_norms)


class LossNet(nn.Module):
    """``model(X, Y)`` returns the loss, as in the VeDeviceMesh doc's training loop."""

    def __init__(self) -> None:
        super().__init__()
        self.net = make_net()

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.net(x), y)


def run_seed_snippet() -> None:
    """The VeDeviceMesh doc's snippet, as written (``...`` filled with the learning rate), on (DP, TP) = (2, 2)."""
    from vemesh import VESCALE_DEVICE_MESH
    from vemesh.ddp import DistributedDataParallel
    from vemesh.optim import DistributedOptimizer

    ref = LossNet()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=LR)
    model = LossNet()
    VESCALE_DEVICE_MESH.init_device_mesh("cpu", mesh_shape=(2, 2), mesh_dim_names=("DP", "TP"))
    try:
        sharding_plan = {f"net.{k}": v for k, v in TP_PLAN.items()}
        if VESCALE_DEVICE_MESH.get_strategy_size("TP") > 1:
            model = parallelize_module(model, VESCALE_DEVICE_MESH["TP"], sharding_plan)
        if VESCALE_DEVICE_MESH.get_strategy_size("DP") > 1:
            model = DistributedDataParallel(model, VESCALE_DEVICE_MESH["DP"])
        if VESCALE_DEVICE_MESH.get_strategy_size("DP") > 1:
            optimizer = DistributedOptimizer(torch.optim.Adam, models=[model], optimizer_kwargs={"lr": LR})
        dp, r = VESCALE_DEVICE_MESH.get_strategy_size("DP"), VESCALE_DEVICE_MESH.lookup_rank("DP")
        data_set = [batch(step, 0) for step in range(STEPS)]
        for X, Y in data_set:
            b = GLOBAL_BATCH // dp
            X, Y = X[r * b : (r + 1) * b], Y[r * b : (r + 1) * b]  # this DP rank's rows
            optimizer.zero_grad()
            loss = model(X, Y)
            loss.backward()
            optimizer.step()
        for X, Y in data_set:
            ref_opt.zero_grad()
            ref(X, Y).backward()
            ref_opt.step()
        diff = max(
            (full(p.detach()) - q.detach()).abs().max().item()
            for p, q in zip(model.module.parameters(), ref.parameters())
        )
        assert diff <= ATOL, f"param max diff {diff:.3g} vs one-process Adam"
    finally:
        VESCALE_DEVICE_MESH.reset()


def contract_scenarios(results: Results, mesh: DeviceMesh, shape: tuple[int, int]) -> None:
    if shape == (4, 1):
        check(results, "types[4x1]", lambda: run_types(mesh))
        check(results, "freed-when-dropped[4x1]", lambda: run_freed_when_dropped(mesh))
        check(results, "lr-scheduler[4x1]", lambda: run_lr_scheduler(mesh))
        check(results, "grad-scaler[4x1-adamw]", lambda: run_grad_scaler(mesh, zero=False))
        check(results, "grad-scaler[4x1-zero]", lambda: run_grad_scaler(mesh, zero=True))
        check(results, "dcp-round-trip[4x1]", lambda: run_dcp_round_trip(mesh))
        check(results, "dcp-zero-to-torch-ddp[4x1]", lambda: run_zero_to_torch_ddp(mesh))
    if shape == (2, 2):
        check(results, "dcp-round-trip[2x2]", lambda: run_dcp_round_trip(mesh))
        check(results, "grad-scaler[2x2-zero-tp]", lambda: run_grad_scaler_tp(mesh))
        check(results, "vescale-call-form[2x2]", lambda: run_vescale_call_form(mesh))
        check(results, "seed-snippet[2x2]", run_seed_snippet)
