"""Flash attention's rate on this GPU at the long-context shapes the published tables train, beside its matmul rate.

    python bench/attention_rate.py [--profile h200-sxm] [--json FILE]

The built-in GPU profiles time attention at ``attention_achievable`` of the bf16 peak (0.30, torch's SDPA forward
on H100 as published at sequences of 1k to 8k) and its backward at ``attention_backward`` of that (0.9). torchtitan's
long-context rows (Llama 3 8B and 405B with context parallelism, 32k tokens per rank) are where the plans miss. This
times, in one run, ``scaled_dot_product_attention`` in bf16 with Llama 3's heads (32 of 128) at the shapes a rank's
ring runs: the causal 32k x 32k of its own tokens, and the 32k x 16k and 16k x 32k blocks that torch's load-balanced
ring computes with the other ranks' keys (not causal); each by torch's default choice of kernel and by the flash and
cuDNN kernels alone. Its FLOPs are counted as the planner counts them (two products forward, five backward; half of
them under a causal mask). It prints each shape's forward and backward TFLOP/s, as a fraction of an 8192^3 bf16
matmul timed in the same run and of the profile's bf16 peak. Needs a CUDA device (it says so and exits 2 without).
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

HEADS, HEAD_DIM, REPS = 32, 128, 10
#: (name, query tokens, key tokens, causal)
SHAPES = (("causal-32k", 32768, 32768, True), ("ring-32k-x-16k", 32768, 16384, False),
          ("ring-16k-x-32k", 16384, 32768, False), ("causal-8k", 8192, 8192, True))


def seconds(fn) -> float:
    """The median of REPS timed calls, after one untimed (the device synchronized around each)."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(REPS):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def matmul_rate() -> float:
    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    return 2 * 8192**3 / seconds(lambda: a @ b)


def attention(sq: int, skv: int, causal: bool, backend) -> tuple[float, float]:
    """(forward FLOP/s, backward FLOP/s) of one shape, under one kernel choice (None: torch's default)."""
    from torch.nn.attention import sdpa_kernel

    F = torch.nn.functional
    q = torch.randn(1, HEADS, sq, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, HEADS, skv, HEAD_DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    grad = torch.randn_like(q)
    product = 2 * HEADS * sq * skv * HEAD_DIM * (0.5 if causal else 1.0)  # one of the seven products
    with sdpa_kernel(backend) if backend is not None else contextlib.nullcontext():
        forward = seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))
        both = seconds(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(grad))
    return 2 * product / forward, 5 * product / max(both - forward, 1e-9)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="h200-sxm", help="the device profile whose bf16 peak the rates are "
                                                               "also divided by (NAME or FILE; default h200-sxm)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    from vemesh.planning.profiles import load_profile  # vemesh after the arguments: --help stays quick

    try:
        peak = load_profile(args.profile).matmul_flops["bf16"]
    except ValueError as e:
        print(f"bench/attention_rate.py: --profile {e}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("bench/attention_rate.py needs a CUDA device; this torch sees none", file=sys.stderr)
        return 2
    from torch.nn.attention import SDPBackend

    matmul = matmul_rate()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}: an 8192^3 bf16 matmul at "
          f"{matmul / 1e12:.0f} TFLOP/s ({matmul / peak:.2f} of {args.profile}'s {peak / 1e12:.0f})")
    print(f"{'shape':<16}{'kernel':<9}{'forward':>10}{'/matmul':>9}{'/peak':>7}{'backward':>10}{'/matmul':>9}"
          f"{'/peak':>7}{'bwd/fwd':>9}")
    rows = []
    for name, sq, skv, causal in SHAPES:
        for kernel, backend in (("default", None), ("flash", SDPBackend.FLASH_ATTENTION),
                                ("cudnn", SDPBackend.CUDNN_ATTENTION)):
            try:
                fwd, bwd = attention(sq, skv, causal, backend)
            except RuntimeError as e:  # a kernel this build or shape lacks: said, and the others still timed
                print(f"{name:<16}{kernel:<9}not run: {str(e).splitlines()[0][:90]}")
                continue
            rows.append(dict(shape=name, query=sq, keys=skv, causal=causal, kernel=kernel, forward_flops=fwd,
                             backward_flops=bwd, matmul_flops=matmul, peak_flops=peak))
            print(f"{name:<16}{kernel:<9}{fwd / 1e12:>10.0f}{fwd / matmul:>9.2f}{fwd / peak:>7.2f}{bwd / 1e12:>10.0f}"
                  f"{bwd / matmul:>9.2f}{bwd / peak:>7.2f}{bwd / fwd:>9.2f}")
            torch.cuda.empty_cache()
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
