"""Context-parallel benchmark: attention memory per rank for CP = 1, 2, 4, and a GPT step at CP=2 against CP=1.

Run (ranks spawned by the script; BENCHMARKS.md's "Context parallelism" figures come from it):

    OMP_NUM_THREADS=1 python bench/context_parallel.py --json bench/results/context_parallel.json
    python bench/context_parallel.py --quick      # smoke run on CP 1 and 2 only (a test runs it)

**Memory.** On 4 gloo ranks, mesh ``(DP, CP) = (4 / CP, CP)``: each rank runs one causal
attention (B=1, H=4, head_dim=64) forward and backward on its ``seq / CP`` tokens, with
``vemesh.parallel.context.ring_attention`` (torch's ring attention, keys and values passed
round the ring) for CP > 1 and torch's SDPA for CP = 1. The figure is the peak of torch's
``MemTracker`` (``torch.distributed._tools.mem_tracker``: every tensor the ops allocate,
activations and temporaries, the inputs counted too), the largest over the ranks. The target is
about ``1/CP`` of the CP=1 peak.

**Step time.** On 2 ranks, the GPT preset (``vemesh.models.gpt``) on the same global batch: CP=1 is
``(DP=2)`` (each rank a whole sequence of half the rows), CP=2 is ``(CP=2)`` (each rank half of every
sequence inside ``vemesh.parallel.context_parallel``, ring attention). Both average gradients with
vemesh's DDP at its defaults and step AdamW. Steps
of the two are interleaved (the order rotates every round, a step's time is the slower rank's),
and the ratio is the median over rounds of CP=2 / CP=1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from two_ranks import run_on_ranks  # noqa: E402

from vemesh import VeDeviceMesh  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.models.gpt import GPT, GPTConfig  # noqa: E402
from vemesh.parallel import ParallelDims, context_parallel  # noqa: E402
from vemesh.parallel.context import ring_attention, shard_sequence  # noqa: E402


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


HEADS, HEAD_DIM = 4, 64


def attention_peak(seq_lens: list[int], cps: list[int]) -> dict[str, int]:
    """Peak MemTracker bytes of one attention forward + backward, per (seq, CP, sharding), max over the ranks."""
    from torch.distributed._tools.mem_tracker import MemTracker

    out = {}
    world = dist.get_world_size()
    for seq in seq_lens:
        for cp, balance in [(c, b) for c in cps for b in ((True, False) if c > 1 else (False,))]:
            mesh = VeDeviceMesh()
            mesh.init_device_mesh("cpu", (world // cp, cp), mesh_dim_names=("DP", "CP"))
            g = torch.Generator().manual_seed(seq)
            full = [torch.randn(1, HEADS, seq, HEAD_DIM, generator=g) for _ in range(4)]
            q, k, v, dout = (shard_sequence(t, mesh.lookup_rank("CP"), cp, dim=2, load_balance=balance) for t in full)
            q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
            del full
            tracker = MemTracker()
            tracker.track_external(q, k, v, dout)
            with tracker:
                y = ring_attention(q, k, v, mesh["CP"], load_balance=balance)
                y.backward(dout)
                del y
            peak = torch.tensor([float(tracker.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"])])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
            out[f"seq{seq}_cp{cp}{'_balanced' if balance else ''}"] = int(peak.item())
            mesh.reset()
    return out


def step_times(seq: int, rounds: int, warmup: int) -> dict[str, float]:
    """Median CP=2 / CP=1 GPT step time on 2 ranks, interleaved."""
    contenders = {}
    for cp in (1, 2):
        dims = ParallelDims(2, cp=cp, mesh_dims=("DP", "CP"))
        mesh = dims.build("cpu", VeDeviceMesh())
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=seq, n_layer=2, n_head=HEADS, n_embd=HEADS * HEAD_DIM))
        ddp = DDP(model, mesh[dims.grad_dim])  # DP, or dp_cp
        contenders[cp] = (mesh, ddp, torch.optim.AdamW(ddp.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (2, seq + 1), generator=g)
    times: dict[int, list[float]] = {1: [], 2: []}
    for r in range(warmup + rounds):
        for cp in ((1, 2) if r % 2 == 0 else (2, 1)):
            mesh, ddp, opt = contenders[cp]
            rows = x[mesh.lookup_rank("DP")::mesh.get_strategy_size("DP")]
            inp, tgt = rows[:, :-1].clone(), rows[:, 1:].clone()
            context = context_parallel(mesh["CP"], buffers=[inp, tgt, ddp.module.pos],
                                       buffer_seq_dims=[1, 1, 0]) if cp > 1 else contextlib.nullcontext()
            dist.barrier()
            t0 = time.perf_counter()
            with context:
                opt.zero_grad()
                loss_fn(ddp(inp), tgt).backward()
                opt.step()
            spent = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            if r >= warmup:
                times[cp].append(spent.item())
    ratios = [b / a for a, b in zip(times[1], times[2])]
    return {"seq": seq, "cp1_s": statistics.median(times[1]), "cp2_s": statistics.median(times[2]),
            "ratio_cp2_over_cp1": statistics.median(ratios)}


def _memory_worker(seq_lens, cps):
    return attention_peak(seq_lens, cps)


def _step_worker(seq, rounds, warmup):
    return step_times(seq, rounds, warmup)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few rounds (the smoke test)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    seq_lens, rounds, step_seq, cps = ([256], 2, 256, [1, 2]) if args.quick else ([1024, 2048], 15, 1024, [1, 2, 4])
    memory = run_on_ranks(max(cps), _memory_worker, seq_lens, cps)
    steps = run_on_ranks(2, _step_worker, step_seq, rounds, 2)
    print("attention forward + backward, peak MemTracker bytes per rank (largest rank), B=1 H=4 head_dim=64:")
    print(f"  {'seq':>6} {'CP':>3} {'sharding':>11} {'peak MiB':>9} {'/ CP=1':>7} {'1/CP':>6} {'/ CP=2':>7}")
    for seq in seq_lens:
        base = memory[f"seq{seq}_cp1"]
        for cp, tag in [(c, t) for c in cps for t in (("",) if c == 1 else ("", "_balanced"))]:
            peak = memory[f"seq{seq}_cp{cp}{tag}"]
            two = peak / memory[f"seq{seq}_cp2{tag}"] if cp > 1 else float("nan")
            kind = "whole" if cp == 1 else ("head-tail" if tag else "contiguous")
            print(f"  {seq:>6} {cp:>3} {kind:>11} {peak / 2**20:>9.2f} {peak / base:>7.3f} {1 / cp:>6.3f} {two:>7.3f}")
    print(f"GPT step at seq {steps['seq']} on 2 ranks (median of interleaved rounds): CP=1 {steps['cp1_s'] * 1e3:.1f} ms, "
          f"CP=2 {steps['cp2_s'] * 1e3:.1f} ms, CP=2 / CP=1 = {steps['ratio_cp2_over_cp1']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"memory_peak_bytes": memory, "step": steps}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
