"""What each rank of the 4-rank gloo world runs for the parity tests; see test_ddp_optim_parity.py.

Every scenario trains with the loop every torch user writes (``opt.zero_grad(); loss.backward();
opt.step()``, with ``no_sync()`` for accumulation) and no vemesh-specific call, and compares the
parameters with a single process running the same torch optimizer on the global batch. Expected
values are computed on every rank; collectives come first and asserts last, so a failing check
on one rank does not leave the others waiting in a collective.
"""

from __future__ import annotations

import copy
import math
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from ddp_optim_harness import (
    GLOBAL_BATCH,
    WEIGHT_DECAY,
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

import vemesh.optim
from vemesh.ddp import DistributedDataParallel as DDP
from vemesh.parallel.ddp.grad_buffer import local_tensor
from vemesh.optim import DistributedOptimizer

LR, WD, STEPS = 1e-3, WEIGHT_DECAY, 5
MESHES = [(4, 1), (2, 2), (1, 4)]
PARITY_ATOL = 1e-5  # observed <= 3.5e-6 (TP=4 + clipping), ~3e-8 without TP
BF16_ATOL = 1e-2  # bf16 params + activations, fp32 grads and masters, vs fp32 reference (observed 2.9e-3)


@dataclass(frozen=True)
class Config:
    """One parity run: the optimizer, wrapper options, and how the training loop clears and clips."""

    name: str
    opt: str  # "adamw" | "sgd" (torch optimizers over model.parameters()) | "zero" | "zero-sgd" (DistributedOptimizer)
    overlap: bool
    micro: int = 1  # backward passes per step; all but the last inside no_sync()
    groups: bool = False  # two param groups + a parameter unused everywhere
    bucket: int | None = 64
    clip: float | None = None
    clip_by: str = "torch"  # "torch": clip_grad_norm_ in the loop; "optimizer": DistributedOptimizer(clip_grad=...)
    clear: str = "opt"  # "opt": opt.zero_grad(); "opt-keep": set_to_none=False; "model": model.zero_grad()
    partial_extra: bool = False  # a parameter used only by DP rank 0


def _grid(opt: str, **kw: Any) -> list[Config]:
    return [Config(f"{opt}-{'overlap' if ov else 'no-overlap'}" + "".join(f"-{k}={v}" for k, v in kw.items()), opt, ov, **kw) for ov in (True, False)]


CONFIGS = {  # (DP, TP) -> configs
    (4, 1): [
        *_grid("adamw"), *_grid("sgd"),
        *_grid("adamw", micro=3), *_grid("sgd", micro=2),
        *_grid("adamw", clear="opt-keep"), *_grid("sgd", clear="model"),
        *_grid("zero"), *_grid("zero-sgd", micro=2, clear="opt-keep"),
        Config("zero-groups-clip", "zero", True, groups=True, clip=0.05),
        Config("zero-clip-by-optimizer", "zero", False, clip=0.05, clip_by="optimizer", micro=2),
        Config("adamw-partial-use", "adamw", True, groups=True, partial_extra=True),
    ],
    (2, 2): [
        Config("adamw-accum", "adamw", True, micro=2, groups=True),
        Config("zero-accum-clip", "zero", True, micro=2, groups=True, clip=0.05),
        Config("zero-clip-by-optimizer", "zero", False, clip=0.05, clip_by="optimizer", clear="model"),
        Config("zero-partial-use", "zero", True, groups=True, partial_extra=True),
    ],
    (1, 4): [
        Config("adamw", "adamw", True, groups=True, clip=0.05),
        Config("zero-accum", "zero", False, micro=2, clip=0.05, clip_by="optimizer"),
    ],
}


def torch_optimizer(name: str) -> Any:
    """The torch optimizer behind a config's ``opt``: ``make(params)``."""
    if name.endswith("sgd"):
        return lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=WD)
    return lambda params: torch.optim.AdamW(params, lr=LR, weight_decay=WD)


