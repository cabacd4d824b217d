"""Replicas over TP whose gradient is each TP rank's own part: the check vemesh's DDP and FSDP2 make once.

A parameter that TP leaves whole (a plain tensor under DDP; under FSDP2, one sharded over the data dims only) is a
replica over the TP group: torch's TP styles leave it alone, and nothing sums its gradient over TP. When the
computation that uses it sees only this TP rank's part of the activations (a norm over each rank's own heads, a
norm of a sequence-parallel region left unstyled), its gradient is this rank's part only, each TP rank steps it
differently, and the replicas drift apart without a word (as they do when the TP ranks are given different inputs).
:func:`check_tp_gradients` compares, over the TP group, each such parameter's values and gradient (their sums and
sums of squares, in fp64): the same values but not the same gradient raises, on every rank. Parameters whose values
differ across TP (a user's own TP slices) are left out. At the same moment :func:`warn_unwaited` warns where a
functional collective of the step was never waited on (a leak that grows every step).
"""

from __future__ import annotations

import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from vemesh.mesh import VESCALE_DEVICE_MESH as mesh

__all__ = ["TPReplicaError", "check_tp_gradients", "tp_group_beside", "warn_unwaited"]


class TPReplicaError(RuntimeError):
    """A replica over TP has the same values on every TP rank but not the same gradient; :attr:`names` are this
    rank's replicas that differ (empty where only another TP group's did)."""

    def __init__(self, message: str, names: list[str] | None = None) -> None:
        super().__init__(message)
        self.names = list(names or [])


#: False in a process of ``vemesh check``'s run that compares every gradient with one process instead (its replicas'
#: gradients then reach the comparison, where a wrapper's check would stop the run first)
CHECKING = True


def tp_group_beside(data_ranks: set[int]) -> dist.ProcessGroup | None:
    """The live mesh's TP group when it has more than one rank and shares none but this one with ``data_ranks``;
    None otherwise (no mesh, no TP, TP of 1, the fake backend, :data:`CHECKING` off)."""
    if not CHECKING or not (mesh.is_initialized() and mesh.layout.has("TP")) or mesh.get_strategy_size("TP") == 1:
        return None
    tp = mesh.get_group("TP")
    if dist.get_backend(tp) == "fake" or set(dist.get_process_group_ranks(tp)) & (data_ranks - {dist.get_rank()}):
        return None
    return tp


#: whether :func:`warn_unwaited` has warned in this process (it warns once)
_WARNED: list[bool] = []


def warn_unwaited() -> None:
    """Warn, once a process, where torch's functional collectives issued so far were never waited on (by the
    first optimizer step every one a step issues has been read). torch's work registry holds each such output
    until it is waited on, which it never is, so the run's memory grows by them every step."""
    waiting = torch._C._distributed_c10d._get_work_registry_size()
    if waiting == 0 or _WARNED:
        return
    _WARNED.append(True)
    warnings.warn(
        f"vemesh: MEMORY LEAK: {waiting} collective{'s' if waiting > 1 else ''} issued in this step "
        f"{'were' if waiting > 1 else 'was'} never waited on, and torch's work registry holds each until it is, so "
        "memory grows every step until the run fails. Likeliest: a TP collective that activation checkpointing's "
        "recompute issues before the last tensor the backward needs, whose result is read only after it "
        "(torch.utils.checkpoint stops there; pytorch/torchtitan issue 2763), as in a block whose attention and MLP "
        "run side by side. Recompute whole blocks: checkpoint(..., use_reentrant=False, early_stop=False) (Hugging "
        "Face: gradient_checkpointing_kwargs={'use_reentrant': False, 'early_stop': False}); `vemesh plan` says the "
        "bytes",
        RuntimeWarning)


@torch.no_grad()
def inputs_fingerprint(inputs: object, seen: torch.Tensor | None = None) -> torch.Tensor:
    """``seen`` plus the sum and the sum of squares of every tensor in ``inputs`` (a forward's arguments), summed in
    fp64 on the tensor's device and kept on the CPU: equal on TP ranks given the same batch. A DTensor counts where it
    is replicated (a sharded one, a sequence-parallel input, differs by rank by design); ``check_tp_gradients``
    reads it only to name a cause."""
    out = torch.zeros(2, dtype=torch.float64) if seen is None else seen
    for t in torch.utils._pytree.tree_leaves(inputs):
        if isinstance(t, torch.Tensor) and not t.is_meta:
            if isinstance(t, DTensor) and not all(p.is_replicate() for p in t.placements):
                continue
            local = (t.to_local() if isinstance(t, DTensor) else t).detach()
            local = (local.abs() if local.is_complex() else local).float()
            out = out + torch.stack([local.sum(dtype=torch.float64), local.square().sum(dtype=torch.float64)]).cpu()
    return out


