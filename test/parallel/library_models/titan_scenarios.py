"""What each rank runs in test_torchtitan_models.py: torchtitan's own ``MoE`` module (the ``torchtitan`` package,
pinned by the ``titan`` extra), unchanged, in a user's own training loop (``test/models/titan_jobs.py``'s model),
parallelized with vemesh and torch APIs only, trained 3 steps, and compared with one process on the global batch.

The loop keeps torchtitan's auxiliary-loss-free load balancing as its trainer does (an optimizer-step pre-hook there):
the routed-token counts are summed over the data ranks, and each expert's bias moves by ``coeff * sign(mean - count)``.
"""

from __future__ import annotations

import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "models"))
import parity  # noqa: E402
import titan_jobs  # noqa: E402

from vemesh import VESCALE_DEVICE_MESH as mesh  # noqa: E402
from vemesh.parallel import ParallelDims  # noqa: E402

STEPS, BATCH, LR, EPS = 3, 4, 1e-3, 1e-6
TINY = dict(vocab=128, dim=32, hidden=16, experts=4, top_k=2, n_layers=2, seq=16)

# torchtitan's router computes its gate under a float32 CPU autocast, which torch warns about on every forward
warnings.filterwarnings("ignore", message=".*autocast.*")


def make(precision: str) -> titan_jobs.TitanMoELM:
    """The model, the same on every rank (one seed), its experts in ``precision`` (see ``titan_jobs.experts_in``)."""
    torch.manual_seed(0)
    model = titan_jobs.TitanMoELM(**TINY)
    titan_jobs.experts_in(model, precision)
    return model


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, TINY["vocab"], (BATCH, TINY["seq"] + 1), generator=torch.Generator().manual_seed(100 + step))
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), y.reshape(-1))


def state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, whole, and each MoE's load-balancing bias (a buffer the balance moved)."""
    out = parity.whole_params(model)
    inner = model.module if hasattr(model, "module") else model
    for i, layer in enumerate(titan_jobs.blocks(inner)):
        out[f"layers.{i}.moe.expert_bias_E"] = layer.moe.expert_bias_E.detach().clone()
    return out