def build(mesh: DeviceMesh, cfg: Config, dtype: torch.dtype = torch.float32) -> tuple[DDP, torch.optim.Optimizer]:
    with_unused = cfg.groups or cfg.partial_extra
    model = DDP(tp_model(mesh["TP"], with_unused=with_unused, dtype=dtype), mesh["DP"], overlap_grad_reduce=cfg.overlap, bucket_size=cfg.bucket)
    params = param_groups(model, WD) if cfg.groups else model.parameters()
    clip = cfg.clip if cfg.clip_by == "optimizer" else None
    if cfg.opt == "zero" and cfg.groups:  # instance form: param groups from the user's optimizer
        return model, DistributedOptimizer(torch_optimizer(cfg.opt)(params), models=[model], clip_grad=clip)
    if cfg.opt == "zero":  # veScale's class form
        return model, DistributedOptimizer(torch.optim.AdamW, models=[model], clip_grad=clip, optimizer_kwargs={"lr": LR, "weight_decay": WD})
    if cfg.opt == "zero-sgd":  # class form with keyword options
        return model, DistributedOptimizer(torch.optim.SGD, models=[model], clip_grad=clip, lr=0.05, momentum=0.9, weight_decay=WD)
    return model, torch_optimizer(cfg.opt)(params)


def train_step(model: DDP, opt: torch.optim.Optimizer, mesh: DeviceMesh, cfg: Config, step: int, dtype: torch.dtype = torch.float32) -> float | None:
    """One step of the plain torch loop on this rank's DP slice of the global batch; returns the clip norm."""
    dp, dp_rank = mesh["DP"].size(), mesh["DP"].get_local_rank()
    b = GLOBAL_BATCH // dp
    if cfg.clear == "model":
        model.zero_grad()
    else:
        opt.zero_grad(set_to_none=cfg.clear == "opt")
    for m in range(cfg.micro):
        x, y = batch(step, m, dtype)
        x, y = x[dp_rank * b : (dp_rank + 1) * b], y[dp_rank * b : (dp_rank + 1) * b]
        with model.no_sync() if m < cfg.micro - 1 else nullcontext():
            loss_of(model, x, y, dp_rank, cfg.partial_extra).backward()
    norm = None
    if cfg.clip and cfg.clip_by == "torch":
        if mesh["TP"].size() == 1:
            norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.clip))
        else:  # torch's own refuses a model mixing DTensor and plain parameters
            norm = float(vemesh.optim.clip_grad_norm_(model.parameters(), cfg.clip))
    opt.step()
    if cfg.clip and cfg.clip_by == "optimizer":
        norm = float(opt.grad_norm)  # type: ignore[attr-defined]
    return norm


def run_parity(mesh: DeviceMesh, cfg: Config) -> None:
    dp = mesh["DP"].size()
    ref, ref_grads, ref_norms = reference_run(
        STEPS, cfg.micro, torch_optimizer(cfg.opt), cfg.clip, cfg.groups or cfg.partial_extra, cfg.groups or cfg.partial_extra, dp, cfg.partial_extra
    )
    model, opt = build(mesh, cfg)
    grad_diff, placements_ok, norms = 0.0, True, []
    for step in range(STEPS):
        norms.append(train_step(model, opt, mesh, cfg, step))
        if step == 0:  # after backward (and clipping/stepping, which do not touch .grad's unclipped values when no clip)
            for name, p in model.module.named_parameters():
                if isinstance(p, DTensor):
                    placements_ok &= isinstance(p.grad, DTensor) and p.grad.placements == p.placements
                if not cfg.clip:
                    expected = ref_grads[0].get(name, torch.zeros(p.shape))  # unused everywhere -> zero grad
                    grad_diff = max(grad_diff, (full(p.grad) - expected).abs().max().item())
    diff = max_param_diff(model, ref)
    state = adam_state_report(model, opt) if isinstance(opt, DistributedOptimizer) and cfg.opt == "zero" else None
    assert placements_ok, "DTensor parameter got a gradient with other placements"
    assert grad_diff <= 1e-6, f"grad max diff {grad_diff:.3g} vs single-process reference"
    assert diff <= PARITY_ATOL, f"param max diff {diff:.3g} > {PARITY_ATOL} after {STEPS} steps"
    assert isinstance(opt, torch.optim.Optimizer)
    if cfg.clip:
        assert max(ref_norms) > cfg.clip, "clip too large to exercise clipping"
        assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in zip(norms, ref_norms)), (norms, ref_norms)
    if state is not None:
        owned, state_numel, local_numel, total_owned = state
        assert state_numel == 2 * owned, (state_numel, owned)  # exp_avg + exp_avg_sq over the owned shard only
        assert total_owned == local_numel, (total_owned, local_numel)  # DP ranks partition the params
        assert owned <= math.ceil(local_numel / dp) + 1, (owned, local_numel, dp)