@torch.no_grad()
def check_tp_gradients(entries: list[tuple[str, torch.Tensor, torch.Tensor | None]], tp: dist.ProcessGroup,
                       data: list[dist.ProcessGroup], opt_out: str, rtol: float = 1e-3,
                       inputs: torch.Tensor | None = None) -> None:
    """Raise on every rank when a replica over ``tp`` has the same values on every TP rank but not the same gradient.

    Args:
        entries: ``(name, this rank's values, this rank's gradient)`` of each replica over TP (None: no gradient).
        data: the data groups the verdict is agreed over too, so that no rank goes on alone.
        opt_out: how to turn the check off, for the error.
        inputs: the forwards' inputs since the start, :func:`inputs_fingerprint` (None: not seen): which says whether
            the TP ranks were given the same batches.
    """
    warn_unwaited()
    # on the groups' device (nccl takes CUDA tensors only), one row per entry on every rank whatever its gradient
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(tp) == "nccl" else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.float64, device=device)

    def sums(t: torch.Tensor | None) -> list[torch.Tensor]:
        if t is None:  # no gradient: zeros, which differ from a peer's gradient if it has one
            return [zero, zero]
        t = t.detach().to(device=device, dtype=torch.float64)
        return [t.sum(), t.square().sum()]

    seen = torch.zeros(2, dtype=torch.float64) if inputs is None else inputs
    # the last row: the inputs' fingerprint (and whether it was taken), the same shape on every rank
    stats = torch.stack([torch.stack(sums(v) + sums(g)) for _, v, g in entries] +
                        [torch.cat([seen, torch.tensor([float(inputs is not None), 0.0], dtype=torch.float64)]).to(device)])
    everyone = [torch.empty_like(stats) for _ in range(dist.get_world_size(tp))]
    dist.all_gather(everyone, stats, group=tp)
    everyone = [e.cpu() for e in everyone]
    bad, agreed = [], 0  # the replicas whose gradients differ across TP, and how many others agree
    for i, (name, _, _) in enumerate(entries):
        rows = torch.stack([e[i] for e in everyone])
        values, grads = rows[:, :2], rows[:, 2:]
        scale = rtol * grads[0, 1].abs().sqrt().item()
        if not torch.allclose(values, values[0].expand_as(values), rtol=1e-6, atol=1e-12):
            continue  # a user's own TP slices
        if not torch.allclose(grads, grads[0].expand_as(grads), rtol=rtol, atol=1e-12 + scale):
            bad.append(name)
        elif grads.abs().sum():
            agreed += 1
    verdict = torch.tensor([float(len(bad))], device=device)
    for group in data:
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX, group=group)
    if verdict.item():
        names = ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "") if bad else \
            "(on another TP group of the data ranks)"
        batches = ("the TP ranks were given different batches; every TP rank of a DP rank must see the same one "
                   "(seed the data by the DP rank, not the global rank).\n")
        partial = ("the module's input is this rank's part only (a norm over its own heads, or between sequence-"
                   "parallel regions): give it SequenceParallel; or an output of a replicated module reaches this "
                   "rank's heads outside the TP styles (DeepSeek-V3's k_pe): give it vemesh.parallel.SumGradOverTP; "
                   "`vemesh check` names the module and tries both.\n")
        fingerprints = torch.stack([e[-1] for e in everyone])
        taken = bool(fingerprints[:, 2].all())  # every TP rank summed its inputs
        if taken and not torch.allclose(fingerprints[:, :2], fingerprints[0, :2].expand(len(everyone), 2), rtol=1e-6,
                                        atol=1e-12):
            causes = ("The cause: the TP ranks were given different batches (the wrapped model's forward got other inputs "
                      "on each); every TP rank of a DP rank must see the same one: sample and seed the data by the DP "
                      "rank, not the global rank (torch's DistributedSampler takes the world's unless given "
                      "num_replicas=mesh['DP'].size(), rank=mesh.get_local_rank('DP')).\n")
        elif taken or (agreed and bad):  # the TP ranks saw the same batch
            why = "its forward got the same inputs on each TP rank" if taken else \
                f"the other {agreed} replicas' gradients agree across TP"
            causes = f"Likeliest: {partial}(The TP ranks saw the same batch: {why}.)\n"
        else:
            causes = f"Likeliest: {batches}Else {partial}"
        raise TPReplicaError(
            f"the gradient of {names} differs across the TP ranks {dist.get_process_group_ranks(tp)}, while the "
            "parameter is the same on each.\n"
            + causes
            + "Details: such a replica over TP is a plain tensor (or one sharded over the data dims only), and nothing "
            "sums its gradient over TP, so each TP rank would step it with its own part and the replicas drift apart. "
            "Make it a replicated DTensor whose gradient torch sums over TP: SequenceParallel(sequence_dim=...) on the "
            "module (as torchtitan shards Qwen3's q/k norms). If the parameter is meant to differ by TP rank, "
            f"{opt_out}", bad)