def reference(precision: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make(precision)
    losses = parity.one_process(model, (batch(step) for step in range(STEPS)), loss_of,
                                lambda m: titan_jobs.balance_experts(m, None), lr=LR, eps=EPS)
    return losses, state(model)


def train(dims: ParallelDims, precision: str, wrap: str, optimizer: str) -> dict[str, Any]:
    dims.build("cpu", mesh)
    model = make(precision)
    titan_jobs.expert_parallel(model, mesh)  # the documented call: vemesh's styles on torchtitan's grouped experts
    inner = model
    model = parity.wrap(model, list(model.layers), wrap)
    opt = parity.optimizer(model, optimizer, lr=LR, eps=EPS)
    losses = parity.data_parallel_steps(model, opt, mesh, dims, batch, loss_of, STEPS,
                                        lambda data: titan_jobs.balance_experts(inner, data))
    params = state(model)
    mesh.reset()
    return {"losses": losses, "params": params}


CASES = {  # name: (degrees, the experts' precision, wrapper, optimizer)
    "titan-moe-ep2-ddp": (dict(ep=2), "fp32", "ddp", "adamw"),
    "titan-moe-ep2-zero1": (dict(ep=2), "fp32", "ddp", "zero1"),
    "titan-moe-ep2-fsdp2": (dict(ep=2), "fp32", "fsdp", "adamw"),
    "titan-moe-ep2-tp2-ddp": (dict(ep=2, tp=2), "fp32", "ddp", "adamw"),
    "titan-moe-ep2-ddp-bf16": (dict(ep=2), "bf16", "ddp", "adamw"),
    "titan-moe-ep2-ddp-fp32-seam": (dict(ep=2), "fp32-seam", "ddp", "adamw"),
}


def worker(rank: int, world_size: int, cases: dict[str, tuple]) -> dict[str, Any]:
    refs = {precision: reference(precision) for precision in {c[1] for c in cases.values()}}
    out: dict[str, Any] = {}
    for name, (degrees, precision, wrap, optimizer) in cases.items():
        try:
            out[name] = parity.compare(train(ParallelDims(world_size, **degrees), precision, wrap, optimizer),
                                       refs[precision])
        except Exception:  # noqa: BLE001 - reported back to pytest
            out[name] = {"error": traceback.format_exc()}
            mesh.reset()
    return out


# ---- torchtitan's Llama3 (titan_jobs.make_llama3: its debugmodel, the SDPA attention torchtitan ships) ----------

LLAMA3_SEQ = 32
LLAMA3_CASES = {  # name: (degrees, wrapper, optimizer); TP by torchtitan's module names (titan_jobs.LLAMA3_TP)
    "titan-llama3-tp2-fsdp2": (dict(tp=2), "fsdp", "adamw"),
    "titan-llama3-tp2-zero1": (dict(tp=2), "ddp", "zero1"),
}


def llama3_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens = torch.randint(0, 2048, (BATCH, LLAMA3_SEQ + 1), generator=torch.Generator().manual_seed(200 + step))
    return tokens[:, :-1], tokens[:, 1:]


def _decoder_train(dims: ParallelDims, wrap: str, optimizer: str, kind: str) -> dict[str, Any]:
    """torchtitan's decoder ``kind`` (``DECODERS``) parallelized on ``dims``, trained on this DP rank's rows."""
    make, parallel, eps, moe = DECODERS[kind]
    dims.build("cpu", mesh)
    model = make()
    parallel(model, mesh)
    inner = model
    model = parity.wrap(model, titan_jobs.blocks(model), wrap)
    opt = parity.optimizer(model, optimizer, lr=LR, eps=eps)
    balance = (lambda data: titan_jobs.balance_experts(inner, data)) if moe else None
    losses = parity.data_parallel_steps(model, opt, mesh, dims, llama3_batch, loss_of, STEPS, balance)
    params = state(model) if moe else parity.whole_params(model)
    mesh.reset()
    return {"losses": losses, "params": params}


def _decoder_worker(rank: int, world_size: int, cases: dict[str, tuple], kind: str) -> dict[str, Any]:
    make, _, eps, moe = DECODERS[kind]
    model = make()
    balance = (lambda m: titan_jobs.balance_experts(m, None)) if moe else None
    ref = (parity.one_process(model, (llama3_batch(s) for s in range(STEPS)), loss_of, balance, lr=LR, eps=eps),
           state(model) if moe else parity.whole_params(model))
    out: dict[str, Any] = {}
    for name, (degrees, wrap, optimizer) in cases.items():
        try:
            out[name] = parity.compare(_decoder_train(ParallelDims(world_size, **degrees), wrap, optimizer, kind), ref)
        except Exception:  # noqa: BLE001 - reported back to pytest
            out[name] = {"error": traceback.format_exc()}
            mesh.reset()
    return out


def llama3_worker(rank: int, world_size: int, cases: dict[str, tuple]) -> dict[str, Any]:
    return _decoder_worker(rank, world_size, cases, "llama3")


# ---- torchtitan's Qwen3 MoE model, whole (titan_jobs.make_qwen3_moe: its debugmodel_moe, 2 blocks of 8 experts) ----

QWEN3_CASES = {  # name: (degrees, wrapper, optimizer); attention TP by torchtitan's module names (titan_jobs.QWEN3_TP)
    "titan-qwen3-moe-ep2-fsdp2": (dict(ep=2), "fsdp", "adamw"),
    "titan-qwen3-moe-ep2-tp2-zero1": (dict(ep=2, tp=2), "ddp", "zero1"),
}


#: AdamW's eps for the Qwen3 cases. Its step is lr * g / (|g| + eps): at 1e-6 the token embedding's rows that one or
#: two tokens reach, whose gradients are near eps, turn the reduction's rounding into 3.5e-5 of difference after 3
#: steps (every other parameter within 5e-6); at 1e-4 every parameter is within 2.5e-7, the gradients the same.
QWEN3_EPS = 1e-4


def qwen3_model() -> nn.Module:
    model = titan_jobs.make_qwen3_moe()
    titan_jobs.experts_in(model, "fp32")  # the experts in fp32: the 1e-5 comparison (bf16's is the MoE cases')
    return model


def qwen3_worker(rank: int, world_size: int, cases: dict[str, tuple]) -> dict[str, Any]:
    return _decoder_worker(rank, world_size, cases, "qwen3")


#: torchtitan's decoders: name -> (factory, parallelize on the mesh (TP, EP), AdamW's eps, whether it is a MoE)
DECODERS = {"llama3": (titan_jobs.make_llama3, titan_jobs._llama3_tp, EPS, False),
            "qwen3": (qwen3_model, titan_jobs._qwen3_model_parallel, QWEN3_EPS, True)}