def adam_state_report(model: DDP, opt: DistributedOptimizer) -> tuple[int, int, int, int]:
    """(owned elements, Adam state elements, local param elements, owned summed over DP)."""
    owned = sum(p.numel() for g in opt.optimizer.param_groups for p in g["params"])
    state_numel = sum(t.numel() for s in opt.state.values() for k, t in s.items() if k != "step" and torch.is_tensor(t))
    local_numel = sum(local_tensor(p).numel() for p in model.module.parameters())
    total = torch.tensor(owned)
    dist.all_reduce(total, group=model.data_parallel_group)
    return owned, state_numel, local_numel, int(total)


def run_bf16(mesh: DeviceMesh) -> None:
    """bf16 parameters, fp32 grad buffer and fp32 masters track the fp32 reference."""
    cfg = Config("bf16", "zero", True, micro=2)
    ref, _, _ = reference_run(STEPS, 2, torch_optimizer("adamw"), None, False, False)
    model, opt = build(mesh, cfg, torch.bfloat16)
    assert all(b.data.dtype == torch.float32 for b in model.grad_buffers)
    for step in range(STEPS):
        train_step(model, opt, mesh, cfg, step, torch.bfloat16)
    diff = max_param_diff(model, ref)
    # A plain torch optimizer on bf16 parameters: fp32 buffer, param.grad handed out in bf16.
    plain_cfg = Config("bf16-ddp", "adamw", True, micro=2, clear="opt-keep")
    plain, plain_opt = build(mesh, plain_cfg, torch.bfloat16)
    plain_opt.zero_grad(set_to_none=False)
    dp, dp_rank = mesh["DP"].size(), mesh["DP"].get_local_rank()
    b = GLOBAL_BATCH // dp
    for m in range(2):
        x, y = batch(0, m, torch.bfloat16)
        with plain.no_sync() if m == 0 else nullcontext():
            loss_of(plain, x[dp_rank * b : (dp_rank + 1) * b], y[dp_rank * b : (dp_rank + 1) * b], dp_rank, False).backward()
    _, ref_grads, _ = reference_run(1, 2, torch_optimizer("adamw"), None, False, False)
    grad_diff = max((full(p.grad).float() - ref_grads[0][n]).abs().max().item() for n, p in plain.module.named_parameters())
    rounded = all(torch.equal(full(p.grad), full(g).to(torch.bfloat16)) for p, g in zip(plain.module.parameters(), plain._main_grad_like))
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert diff <= BF16_ATOL, f"bf16 param max diff {diff:.3g} > {BF16_ATOL}"
    assert all(p.grad.dtype == torch.bfloat16 and p.main_grad.dtype == torch.float32 for p in plain.parameters())
    assert grad_diff <= BF16_ATOL, f"bf16 grad max diff {grad_diff:.3g} > {BF16_ATOL}"
    assert rounded, "param.grad is not the fp32 main_grad rounded to bf16"


