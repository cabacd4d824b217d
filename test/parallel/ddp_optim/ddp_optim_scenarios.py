"""What each rank of the 4-rank gloo world runs; see test_ddp_optim_parity.py for the asserts.

Every scenario computes its expected values on every rank (the single-process AdamW reference
is cheap), gathers everything it needs with collectives first and asserts last, so a failing
check on one rank does not leave the others waiting in a collective.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from ddp_optim_harness import (
    GLOBAL_BATCH,
    Results,
    batch,
    check,
    full,
    loss_of,
    make_net,
    max_param_diff,
    param_groups,
    reference_run,
    tp_model,
)
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor

from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.ddp.grad_buffer import local_tensor
from vemesh.optim import DistributedOptimizer

LR, WD, STEPS = 1e-3, 0.1, 3
MESHES = [(4, 1), (2, 2), (1, 4)]
PARITY_ATOL = 1e-5  # observed <= 3.5e-6 (TP=4 + clipping), 1.5e-8 without TP
BF16_ATOL = 1e-2  # bf16 params + activations, fp32 grads and masters, vs fp32 reference (observed 2.9e-3)


@dataclass(frozen=True)
class Config:
    """One parity run: wrapper options and what the training loop does."""

    name: str
    distopt: bool
    overlap: bool
    micro: int = 1
    groups: bool = False  # optimizer instance with two param groups + an unused parameter
    bucket: int | None = None
    clip: float | None = None
    collective: str | None = None  # force the bucket collective (test the reduce-scatter path on gloo)
    partial_extra: bool = False  # a parameter used only by DP rank 0


CONFIGS = [
    Config("ddp", distopt=False, overlap=False, groups=True),
    Config("ddp-overlap-accum", distopt=False, overlap=True, micro=2, bucket=64),
    Config("zero-accum", distopt=True, overlap=False, micro=2, groups=True),
    Config("zero-overlap-clip", distopt=True, overlap=True, bucket=64, clip=0.05),
]
EXTRA_CONFIGS = {  # (DP, TP) -> configs run only on that mesh
    (2, 2): [
        Config("zero-reduce-scatter", distopt=True, overlap=True, micro=2, groups=True, bucket=64, clip=0.05,
               collective="reduce_scatter"),
        Config("ddp-partial-use", distopt=False, overlap=True, groups=True, bucket=64, partial_extra=True),
        Config("zero-partial-use", distopt=True, overlap=True, groups=True, bucket=64, partial_extra=True),
    ],
    (4, 1): [Config("ddp-partial-use", distopt=False, overlap=True, groups=True, bucket=64, partial_extra=True)],
}


def build(mesh: DeviceMesh, cfg: Config, dtype: torch.dtype = torch.float32) -> tuple[DDP, Any]:
    with_unused = cfg.groups or cfg.partial_extra
    model = DDP(
        tp_model(mesh["TP"], with_unused=with_unused, dtype=dtype),
        mesh["DP"],
        overlap_grad_reduce=cfg.overlap,
        use_distributed_optimizer=cfg.distopt,
        bucket_size=cfg.bucket,
    )
    if cfg.collective:  # the non-gloo choices: reduce-scatter the grads, all-gather the params
        for b in model.buffers:
            b.collective = cfg.collective  # type: ignore[assignment]
            b.param_gather = "all_gather"
    if cfg.distopt and cfg.groups:
        inner = torch.optim.AdamW(param_groups(model, WD), lr=LR, weight_decay=WD)
        return model, DistributedOptimizer(inner, models=[model], clip_grad=cfg.clip)
    if cfg.distopt:
        return model, DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD, clip_grad=cfg.clip)
    params = param_groups(model, WD) if cfg.groups else model.parameters()
    return model, torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def train_step(model: DDP, opt: Any, mesh: DeviceMesh, cfg: Config, step: int, dtype: torch.dtype = torch.float32) -> Any:
    """One step on this rank's DP slice of the global batch; returns ``opt.step()``'s value."""
    dp, dp_rank = mesh["DP"].size(), mesh["DP"].get_local_rank()
    b = GLOBAL_BATCH // dp
    opt.zero_grad()  # a DistributedOptimizer also zeroes the model's gradient buffer
    if not isinstance(opt, DistributedOptimizer):
        model.zero_grad_buffer()
    for m in range(cfg.micro):
        x, y = batch(step, m, dtype)
        x, y = x[dp_rank * b : (dp_rank + 1) * b], y[dp_rank * b : (dp_rank + 1) * b]
        with model.no_sync() if m < cfg.micro - 1 else nullcontext():
            loss_of(model, x, y, dp_rank, cfg.partial_extra).backward()
    model.finish_grad_sync()
    return None


def run_parity(mesh: DeviceMesh, cfg: Config) -> None:
    dp = mesh["DP"].size()
    with_unused = cfg.groups or cfg.partial_extra
    ref, ref_grads, ref_norms = reference_run(
        STEPS, cfg.micro, LR, WD, cfg.clip, cfg.groups or cfg.partial_extra, with_unused, dp, cfg.partial_extra
    )
    model, opt = build(mesh, cfg)
    grad_diff, placements_ok, norms = 0.0, True, []
    for step in range(STEPS):
        train_step(model, opt, mesh, cfg, step)
        if step == 0 and not cfg.distopt:
            for name, p in model.module.named_parameters():
                g = p.grad
                if g is None:  # DP=1 pass-through keeps torch's None for a parameter unused everywhere
                    placements_ok &= model.dp_size == 1 and name not in ref_grads[0]
                    continue
                if isinstance(p, DTensor):
                    placements_ok &= isinstance(g, DTensor) and g.placements == p.placements
                expected = ref_grads[0].get(name, torch.zeros(p.shape))  # unused everywhere -> zero grad
                grad_diff = max(grad_diff, (full(g) - expected).abs().max().item())
        norm = opt.step()
        if cfg.clip:
            norms.append(float(norm))
    diff = max_param_diff(model, ref)
    state = adam_state_report(model, opt) if cfg.distopt else None
    assert placements_ok, "DTensor parameter got a gradient with other placements"
    assert grad_diff <= 1e-6, f"grad max diff {grad_diff:.3g} vs single-process reference"
    assert diff <= PARITY_ATOL, f"param max diff {diff:.3g} > {PARITY_ATOL} after {STEPS} AdamW steps"
    if cfg.clip:
        assert max(ref_norms) > cfg.clip, "clip_grad too large to exercise clipping"
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    if state is not None:
        owned, state_numel, local_numel, total_owned, n_buckets = state
        assert state_numel == 2 * owned, (state_numel, owned)  # exp_avg + exp_avg_sq over the owned shard only
        assert total_owned == local_numel, (total_owned, local_numel)  # DP ranks partition the params
        assert owned <= math.ceil(local_numel / dp) + n_buckets, (owned, local_numel, dp)


def adam_state_report(model: DDP, opt: DistributedOptimizer) -> tuple[int, int, int, int, int]:
    """(owned elements, Adam state elements, local param elements, owned summed over DP, buckets)."""
    owned = sum(p.numel() for g in opt.param_groups for p in g["params"])
    state_numel = sum(
        t.numel() for s in opt.optimizer.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t)
    )
    local_numel = sum(local_tensor(p).numel() for p in model.module.parameters())
    total = torch.tensor(owned)
    dist.all_reduce(total, group=model.data_parallel_group)
    return owned, state_numel, local_numel, int(total), sum(len(b.layout.buckets) for b in model.buffers)


def run_bf16(mesh: DeviceMesh) -> None:
    """bf16 parameters, fp32 grad buffer and fp32 masters track the fp32 reference."""
    cfg = Config("bf16", distopt=True, overlap=True, bucket=64)
    ref, _, _ = reference_run(STEPS, 1, LR, WD, None, False, False)
    model, opt = build(mesh, cfg, torch.bfloat16)
    assert all(b.data.dtype == torch.float32 for b in model.buffers)
    for step in range(STEPS):
        train_step(model, opt, mesh, cfg, step, torch.bfloat16)
        opt.step()
    diff = max_param_diff(model, ref)
    # Plain DDP on bf16 parameters: fp32 buffer, param.grad handed out in bf16.
    plain_cfg = Config("bf16-ddp", distopt=False, overlap=True, bucket=64)
    plain, plain_opt = build(mesh, plain_cfg, torch.bfloat16)
    train_step(plain, plain_opt, mesh, plain_cfg, 0, torch.bfloat16)
    _, ref_grads, _ = reference_run(1, 1, LR, WD, None, False, False)
    grad_diff = max((full(p.grad).float() - ref_grads[0][n]).abs().max().item() for n, p in plain.module.named_parameters())
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert diff <= BF16_ATOL, f"bf16 param max diff {diff:.3g} > {BF16_ATOL}"
    assert all(p.grad.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32 for p in plain.parameters())
    assert grad_diff <= BF16_ATOL, f"bf16 grad max diff {grad_diff:.3g} > {BF16_ATOL}"


def run_state_dict(mesh: DeviceMesh) -> None:
    """Save after 2 steps, train 2 more; a fresh model + optimizer loaded from the save must match exactly."""
    cfg = Config("sd", distopt=True, overlap=True, groups=True, bucket=64, clip=0.05)
    model, opt = build(mesh, cfg)
    for step in range(2):
        train_step(model, opt, mesh, cfg, step)
        opt.step()
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert all(k.startswith("module.") for k in saved_model), "state_dict keys must carry torch DDP's 'module.' prefix"
    for step in range(2, 4):
        train_step(model, opt, mesh, cfg, step)
        opt.step()
    fresh, fresh_opt = build(mesh, cfg)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    for step in range(2, 4):
        train_step(fresh, fresh_opt, mesh, cfg, step)
        fresh_opt.step()
    same = [torch.equal(local_tensor(a), local_tensor(b)) for a, b in zip(model.parameters(), fresh.parameters())]
    bad = copy.deepcopy(saved_opt)
    bad["shard_numels"] = [n + 1 for n in bad["shard_numels"]]
    try:
        fresh_opt.load_state_dict(bad)
        raise AssertionError("load_state_dict accepted shards of the wrong size")
    except ValueError as e:
        assert "shard" in str(e)
    assert all(same), "resumed run differs from the uninterrupted one"


def run_broadcast(mesh: DeviceMesh) -> None:
    """Each DP rank starts from different weights; wrapping makes all equal to DP rank 0's."""
    seed = mesh["DP"].get_local_rank()
    diffs = []
    for distopt in (False, True):
        model = DDP(tp_model(mesh["TP"], seed=seed), mesh["DP"], use_distributed_optimizer=distopt, bucket_size=64)
        diffs.append(max_param_diff(model, make_net(seed=0)))
    assert diffs == [0.0, 0.0], diffs


