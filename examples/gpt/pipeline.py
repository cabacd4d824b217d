"""Pipeline parallelism for the GPT example: this rank's stages (``vemesh.models.gpt.stages`` cuts them), run by
torch's engine (``torch.distributed.pipelining``) on the group of ``VESCALE_DEVICE_MESH["PP"]``; nothing here
schedules micro-batches itself. Where a rank must find another (the next stage, the rank that holds the
loss), it asks the mesh: ``get_global_rank({"PP": owner})``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from vemesh import VESCALE_DEVICE_MESH
from vemesh.models.gpt.model import sample_next
from vemesh.parallel.schedules import MULTI_STAGE, run_schedule, schedule_class, stage_owner, stages_per_rank


class Pipeline:
    """This rank's pipeline stages and the torch schedule that runs them, over ``VESCALE_DEVICE_MESH["PP"]``.

    Args:
        chunks: this rank's stage modules (wrapped in DDP), in the order of ``indices``.
        indices: their stage numbers (:func:`stage_indices`).
        n_stages: stages in the whole pipeline.
        schedule: a key of :data:`vemesh.parallel.schedules.SCHEDULES`.
        n_microbatches: micro-batches per step (each DP rank's batch splits into this many).
        loss_fn: ``loss_fn(logits, targets)``, the mean over one micro-batch.
        device: this rank's device.
    """

    def __init__(self, chunks: list[nn.Module], indices: list[int], n_stages: int, schedule: str,
                 n_microbatches: int, loss_fn, device: torch.device) -> None:
        self.chunks, self.indices, self.n_stages, self.schedule_name = chunks, indices, n_stages, schedule
        self.pp_group = VESCALE_DEVICE_MESH["PP"].get_group()
        from torch.distributed import pipelining  # here, not at the top: see schedule_class
        self.stages = [pipelining.PipelineStage(c, i, n_stages, device, group=self.pp_group)
                       for c, i in zip(chunks, indices)]
        stages = self.stages if schedule in MULTI_STAGE else self.stages[0]
        self.schedule = schedule_class(schedule)(stages, n_microbatches, loss_fn=loss_fn)
        self.has_first, self.has_last = 0 in indices, n_stages - 1 in indices
        self.last_pp = self.owner(n_stages - 1)  # the PP rank that computes the loss

    def owner(self, stage: int) -> int:
        """The PP rank holding ``stage``."""
        return stage_owner(stage, VESCALE_DEVICE_MESH.get_strategy_size("PP"), self.schedule_name)

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        """Forward and backward of one batch through every stage; the mean micro-batch loss on the last stage."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = {"target": y, "losses": losses} if self.has_last else {}
        # the losses are enough: no logits kept
        run_schedule(self.schedule, self.schedule_name, self.chunks, *args, **kwargs, return_outputs=False)
        return torch.stack(losses).mean() if self.has_last else None

    @torch.no_grad()
    def forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """Run ``x`` through every stage, in stage order, without the schedule (for eval and sampling).

        Activations go to the rank of the next stage's owner, ``get_global_rank({"PP": owner})``;
        where one rank holds two consecutive stages (the tip of a V) they stay on it. Returns the
        logits on the rank holding the last stage, None elsewhere.
        """
        mine = dict(zip(self.indices, self.chunks))
        out = None
        for s in range(self.n_stages):
            if s not in mine:
                continue
            if s == 0:
                h = x
            elif s - 1 in mine:
                h = out
            else:
                h = _recv(VESCALE_DEVICE_MESH.get_global_rank({"PP": self.owner(s - 1)}), x.device)
            out = mine[s](h)
            if s < self.n_stages - 1 and s + 1 not in mine:
                _send(out, VESCALE_DEVICE_MESH.get_global_rank({"PP": self.owner(s + 1)}))
        return out if self.has_last else None


_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _send(t: torch.Tensor, dst: int) -> None:
    t = t.contiguous()  # the shape first: (B, T, C), or (B, T/tp, C) under sequence parallelism
    dist.send(torch.tensor([*t.shape, _DTYPES.index(t.dtype)], dtype=torch.long), dst=dst)
    dist.send(t, dst=dst)


def _recv(src: int, device: torch.device) -> torch.Tensor:
    header = torch.zeros(4, dtype=torch.long)
    dist.recv(header, src=src)
    *shape, dtype = header.tolist()
    t = torch.empty(shape, dtype=_DTYPES[dtype], device=device)
    dist.recv(t, src=src)
    return t


def layout_line(stages: list[int], schedule: str) -> str:
    """This rank's place in the pipeline, from the mesh: its stages, where each one's next stage
    lives, and the TP submesh of the next PP rank."""
    pp, stage = VESCALE_DEVICE_MESH.get_strategy_size("PP"), VESCALE_DEVICE_MESH.lookup_rank("PP")
    n_stages = pp * stages_per_rank(schedule)
    nxt_tp = VESCALE_DEVICE_MESH.get_neighbor_submesh("TP", along="PP") if VESCALE_DEVICE_MESH.layout.has("TP") else None
    held = []
    for s in stages:
        nxt = "-" if s == n_stages - 1 else VESCALE_DEVICE_MESH.get_global_rank({"PP": stage_owner(s + 1, pp, schedule)})
        held.append(f"stage {s} (next stage on rank {nxt})")
    return (f"rank {dist.get_rank()}: PP rank {stage} of {pp}: {', '.join(held)}; next PP rank's TP submesh "
            f"{'-' if nxt_tp is None else nxt_tp.mesh.tolist()}")


def to_rank0(value: torch.Tensor | None, last_pp: int | None = None) -> float | None:
    """A scalar known on the last stage, delivered to global rank 0 (the others get None).

    ``last_pp`` is the PP rank of the last stage (default PP - 1; PP rank 0 in a V). The sender is
    rank 0's counterpart there, ``get_global_rank({"PP": last_pp})`` with the other coordinates 0.
    """
    rank = dist.get_rank()
    pp = VESCALE_DEVICE_MESH.get_strategy_size("PP")
    last = pp - 1 if last_pp is None else last_pp
    if pp == 1:  # no pipeline: rank 0 computed it
        return None if rank or value is None else float(value)
    src = VESCALE_DEVICE_MESH.get_global_rank({n: (last if n == "PP" else 0) for n in VESCALE_DEVICE_MESH.mesh_dim_names})
    if rank == src == 0:
        return float(value)
    if rank == src:
        dist.send(value.detach().float().reshape(()), dst=0)
    elif rank == 0:
        buf = torch.zeros((), dtype=torch.float32)
        dist.recv(buf, src=src)
        return buf.item()
    return None


@torch.no_grad()
def generate(pipe: Pipeline, idx: torch.Tensor, max_new_tokens: int, block_size: int,
             generator: torch.Generator) -> torch.Tensor:
    """``GPT.generate`` through the pipeline: each new token is drawn on the last stage and sent to every stage."""
    for _ in range(max_new_tokens):
        idx_cond = idx[:, -block_size:]
        t = idx_cond.size(1)
        logits = pipe.forward(torch.nn.functional.pad(idx_cond, (0, block_size - t)))  # (B, block_size, V) on the last stage
        nxt = torch.zeros(idx.size(0), 1, dtype=torch.long, device=idx.device)
        if logits is not None:
            nxt = sample_next(logits[:, t - 1, :], generator=generator)
        # every stage needs the token for the next round: the last stage's PP rank shares it
        dist.broadcast(nxt, group=pipe.pp_group, group_src=pipe.last_pp)
        idx = torch.cat((idx, nxt), dim=1)
    return idx