def run_state_dict(mesh: DeviceMesh) -> None:
    """Save after 2 steps, train 2 more; a fresh model + optimizer loaded from the save must match exactly."""
    cfg = Config("sd", "zero", True, groups=True, clip=0.05, clip_by="optimizer")
    model, opt = build(mesh, cfg)
    for step in range(2):
        train_step(model, opt, mesh, cfg, step)
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    assert all(k.startswith("module.") for k in saved_model), "state_dict keys must carry torch DDP's 'module.' prefix"
    for step in range(2, 4):
        train_step(model, opt, mesh, cfg, step)
    fresh, fresh_opt = build(mesh, cfg)
    fresh.load_state_dict(saved_model)
    fresh_opt.load_state_dict(saved_opt)
    for step in range(2, 4):
        train_step(fresh, fresh_opt, mesh, cfg, step)
    same = [torch.equal(local_tensor(a), local_tensor(b)) for a, b in zip(model.parameters(), fresh.parameters())]
    bad = copy.deepcopy(saved_opt)
    bad["param_groups"] = bad["param_groups"][:1]
    try:
        fresh_opt.load_state_dict(bad)
        raise AssertionError("load_state_dict accepted a state dict with a missing param group")
    except ValueError as e:
        assert "1 param groups, this optimizer has 2" in str(e), e
    assert all(same), "resumed run differs from the uninterrupted one"


def run_freeze_mid_training(mesh: DeviceMesh) -> None:
    """A layer frozen after 2 steps: wrapped again with the optimizer's state carried by name
    (docs/data-parallel.md), ZeRO-1 over (DP, TP) = (2, 2) trains what torch's AdamW does in one process with the same
    layer frozen (which skips it: no gradient)."""
    from vemesh.optim import get_optimizer_state, set_optimizer_state

    ref = make_net()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=LR, weight_decay=WD)
    net = tp_model(mesh["TP"])

    def wrap() -> tuple[DDP, DistributedOptimizer]:
        model = DDP(net, mesh["DP"])
        return model, DistributedOptimizer(torch.optim.AdamW, models=[model], lr=LR, weight_decay=WD)

    model, opt = wrap()
    cfg = Config("freeze", "zero", True)
    for step in range(STEPS):
        if step == 2:
            saved = get_optimizer_state(model, opt)
            opt.zero_grad()
            net.fc1.requires_grad_(False)
            ref.fc1.requires_grad_(False)
            del model, opt
            model, opt = wrap()
            set_optimizer_state(model, opt, saved)
        ref_opt.zero_grad()
        x, y = batch(step, 0)
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        train_step(model, opt, mesh, cfg, step)
    frozen = net.fc1.weight.grad is None and net.fc1.bias.grad is None
    diff = max_param_diff(model, ref)
    assert frozen, "the frozen layer kept a gradient"
    assert diff <= PARITY_ATOL, f"param max diff {diff:.3g} > {PARITY_ATOL} after {STEPS} steps, fc1 frozen from step 2"


def run_broadcast(mesh: DeviceMesh) -> None:
    """Each DP rank starts from different weights and buffers; wrapping makes all equal to DP rank 0's."""
    seed = mesh["DP"].get_local_rank()
    net = tp_model(mesh["TP"], seed=seed)
    net.register_buffer("running", torch.full((3,), float(seed)))
    model = DDP(net, mesh["DP"], bucket_size=64)
    diff = max_param_diff(model, make_net(seed=0))
    assert diff == 0.0, diff
    assert [n for n, _ in model.named_buffers()] == ["module.running"] and list(model.buffers())[0].tolist() == [0.0] * 3