def run_errors(mesh: DeviceMesh) -> None:
    """Every misuse raises the documented error with the bad value in the message (no collectives)."""

    def raises(exc: type[Exception], match: str, fn: Any) -> None:
        try:
            fn()
        except exc as e:
            assert match in str(e), f"{exc.__name__} message {str(e)!r} lacks {match!r}"
            return
        raise AssertionError(f"expected {exc.__name__} containing {match!r}")

    dp_mesh = mesh["DP"]
    by_group = DDP(make_net(), dp_mesh.get_group())  # a ProcessGroup works as well as a 1-D mesh
    assert by_group.data_parallel_group is dp_mesh.get_group() and by_group.dp_size == dp_mesh.size()
    net = make_net()
    wrapped = DDP(net, dp_mesh)
    raises(ValueError, "already wrapped", lambda: DDP(wrapped, dp_mesh))
    raises(ValueError, "wrap the module once", lambda: DDP(net, dp_mesh))
    raises(ValueError, "2-D", lambda: DDP(make_net(), mesh))
    frozen = make_net().requires_grad_(False)
    raises(ValueError, "no trainable parameters", lambda: DDP(frozen, dp_mesh))
    raises(ValueError, "bucket_size", lambda: DDP(make_net(), dp_mesh, bucket_size=0))
    raises(ValueError, "-5", lambda: DDP(make_net(), dp_mesh, bucket_size=-5))
    raises(TypeError, "'big'", lambda: DDP(make_net(), dp_mesh, bucket_size="big"))  # type: ignore[arg-type]
    raises(TypeError, "1.5", lambda: DDP(make_net(), dp_mesh, bucket_size=1.5))  # type: ignore[arg-type]
    raises(TypeError, "str", lambda: DDP(make_net(), "DP"))  # type: ignore[arg-type]
    raises(TypeError, "nn.Module", lambda: DDP("model", dp_mesh))  # type: ignore[arg-type]
    plain = DDP(make_net(), dp_mesh)
    raises(ValueError, "use_distributed_optimizer=True", lambda: DistributedOptimizer(torch.optim.AdamW, [plain]))
    zero = DDP(make_net(), dp_mesh, use_distributed_optimizer=True)
    raises(TypeError, "'adam'", lambda: DistributedOptimizer("adam", [zero]))  # type: ignore[arg-type]
    raises(TypeError, "models", lambda: DistributedOptimizer(torch.optim.AdamW, zero))  # type: ignore[arg-type]
    raises(ValueError, "-1.0", lambda: DistributedOptimizer(torch.optim.AdamW, [zero], clip_grad=-1.0))
    inner = torch.optim.AdamW(zero.parameters(), lr=1e-3)
    raises(ValueError, "lr", lambda: DistributedOptimizer(inner, [zero], lr=1e-3))
    stranger = torch.optim.AdamW(make_net().parameters())
    raises(ValueError, "not a trainable parameter", lambda: DistributedOptimizer(stranger, [zero]))

    # Runtime misuse: identical on every DP rank, so the raising ranks stay in step.
    model = DDP(make_net(), dp_mesh, overlap_grad_reduce=True)
    x, y = batch(0, 0)
    loss_of(model, x, y, 0, False).backward()
    raises(RuntimeError, "no_sync()", lambda: loss_of(model, x, y, 0, False).backward())
    model.finish_grad_sync()
    raises(RuntimeError, "zero_grad_buffer()", lambda: loss_of(model, x, y, 0, False).backward())
    model.zero_grad_buffer()
    loss_of(model, x, y, 0, False).backward()  # fine again
    model.finish_grad_sync()


