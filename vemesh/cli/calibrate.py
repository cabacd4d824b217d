"""``vemesh calibrate [--device cpu|cuda] [--nproc N] [--output FILE]``: measure this machine and write a device profile
for ``vemesh plan``."""

from __future__ import annotations

import argparse
from typing import Any

from vemesh.cli.common import UsageError, positive

__all__ = ["add_calibrate"]


def add_calibrate(commands: Any) -> argparse.ArgumentParser:
    sub = commands.add_parser(
        "calibrate", help="measure this machine (matmul, memory, each collective) and write a device profile",
        description="Start N processes on this machine (gloo on CPU, nccl on GPUs), measure as a job of N ranks "
                    "uses it (matmul throughput per dtype, memory bandwidth, latency and bandwidth of each collective "
                    "kind over the N ranks, all at once), and write a device profile for vemesh plan "
                    "--device-profile FILE.",
    )
    sub.add_argument("--nproc", type=positive, metavar="N", help="processes (ranks) to measure with (default: every "
                     "GPU this machine sees with --device cuda, else 2)")
    sub.add_argument("--output", metavar="FILE", help="the profile to write (JSON; default: profile-DEVICE-N.json "
                     "here, as profile-cuda-1.json)")
    sub.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cpu (gloo) or cuda (nccl; one GPU "
                     "per process)")
    sub.add_argument("--quick", action="store_true", help="small sizes and few repetitions (a smoke run, seconds)")
    sub.add_argument("--repeat", type=positive, default=1, metavar="R", help="rounds of every measurement; each "
                     "figure is its median over them (on a shared machine, 3 or more; default 1)")
    sub.set_defaults(run=_run)
    return sub


def _run(args: argparse.Namespace) -> int:
    from vemesh.planning.calibrate import calibrate  # torch only when calibrating: `vemesh show` starts fast

    nproc = args.nproc or (_gpus() if args.device == "cuda" else 2)
    output = args.output or f"profile-{args.device}-{nproc}.json"
    if nproc < 2 and args.device != "cuda":
        raise UsageError(f"argument --nproc: {nproc}: collectives need at least 2 processes; choose 2 or more "
                         "(one process measures one GPU: --device cuda --nproc 1)")
    try:
        profile = calibrate(nproc, output, device_type=args.device, quick=args.quick, repeat=args.repeat)
    except (OSError, ValueError) as e:
        raise UsageError(str(e)) from None
    ar = profile.host
    print(f"wrote {output}: {profile.name}, {nproc} processes; matmul fp32 "
          f"{profile.matmul_flops['fp32'] / 1e9:.1f} GFLOP/s, bf16 {profile.matmul_flops['bf16'] / 1e9:.1f} GFLOP/s"
          + (f", fp8 {profile.matmul_flops['fp8'] / 1e9:.1f} GFLOP/s" if "fp8" in profile.matmul_flops else "") + " "
          f"per rank; memory {profile.memory_bandwidth / 1e9:.1f} GB/s "
          f"({(profile.transcendental_bandwidth or profile.memory_bandwidth) / 1e9:.1f} for transcendental ops); "
          f"all-reduce {ar.latency_s * 1e6:.0f} us per "
          f"step, {ar.bandwidth / 1e9:.2f} GB/s bus bandwidth"
          + (f"; attention {min(a.achievable for a in profile.attention):.2f} to "
             f"{max(a.achievable for a in profile.attention):.2f} of the matmul rate over "
             f"{len(profile.attention)} shapes" if profile.attention else ""))
    return 0


def _gpus() -> int:
    """The GPUs this machine sees: ``--device cuda``'s processes without ``--nproc``."""
    import torch

    n = torch.cuda.device_count()
    if n == 0:
        raise UsageError("--device cuda: this machine sees no GPU (torch.cuda.device_count() is 0); measure its CPU "
                         "with --device cpu, or calibrate where the job's GPUs are")
    return n