def run_running_stats_as_torch(mesh: DeviceMesh) -> None:
    """A BatchNorm's running statistics under ``no_sync()`` accumulation, 2 micro-batches a step, 3 steps: every rank's
    buffers equal torch DDP's on the same data after each step. torch broadcasts DP rank 0's buffers before a training
    forward but the one after a forward under ``no_sync()``; vemesh broadcast them before every one, so that the other
    DP ranks' statistics differed from torch's run.

    After each step an evaluation under ``no_grad``, in eval mode (step 0) and in train mode (steps 1, 2: the
    statistics move): torch broadcasts before it and not before the next training forward; vemesh broadcast only
    with gradients enabled, so the other DP ranks evaluated with their own statistics."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    ours = DDP(copy.deepcopy(net), mesh["DP"])
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(net), process_group=mesh["DP"].get_group())
    rank, diffs = mesh["DP"].get_local_rank(), []
    for step in range(3):
        for m in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + 10 * m + rank))
            for model in (ours, theirs):
                with model.no_sync() if m == 0 else nullcontext():
                    model(x).sum().backward()
        diffs.append(max((a - b).abs().max().item() for a, b in zip(ours.module.buffers(), theirs.module.buffers())
                         if a.is_floating_point()))
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 + step + rank))
        evaluated = []
        for model in (ours, theirs):
            model.train(step > 0)
            with torch.no_grad():
                evaluated.append(model(x))
            model.train()
        diffs.append((evaluated[0] - evaluated[1]).abs().max().item())
    assert diffs == [0.0] * 6, f"running statistics, then evaluations, differ from torch DDP's at each step by {diffs}"


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
    raises(TypeError, "cannot be pickled or deep-copied", lambda: copy.deepcopy(wrapped))
    zero = DDP(make_net(), dp_mesh)
    raises(TypeError, "'adam'", lambda: DistributedOptimizer("adam", [zero]))  # type: ignore[arg-type]
    raises(TypeError, "models", lambda: DistributedOptimizer(torch.optim.AdamW, zero))  # type: ignore[arg-type]
    raises(TypeError, "models is required", lambda: DistributedOptimizer(torch.optim.AdamW))
    raises(TypeError, "Sequential", lambda: DistributedOptimizer(torch.optim.AdamW, [torch.nn.Sequential()]))
    raises(ValueError, "-1.0", lambda: DistributedOptimizer(torch.optim.AdamW, [zero], clip_grad=-1.0))
    raises(ValueError, "grad_to_fp32=False", lambda: DistributedOptimizer(torch.optim.AdamW, [zero], grad_to_fp32=False))
    raises(ValueError, "['lr']", lambda: DistributedOptimizer(torch.optim.AdamW, [zero], optimizer_kwargs={"lr": 1}, lr=2))
    inner = torch.optim.AdamW(zero.parameters(), lr=1e-3)
    raises(ValueError, "lr", lambda: DistributedOptimizer(inner, [zero], lr=1e-3))
    stranger = torch.optim.AdamW(make_net().parameters())
    raises(ValueError, "not a trainable parameter", lambda: DistributedOptimizer(stranger, [zero]))
    opt = DistributedOptimizer(torch.optim.AdamW, [zero])
    raises(NotImplementedError, "add_param_group", lambda: opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(1))]}))
    raises(AttributeError, "read-only", lambda: setattr(opt, "state", {1: 2}))

    # Runtime misuse, identical on every DP rank so that the ranks stay in step: stepping on
    # gradients that never left no_sync() raises, for a torch optimizer and for ZeRO-1.
    x, y = batch(0, 0)
    for model, optimizer in [(wrapped, torch.optim.SGD(wrapped.parameters(), lr=0.1)), (zero, opt)]:
        before = [local_tensor(p).clone() for p in model.parameters()]
        optimizer.zero_grad()
        with model.no_sync():
            loss_of(model, x, y, 0, False).backward()
        raises(RuntimeError, "never averaged", optimizer.step)
        assert all(torch.equal(a, local_tensor(p)) for a, p in zip(before, model.parameters())), "a refused step changed weights"
        model.finish_grad_sync()  # the explicit way out: average the accumulation now
        optimizer.step()
    some = DDP(make_net(with_unused=True), dp_mesh)
    some_opt = DistributedOptimizer(torch.optim.AdamW, [some])
    some_opt.zero_grad()
    loss_of(some, x, y, 0, False).backward()
    some.module.unused.grad = None
    raises(ValueError, "1 of 11 parameters have no gradient (e.g. 'unused')", some_opt.step)


def run_vescale_mesh() -> None:
    """The contract's usage, on vemesh's global mesh."""
    from vemesh import VESCALE_DEVICE_MESH

    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    try:
        mesh = VESCALE_DEVICE_MESH.mesh
        cfg = Config("vescale", "zero", True, clip=1.0, clip_by="optimizer")
        ref, _, _ = reference_run(STEPS, 1, torch_optimizer("adamw"), 1.0, False, False)
        model, opt = build(mesh, cfg)
        assert model.data_parallel_group is VESCALE_DEVICE_MESH["DP"].get_group()
        for step in range(STEPS):
            train_step(model, opt, mesh, cfg, step)
        diff = max_param_diff(model, ref)
        assert diff <= PARITY_ATOL, f"param max diff {diff:.3g}"
    finally:
        VESCALE_DEVICE_MESH.reset()


def run_tp_batches_named() -> None:
    """A replica over TP whose gradient differs across the TP ranks, and its cause told from the forward's inputs:
    TP ranks given other batches (a DistributedSampler over the world's ranks) and, with the same batches, a
    LayerNorm over each rank's own features; under vemesh's DDP and its ``fully_shard``. Before, the first read "Likeliest: the module's input is this rank's
    part only ... (the other 1 replicas' gradients agree across TP, so the TP ranks saw the same batch)": the
    LayerNorm's bias, whose gradient TP's Colwise input sums over the ranks, agreed. A right plan on the DP rank's
    batch trains."""
    from torch import nn
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from vemesh import VESCALE_DEVICE_MESH
    from vemesh.parallel import fully_shard
    from vemesh.parallel.tp_replicas import TPReplicaError

    VESCALE_DEVICE_MESH.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    try:
        def first_step(norm_after: bool, seed: int) -> str:
            torch.manual_seed(0)
            if norm_after:  # a LayerNorm over the Colwise output's local features: this rank's part only
                model = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(32), nn.ReLU(), nn.Linear(64, 16))
                plan = {"0": ColwiseParallel(), "3": RowwiseParallel()}
            else:
                model = nn.Sequential(nn.LayerNorm(16), nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 16))
                plan = {"1": ColwiseParallel(), "3": RowwiseParallel()}
            model = parallelize_module(model, VESCALE_DEVICE_MESH["TP"], plan)
            wrapped = DDP(model, VESCALE_DEVICE_MESH["DP"]) if wrapper == "ddp" else fully_shard(model)
            torch.manual_seed(seed)
            try:  # DDP checks at the first averaged backward, vemesh's fully_shard at the first optimizer step
                wrapped(torch.randn(8, 16)).square().mean().backward()
                torch.optim.SGD(wrapped.parameters(), lr=0.1).step()
            except TPReplicaError as e:
                return str(e)
            return ""

        dp_rank = VESCALE_DEVICE_MESH.get_local_rank("DP")
        for wrapper in ("ddp", "fsdp"):
            by_rank = first_step(False, seed=dist.get_rank())  # the world's rank: each TP rank draws its own batch
            assert "The cause: the TP ranks were given different batches" in by_rank and \
                "num_replicas=mesh['DP'].size(), rank=mesh.get_local_rank('DP')" in by_rank, (wrapper, by_rank)
            local = first_step(True, seed=dp_rank)
            assert "Likeliest: the module's input is this rank's part only" in local and \
                "(The TP ranks saw the same batch: its forward got the same inputs on each TP rank.)" in local, \
                (wrapper, local)
            assert first_step(False, seed=dp_rank) == "", wrapper
    finally:
        VESCALE_DEVICE_MESH.reset()


def worker(rank: int, world_size: int) -> Results:
    from torch_contract_scenarios import contract_scenarios

    results: Results = {}
    for dp, tp in MESHES:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("DP", "TP"))
        for cfg in CONFIGS[(dp, tp)]:
            check(results, f"parity[{dp}x{tp}-{cfg.name}]", lambda: run_parity(mesh, cfg))
        if (dp, tp) == (2, 2):
            check(results, "bf16", lambda: run_bf16(mesh))
            check(results, "state_dict", lambda: run_state_dict(mesh))
            check(results, "errors", lambda: run_errors(mesh))
            check(results, "broadcast", lambda: run_broadcast(mesh))
            check(results, "running_stats_as_torch", lambda: run_running_stats_as_torch(mesh))
            check(results, "freeze_mid_training", lambda: run_freeze_mid_training(mesh))
        contract_scenarios(results, mesh, (dp, tp))
    check(results, "vescale_mesh", run_vescale_mesh)
    check(results, "tp_batches_named", run_tp_batches_named)
    return results
