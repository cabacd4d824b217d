"""What each gloo rank does in test_ring_attention.py: ring attention against one process's SDPA."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from vemesh import VeDeviceMesh
from vemesh.parallel.context import positions, ring_attention, shard_sequence

B, H, T, D = 2, 3, 32, 8


def _full(seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, T, D, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(4))
    return q, k, v, dout


def compare(rank: int, world: int, device: str = "cpu") -> dict:
    """Max errors of output and q/k/v gradients, for CP = world and CP = 2 (on a (2, 2) DP x CP mesh).

    On CUDA the tensors are bf16 (torch's CUDA flash attention takes half precision only), and the
    ranks share the one GPU over gloo.
    """
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    out = {}
    for name, shape, names in (("cp4", (world,), ("CP",)), ("cp2", (2, 2), ("DP", "CP"))):
        mesh = VeDeviceMesh()
        mesh.init_device_mesh("cpu", shape, mesh_dim_names=names)  # gloo groups; the tensors may live on CUDA
        cp, r = mesh.get_strategy_size("CP"), mesh.lookup_rank("CP")
        cases = [(False, "alltoall"), (True, "alltoall")] + ([(True, "allgather")] if device == "cpu" else [])
        # allgather of CUDA tensors over gloo is refused (it crashes in torch); an encoder's attention (not causal)
        # on a sequence cut contiguously and head-tail: every query reads every key, in any order
        for balance, rotate, causal in [(b, r, True) for b, r in cases] + [(b, r, False) for b, r in cases]:
            q, k, v, dout = _full(7 + mesh.lookup_rank("DP"), device, dtype)
            ref = [t.clone().requires_grad_() for t in (q, k, v)]
            F.scaled_dot_product_attention(*ref, is_causal=causal).backward(dout)
            ref_out = F.scaled_dot_product_attention(*ref, is_causal=causal).detach()
            mine = [shard_sequence(t, r, cp, dim=2, load_balance=balance).clone().requires_grad_() for t in (q, k, v)]
            y = ring_attention(*mine, mesh["CP"], load_balance=balance, rotate=rotate, causal=causal)
            y.backward(shard_sequence(dout, r, cp, dim=2, load_balance=balance))
            cut = lambda t: shard_sequence(t, r, cp, dim=2, load_balance=balance)  # noqa: E731
            errors = [(y - cut(ref_out)).float().abs().max().item()]
            errors += [(m.grad - cut(t.grad)).float().abs().max().item() for m, t in zip(mine, ref)]
            out[f"{name}{'-balanced' if balance else ''}-{rotate}{'' if causal else '-not-causal'}"] = max(errors)
            out[f"{name}-positions{'-balanced' if balance else ''}"] = positions(T, r, cp, load_balance=balance).tolist()
        if device == "cuda":
            try:
                ring_attention(*mine, mesh["CP"], rotate="allgather")
            except ValueError as e:
                out["allgather-refused"] = str(e)
        mesh.reset()
    return out
