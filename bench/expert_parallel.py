"""Mixture-of-experts benchmark: expert parallelism EP = 2 and 4 against the same model with its experts
replicated (EP = 1), on 4 gloo ranks, side by side in one run.

Run (ranks spawned by the script; BENCHMARKS.md's "Mixture of experts" figures come from it):

    OMP_NUM_THREADS=1 python bench/expert_parallel.py --json bench/results/moe.json
    python bench/expert_parallel.py --quick      # smoke run (a test runs it)

Each contender is the GPT preset (``vemesh.models.gpt``) with every MLP a MoE (E experts, top-k), on a mesh
``(DP=4)`` whose DP ranks fold into ``(EDP, EP)`` by ``ParallelDims``, its experts spread by
``vemesh.parallel.ExpertParallel``, wrapped in vemesh's DDP and stepping AdamW on the same global batch.

**All-to-all bytes.** The library's token exchange is wrapped to count what each rank puts into its
all-to-alls, forward (slots out, outputs back) and backward (the gradients of both, counted where they
enter the exchange). The analytic count per rank and step is ``4 x MoE layers x N x k x C x 4`` bytes
(N tokens of the rank, k slots each, C features in fp32, four exchanges); every slot is sent, to its
own rank or another, so the measured total must equal it. The off-rank share depends on the routing;
with uniform routing it would be ``(EP - 1) / EP``, and the measured share is printed beside that.

**Step time.** Steps of the three contenders interleave (the order rotates every round, a step's time
is the slowest rank's); each ratio is the median over rounds of EP=n / EP=1.

**Memory.** Expert-parameter bytes held per rank (the experts' parameters, their gradient buffer and
AdamW's two moments, from the live model), and the ratio to EP = 1: the target is ``1 / EP``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from torch.distributed.tensor.parallel import parallelize_module  # noqa: E402
from two_ranks import run_on_ranks  # noqa: E402

import vemesh.parallel.experts.exchange as exchange_module  # noqa: E402
from vemesh import VeDeviceMesh  # noqa: E402
from vemesh.ddp import DistributedDataParallel as DDP  # noqa: E402
from vemesh.models.gpt import GPT, GPTConfig  # noqa: E402
from vemesh.parallel import ExpertParallel, ParallelDims  # noqa: E402
from vemesh.parallel.experts import is_expert  # noqa: E402
from vemesh.parallel.ddp.grad_buffer import local_tensor  # noqa: E402


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.view(-1))


WORLD = 4


class ExchangeCounter:
    """Counts the bytes each rank feeds its all-to-alls (forward and backward), in total and off-rank."""

    def __init__(self) -> None:
        self.total = self.off_rank = 0
        self.inner = exchange_module._exchange

    def __call__(self, x, recv, send, group):
        me = dist.get_rank(group)
        row = x[0].numel() * x.element_size() if x.size(0) else 0
        self.total += sum(send) * row
        self.off_rank += sum(s for r, s in enumerate(send) if r != me) * row
        out = self.inner(x, recv, send, group)
        if out.requires_grad:  # backward sends the gradient of ``out`` back: recv[r] rows to rank r
            def count(grad, recv=recv, me=me, row=row):
                self.total += sum(recv) * row
                self.off_rank += sum(s for r, s in enumerate(recv) if r != me) * row
            out.register_hook(count)
        return out


def contenders_step(cfg: dict, rounds: int, warmup: int) -> dict:
    counter = ExchangeCounter()
    exchange_module._exchange = counter
    runs = {}
    for ep in cfg["eps"]:
        mesh = ParallelDims(WORLD, ep=ep).build("cpu", VeDeviceMesh())
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=cfg["seq"], n_layer=cfg["layers"], n_head=4, n_embd=cfg["embd"],
                              moe_experts=cfg["experts"], moe_top_k=cfg["top_k"]))
        extra = {}
        if ep > 1:
            for moe in model.moe_layers():
                parallelize_module(moe.experts, mesh["EP"], ExpertParallel())
            extra = dict(expert_data_parallel=mesh["EDP"], expert_parameters=[p for p in model.parameters() if is_expert(p)])
        ddp = DDP(model, mesh["DP"], **extra)
        opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
        runs[ep] = (mesh, ddp, opt)
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 256, (cfg["batch"], cfg["seq"] + 1), generator=g)
    times: dict[int, list[float]] = {ep: [] for ep in cfg["eps"]}
    traffic: dict[int, tuple[int, int]] = {}
    order = list(cfg["eps"])
    for r in range(warmup + rounds):
        for ep in order[r % len(order):] + order[:r % len(order)]:
            mesh, ddp, opt = runs[ep]
            rows = x[mesh.lookup_rank("DP")::WORLD]
            dist.barrier()
            counter.total = counter.off_rank = 0
            t0 = time.perf_counter()
            opt.zero_grad()
            loss_fn(ddp(rows[:, :-1].contiguous()), rows[:, 1:].contiguous()).backward()
            opt.step()
            spent = torch.tensor([time.perf_counter() - t0])
            dist.all_reduce(spent, op=dist.ReduceOp.MAX)
            traffic[ep] = (counter.total, counter.off_rank)
            if r >= warmup:
                times[ep].append(spent.item())
    out = {"config": cfg, "ep": {}}
    for ep in cfg["eps"]:
        mesh, ddp, opt = runs[ep]
        params = [p for m in ddp.module.moe_layers() for p in m.experts.parameters()]
        state = sum(local_tensor(t).numel() * t.element_size() for p in params for t in opt.state[p].values()
                    if torch.is_tensor(t) and t.ndim)
        memory = sum(local_tensor(p).numel() * p.element_size() + p.main_grad.numel() * p.main_grad.element_size()
                     for p in params) + state
        total = torch.tensor([float(traffic[ep][0]), float(traffic[ep][1])], dtype=torch.float64)
        dist.all_reduce(total)  # summed over the ranks, reported per rank
        out["ep"][ep] = {
            "step_s": statistics.median(times[ep]),
            "ratio_to_ep1": statistics.median(b / a for a, b in zip(times[cfg["eps"][0]], times[ep])),
            "alltoall_bytes_per_rank": total[0].item() / WORLD,
            "off_rank_bytes_per_rank": total[1].item() / WORLD,
            "expert_bytes_per_rank": memory,
        }
        mesh.reset()
    exchange_module._exchange = counter.inner
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a small model, a few rounds (the smoke test)")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args(argv)
    cfg = dict(eps=[1, 2, 4], layers=2, embd=64 if args.quick else 256, experts=8, top_k=2, seq=64,
               batch=8 if args.quick else 32)
    result = run_on_ranks(WORLD, contenders_step, cfg, 2 if args.quick else 15, 1 if args.quick else 3)
    tokens = cfg["batch"] // WORLD * cfg["seq"]
    analytic = 4 * cfg["layers"] * tokens * cfg["top_k"] * cfg["embd"] * 4
    print(f"MoE GPT on {WORLD} gloo ranks: {cfg['layers']} MoE layers, {cfg['experts']} experts top-{cfg['top_k']}, "
          f"n_embd {cfg['embd']}, {tokens} tokens per rank per step")
    print(f"  {'EP':>3} {'step ms':>8} {'/ EP=1':>7} {'all-to-all KiB':>15} {'analytic KiB':>13} {'off-rank':>9} "
          f"{'uniform':>8} {'expert MiB':>11} {'/ EP=1':>7} {'1/EP':>6}")
    base = result["ep"][1]["expert_bytes_per_rank"]
    for ep, row in result["ep"].items():
        moved = row["alltoall_bytes_per_rank"]
        expected = analytic if ep > 1 else 0
        share = row["off_rank_bytes_per_rank"] / moved if moved else 0.0
        row["analytic_bytes_per_rank"] = expected
        print(f"  {ep:>3} {row['step_s'] * 1e3:>8.1f} {row['ratio_to_ep1']:>7.2f} {moved / 2**10:>15.1f} "
              f"{expected / 2**10:>13.1f} {share:>9.3f} {(ep - 1) / ep:>8.3f} {row['expert_bytes_per_rank'] / 2**20:>11.2f} "
              f"{row['expert_bytes_per_rank'] / base:>7.3f} {1 / ep:>6.3f}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
