"""Multi-rank checkpoint scenarios, run on real gloo ranks by ``test_resume.py``.

Each worker returns, on every rank, ``{scenario: result}``; the tests compare the results of
every rank with the values they compute themselves.
"""

from __future__ import annotations

import os
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from ckpt_harness import build, full_params, train_step

from vemesh import VESCALE_DEVICE_MESH, checkpoint

N, M = 3, 3  # train N steps on (2, 2), save, then M more


def _run(results: dict[str, Any], name: str, fn: Callable[[], Any]) -> None:
    try:
        results[name] = fn()
    except Exception:  # noqa: BLE001 - reported to pytest with the rank
        results[name] = {"error": traceback.format_exc()}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def four_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Save on (2, 2) after N steps; resume in this same process on re-initialized meshes."""
    ddp, opt = build((2, 2))
    ref_losses = []
    for step in range(1, N + M + 1):
        ref_losses.append(train_step(ddp, opt, step))
        if step == N:
            checkpoint.save(root, model=ddp, optimizer=opt, step=step, extra={"tokens_seen": 123})
    ref_params = full_params(ddp)
    results: dict[str, Any] = {"reference": ref_losses[N:]}

    def resume(shape: tuple[int, int], zero: bool, with_optimizer: bool = True) -> dict[str, Any]:
        ddp, opt = build(shape, zero=zero, seed=123)  # other weights: only the load can make them match
        step, extra = checkpoint.load(root, model=ddp, optimizer=opt if with_optimizer else None)
        mesh = VESCALE_DEVICE_MESH.shape
        losses = [train_step(ddp, opt, s) for s in range(step + 1, N + M + 1)]
        return {"step": step, "extra": extra, "mesh": mesh, "losses": losses, "param_diff": _max_diff(full_params(ddp), ref_params)}

    _run(results, "zero-4x1", lambda: resume((4, 1), True))
    _run(results, "zero-1x4", lambda: resume((1, 4), True))
    _run(results, "adamw-2x2", lambda: resume((2, 2), False))  # a ZeRO-1 checkpoint into plain AdamW
    _run(results, "weights-only-2x2", lambda: resume((2, 2), True, with_optimizer=False))
    return results


def two_ranks(rank: int, world_size: int, src: str, work: str) -> dict[str, Any]:
    """World size 2: DP absorbs the change through -1; bf16 masters; damaged checkpoints."""
    results: dict[str, Any] = {}

    def absorb(shape: tuple[int, int]) -> dict[str, Any]:
        ddp, opt = build(shape, seed=7)
        step, _ = checkpoint.load(src, model=ddp, optimizer=opt)
        return {"mesh": VESCALE_DEVICE_MESH.shape, "losses": [train_step(ddp, opt, s) for s in range(step + 1, N + M + 1)]}

    _run(results, "minus-one-tp2", lambda: absorb((-1, 2)))
    _run(results, "minus-one-tp1", lambda: absorb((-1, 1)))
    _run(results, "bf16-masters", lambda: _bf16_masters(Path(work) / "bf16"))
    _run(results, "damaged", lambda: _damaged(rank, Path(work) / "damaged"))
    return results


def _full_state(opt: Any) -> dict[str, torch.Tensor]:
    sd = opt.state_dict()
    out = {f"{n}.{k}": t for n, st in sd["state"].items() for k, t in st.items()}
    return {k: (t.full_tensor() if isinstance(t, torch.distributed.tensor.DTensor) else t).float() for k, t in out.items()}


def _bf16_masters(root: Path) -> dict[str, Any]:
    """bf16 weights with fp32 masters: save on (2, 1), load on (1, 2); the fp32 state is exact."""
    ddp, opt = build((2, 1), dtype=torch.bfloat16)
    for step in (1, 2):
        train_step(ddp, opt, step)
    checkpoint.save(root, model=ddp, optimizer=opt, step=2)
    saved = _full_state(opt)
    ddp, opt = build((1, 2), dtype=torch.bfloat16, seed=9)
    checkpoint.load(root, model=ddp, optimizer=opt)
    loaded = _full_state(opt)
    return {"keys": sorted(saved) == sorted(loaded), "has_masters": any(k.endswith(".master_param") for k in saved),
            "state_diff": _max_diff(saved, loaded), "loss": train_step(ddp, opt, 3)}


def _damaged(rank: int, root: Path) -> dict[str, Any]:
    """Checkpoints at steps 1 and 2 on (1, 2); damage step 2 in several ways; every rank must agree."""
    out: dict[str, Any] = {}
    ddp, opt = build((1, 2))
    train_step(ddp, opt, 1)
    checkpoint.save(root, model=ddp, optimizer=opt, step=1)
    at1 = full_params(ddp)
    train_step(ddp, opt, 2)

    def damage(how: str) -> None:
        checkpoint.save(root, model=ddp, optimizer=opt, step=2)  # a fresh step 2 each time
        if rank == 0:  # one rank damages, after every rank finished saving
            shard = root / "step_000002" / "__1_0.distcp"
            size = shard.stat().st_size
            if how == "truncate":
                os.truncate(shard, size // 2)
            elif how == "delete":
                shard.unlink()
            else:  # same size: only the ranks reading it find out, inside DCP
                with open(shard, "r+b") as f:
                    f.seek(64)
                    f.write(b"\0" * (size - 128))
        dist.barrier()

    for how in ("truncate", "delete", "garble"):
        damage(how)
        fresh, fresh_opt = build((1, 2), seed=5)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            step, _ = checkpoint.load_latest(root, model=fresh, optimizer=fresh_opt)
        out[how] = {
            "step": step,
            "param_diff": _max_diff(full_params(fresh), at1),
            "warnings": [str(w.message) for w in caught if "skipping damaged checkpoint" in str(w.message)],
        }

    wider, wider_opt = build((1, 2), n_embd=48)
    for label, fn in (("mismatch-load", checkpoint.load), ("mismatch-latest", checkpoint.load_latest)):
        try:
            fn(root / "step_000001" if label == "mismatch-load" else root, model=wider, optimizer=wider_opt)
            out[label] = "no error"
        except checkpoint.CheckpointError as e:
            out[label] = f"{type(e).__name__}: {e}"
    try:
        checkpoint.load(root / "nope", model=wider, optimizer=wider_opt)
    except checkpoint.CheckpointError as e:
        out["missing"] = f"{type(e).__name__}: {e}"
    return out