def run_vescale_mesh() -> None:
    """The contract's usage, on vemesh's global mesh."""
    from vemesh import VESCALE_DEVICE_MESH

    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    try:
        mesh = VESCALE_DEVICE_MESH.mesh
        cfg = Config("vescale", distopt=True, overlap=True, clip=1.0)
        ref, _, _ = reference_run(STEPS, 1, LR, WD, 1.0, False, False)
        model, opt = build(mesh, cfg)
        assert model.data_parallel_group is VESCALE_DEVICE_MESH["DP"].get_group()
        for step in range(STEPS):
            train_step(model, opt, mesh, cfg, step)
            opt.step()
        diff = max_param_diff(model, ref)
        assert diff <= PARITY_ATOL, f"param max diff {diff:.3g}"
    finally:
        VESCALE_DEVICE_MESH.reset()


def worker(rank: int, world_size: int) -> Results:
    results: Results = {}
    for dp, tp in MESHES:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("DP", "TP"))
        for cfg in CONFIGS + EXTRA_CONFIGS.get((dp, tp), []):
            check(results, f"parity[{dp}x{tp}-{cfg.name}]", lambda: run_parity(mesh, cfg))
        if (dp, tp) == (1, 4):
            check(results, "dp1-pass-through", lambda: _check_pass_through(mesh))
        if (dp, tp) == (2, 2):
            check(results, "bf16", lambda: run_bf16(mesh))
            check(results, "state_dict", lambda: run_state_dict(mesh))
            check(results, "errors", lambda: run_errors(mesh))
            check(results, "broadcast", lambda: run_broadcast(mesh))
    check(results, "vescale_mesh", run_vescale_mesh)
    return results


def _check_pass_through(mesh: DeviceMesh) -> None:
    model = DDP(tp_model(mesh["TP"]), mesh["DP"])
    assert model.buffers == [] and not hasattr(next(model.parameters()), "main_grad")
    zero = DDP(tp_model(mesh["TP"]), mesh["DP"], use_distributed_optimizer=True)
    assert zero.buffers and all(b.dp_size == 1 for b in zero.buffers)
