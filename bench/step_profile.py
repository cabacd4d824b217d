"""Where a step of the GPT example on one GPU spends its time: the device's kernels against the host's ops.

    python bench/step_profile.py [--models gpt-12x768,gpt-12x768-compiled] [--json FILE]

``bench/one_gpu.py`` measures the example's step beside the plan; this says what the step is bound by. For each model
(``bench/one_gpu.py``'s, by name) it runs ``examples/gpt/train.py --device cuda --dtype bf16`` in this process (16
sequences of 1024 tokens, ZeRO-1) under ``torch.profiler`` for steps 12 to 15, after ten steps of warm-up (a
compiled model compiles in them; dynamo's caches are reset before each model, so that none starts from another's
graphs). It prints per step: the wall time, the device's kernel time and its share of the wall, the kernels
launched, and the host ops with the most time of their own. Needs a CUDA device (it says so and exits 2 without).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from one_gpu import BATCH, MODELS, SEQ, model_names  # noqa: E402

WAIT, WARMUP, ACTIVE = 10, 2, 4


def profile(name: str, device: str) -> dict:
    """One model's steps under the profiler: wall, device and host figures per step."""
    from torch.profiler import ProfilerActivity, schedule

    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    import train

    from vemesh import VESCALE_DEVICE_MESH

    layers, width, heads, checkpointing, compiled = MODELS[name]
    torch._dynamo.reset()
    traces, stamps = [], []
    mesh_class = type(VESCALE_DEVICE_MESH)
    mark_step = mesh_class.mark_step
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with torch.profiler.profile(activities=activities,
                                schedule=schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE),
                                on_trace_ready=traces.append) as prof:
        def marked(mesh, step: int) -> None:  # the top of each training step: the profiler's step too
            sync()
            stamps.append(time.perf_counter())
            prof.step()
            mark_step(mesh, step)

        mesh_class.mark_step = marked
        try:
            code = train.main(["--device", device, "--dtype", "bf16" if device == "cuda" else "fp32", "--n-layer", str(layers), "--n-embd", str(width),
                               "--n-head", str(heads), "--seq-len", str(SEQ), "--global-batch-size", str(BATCH),
                               "--steps", str(WAIT + WARMUP + ACTIVE + 1), "--eval-every", "0", "--eval-batches", "1",
                               "--sample-tokens", "0", "--log-every", "100", "--max-data-bytes", "8000000"]
                              + (["--activation-checkpointing"] if checkpointing else [])
                              + (["--compile"] if compiled else []))
        finally:
            mesh_class.mark_step = mark_step
    if code or not traces:
        raise SystemExit(f"{name}: the example exited with {code}" if code else f"{name}: no steps were profiled")
    events = traces[0].events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    host = collections.Counter()
    calls = collections.Counter()
    for e in traces[0].key_averages():
        if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total > 0:
            host[e.key] += e.self_cpu_time_total / 1e3 / ACTIVE
            calls[e.key] += e.count / ACTIVE
    first = WAIT + WARMUP  # stamps[k] is the top of step k + 1
    wall = (stamps[first + ACTIVE] - stamps[first]) / ACTIVE
    device = sum(e.time_range.elapsed_us() for e in kernels) / 1e3 / ACTIVE
    return dict(name=name, wall_ms=wall * 1e3, device_ms=device, kernels=len(kernels) / ACTIVE,
                aten_ops=sum(n for k, n in calls.items() if k.startswith("aten::")),
                host_top=[(k, round(ms, 2), round(calls[k], 1)) for k, ms in host.most_common(12)])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=model_names,
                        default="gpt-12x768,gpt-12x768-compiled,gpt-24x1024,gpt-24x1024-compiled",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda (default), or cpu in fp32 to try the script where no GPU is")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/step_profile.py needs a CUDA device; this torch sees none", file=sys.stderr)
        return 2
    rows = []
    for name in args.models:
        row = profile(name, args.device)
        rows.append(row)
        print(f"{name}: wall {row['wall_ms']:.1f} ms a step, device kernels {row['device_ms']:.1f} ms "
              f"({row['device_ms'] / row['wall_ms']:.0%}), {row['kernels']:.0f} kernels, "
              f"{row['aten_ops']:.0f} aten ops on the host")
        for key, ms, n in row["host_top"]:
            print(f"    {ms:8.2f} ms {n:7.1f} calls  {key}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
