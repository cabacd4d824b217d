"""The GPT example's evaluation and end of run: the held-out loss, the memory report, a text sample."""
from __future__ import annotations

import time

import torch

from data import decode, encode
from job import Job, Loop, dp_mean, loss_fn, print0
from pipeline import generate, to_rank0
from vemesh import VESCALE_DEVICE_MESH

SAMPLE_PROMPT = "def "


@torch.no_grad()
def evaluate(job: Job) -> float | None:
    """Mean loss over ``cfg.eval_batches`` fixed global batches of the held-out split, on global rank 0."""
    cfg = job.cfg
    forward = job.parts[0] if job.pipe is None else job.pipe.forward  # without the DDP wrapper
    for c in job.chunks:
        c.eval()
    losses = []
    for i in range(cfg.eval_batches):
        x, y = job.dataset.get_batch("val", step=i, seed=cfg.seed, global_batch_size=cfg.global_batch_size,
                                     seq_len=cfg.seq_len, dp_rank=job.dp_rank, dp_size=job.dp_size)
        x, y = x.to(job.device), y.to(job.device)
        with job.cp(x, y):
            logits = forward(x)  # None on a pipeline rank without the last stage
            if logits is not None:
                losses.append(loss_fn(logits, y))
    for c in job.chunks:
        c.train()
    loss = dp_mean(torch.stack(losses).mean(), job.dp_group) if losses else None
    return to_rank0(loss if loss is None else torch.tensor(loss), job.last_pp)


def finish(job: Job, loop: Loop) -> None:
    """After the last step: the memory report, a text sample (whole sequences, outside CP), the time."""
    cfg = job.cfg
    if job.meter is not None:  # each rank's peak and bytes, by PP rank (the planner's rank classes)
        from vemesh.planning.measure import report
        text = report(job.meter, VESCALE_DEVICE_MESH, f"PP rank {VESCALE_DEVICE_MESH.lookup_rank('PP')}"
                      if job.dims.pp > 1 else "every rank", cfg.memory_report)
        print0(f"{text}\nwritten to {cfg.memory_report}")
    if cfg.sample_tokens:  # every rank runs the (sharded) model in lockstep and draws the same tokens
        prompt = encode(SAMPLE_PROMPT).unsqueeze(0).to(job.device)  # (1, T)
        gen = torch.Generator(device=job.device).manual_seed(cfg.seed)
        for c in job.chunks:
            c.eval()
        if job.pipe is None:
            out = job.parts[0].generate(prompt, cfg.sample_tokens, generator=gen)
        else:  # a token at a time through the stages, to the rank of the next stage
            out = generate(job.pipe, prompt, cfg.sample_tokens, cfg.seq_len, generator=gen)
        print0(f"sample after {cfg.steps} steps:\n{'-' * 60}\n{decode(out[0].tolist())}\n{'-' * 60}")
    print0(f"done in {time.perf_counter() - loop.t_start:.1f}s")
