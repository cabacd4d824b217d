"""What each rank of test_misuse.py's 4-rank gloo world does: plausible mistakes with the wrappers.

Each case returns what it saw (``_outcome``); the test asserts that it raised the right one-line error,
or gave the one-process result. One world runs them all (starting 4 ranks costs seconds).
"""

from __future__ import annotations

import sys
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import parallelize_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parallel" / "ddp_optim"))
from ddp_optim_harness import TP_PLAN, batch, make_net, max_param_diff, reference_run, tp_model  # noqa: E402

from vemesh import VESCALE_DEVICE_MESH as mesh  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.optim import clip_grad_norm_  # noqa: E402


def _outcome(fn) -> dict[str, Any]:
    try:
        return {"ok": True, "value": fn()}
    except Exception as e:  # noqa: BLE001 - reported back to pytest
        return {"ok": False, "type": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}


def _default_group_trains_as_one_process() -> dict[str, Any]:
    """``DDP(model)`` with no group on (DP, TP) = (2, 2): it reduces over mesh["DP"] and matches one process."""
    model = DDP(tp_model(mesh["TP"]))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    dp = mesh.lookup_rank("DP")
    for step in range(3):
        opt.zero_grad()
        x, y = batch(step, 0)
        F.mse_loss(model(x.chunk(2)[dp]), y.chunk(2)[dp]).backward()
        opt.step()
    ref, _, _ = reference_run(3, 1, lambda p: torch.optim.AdamW(p, lr=1e-2), None, False, False)
    return {"group": dist.get_process_group_ranks(model.data_parallel_group), "diff": max_param_diff(model, ref)}


def _wrapped_before_tp() -> None:
    """DDP first, then torch's TP on the module it holds: the new DTensor parameters would never be averaged."""
    model = DDP(make_net())  # a plain Net, wrapped first
    parallelize_module(model.module, mesh["TP"], TP_PLAN)
    x, _ = batch(0, 0)
    model(x)


class _Experts(nn.Module):
    """A dense layer and this EP rank's 2 of 4 experts, keyed by their global numbers (the GPT example's way)."""

    def __init__(self, ep_rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dense = nn.Linear(4, 4)
        self.experts = nn.ModuleDict({str(2 * ep_rank + i): nn.Linear(4, 4) for i in range(2)})

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.dense(x)
        return sum(e(x) for e in self.experts.values())


def _clip_without_expert_parameters() -> None:
    model = _Experts(mesh.lookup_rank("EP"))
    ddp = DDP(model, mesh["DP"], expert_data_parallel=mesh["EDP"], expert_parameters=list(model.experts.parameters()))
    ddp(torch.ones(2, 4)).sum().backward()
    clip_grad_norm_(ddp.parameters(), 1.0)  # expert_parameters forgotten: each rank would take its experts for all


def _mixed_clip_norm() -> dict[str, float]:
    """vemesh's clip on a TP model whose LayerNorm stays a plain tensor (torch's raises there): the one-process norm."""
    model = tp_model(mesh["TP"])
    x, y = batch(0, 0)
    F.mse_loss(model(x), y).backward()
    norm = float(clip_grad_norm_(model.parameters(), 1e9))
    ref = make_net()
    F.mse_loss(ref(x), y).backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9)
        torch_says = "accepted"
    except Exception as e:  # noqa: BLE001
        torch_says = str(e).splitlines()[0]
    return {"norm": norm, "ref": float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)), "torch": torch_says}


def worker(rank: int, world_size: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    mesh.init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    out["ddp-default-group"] = _outcome(_default_group_trains_as_one_process)
    out["ddp-world-with-tp"] = _outcome(lambda: DDP(tp_model(mesh["TP"]), dist.group.WORLD))
    out["ddp-tp-as-dp"] = _outcome(lambda: DDP(tp_model(mesh["TP"]), mesh["TP"]))
    out["ddp-before-tp"] = _outcome(_wrapped_before_tp)
    out["vemesh-clip-mixed"] = _outcome(_mixed_clip_norm)
    mesh.flatten(("DP", "TP"), "everyone")
    out["fsdp2-view-with-tp"] = _outcome(lambda: fully_shard(tp_model(mesh["TP"]), mesh=mesh["everyone"]))

    # experts: DP = 4 folded as (EDP, EP) = (2, 2); each EP rank holds other experts under other names
    mesh.init_device_mesh("cpu", (4,), mesh_dim_names=("DP",))
    mesh.flatten(("DP",), "dp_ep")
    mesh.split("dp_ep", ("EDP", "EP"), (2, 2))
    out["experts-in-dp"] = _outcome(lambda: DDP(_Experts(mesh.lookup_rank("EP")), mesh["DP"]))
    out["clip-experts-missing"] = _outcome(_clip_without_expert_parameters)

    # no vemesh mesh at all: torch's own mesh and TP, and DDP(model) takes torch's default group
    mesh.reset()
    torch_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("DP", "TP"))
    out["ddp-no-mesh-world"] = _outcome(lambda: DDP(tp_model(torch_mesh["TP"])))
    return out
