"""The GPT example on one CUDA device: its measured step time and CUDA peak beside ``vemesh plan``'s prediction.

    python bench/one_gpu.py [--profile h200-sxm [--profile FILE ...]] [--json bench/results/one_gpu.json]

For each model: ``examples/gpt/train.py --device cuda --dtype bf16`` in this process (one rank, ZeRO-1's optimizer,
16 sequences of 1024 tokens, 40 steps; one model with ``--activation-checkpointing``, two with ``--compile``: each
block compiled by inductor), the median step after step 10 from its metrics and ``torch.cuda.max_memory_allocated()``;
then ``vemesh plan --model gpt:... --world-size 1 --dtype bf16 --device-profile PROFILE --json`` (with ``--compile``
for a compiled run) for each profile given (a built-in name, or the file ``vemesh calibrate --device cuda`` wrote),
every plan at once after the runs, on the host's cores. It prints each pair and its ratio. Needs a CUDA device (it says so and exits 2
without one); the built-in profiles are published specifications, so use the one of the GPU it runs on.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
# name: (layers, width, heads, activation checkpointing, torch.compile)
MODELS = {"gpt-12x768": (12, 768, 12, False, False), "gpt-24x1024": (24, 1024, 16, False, False),
          "gpt-24x1024-ac": (24, 1024, 16, True, False), "gpt-12x768-compiled": (12, 768, 12, False, True),
          "gpt-24x1024-compiled": (24, 1024, 16, False, True)}
BATCH, SEQ, STEPS = 16, 1024, 40


def model_names(value: str) -> list[str]:
    """``--models``: names of :data:`MODELS`, comma-separated (argparse's type: an unknown one is an error that
    names the choices)."""
    names = value.split(",")
    unknown = [n for n in names if n not in MODELS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {', '.join(unknown)} (choose from {', '.join(MODELS)})")
    return names


def measure(layers: int, width: int, heads: int, checkpointing: bool, compiled: bool,
            metrics: Path) -> tuple[float, int]:
    """(median seconds per step after step 10, CUDA peak bytes) of the example on this GPU."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    import train

    torch.cuda.reset_peak_memory_stats()
    # each compiled run from nothing: a block compiled before at another width recompiles with dynamic shapes (a
    # first run on an H200 had the 24 x 1024 model's compiled step at 1.27x its eager one so)
    torch._dynamo.reset()
    code = train.main(["--device", "cuda", "--dtype", "bf16", "--n-layer", str(layers), "--n-embd", str(width),
                       "--n-head", str(heads), "--seq-len", str(SEQ), "--global-batch-size", str(BATCH), "--steps",
                       str(STEPS), "--eval-every", "0", "--sample-tokens", "0", "--log-every", "10",
                       "--max-data-bytes", "8000000", "--metrics-file", str(metrics)]
                      + (["--activation-checkpointing"] if checkpointing else []) + (["--compile"] if compiled else []))
    if code:
        raise SystemExit(f"the example exited with {code}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    step = statistics.median(BATCH * SEQ / r["tokens_per_s"] for r in records if r["step"] > 10)
    return step, torch.cuda.max_memory_allocated()


def start_plan(layers: int, width: int, heads: int, checkpointing: bool, compiled: bool,
               profile: str) -> subprocess.Popen:
    """``vemesh plan`` of one run, started (one host thread: the plans run side by side)."""
    spec = f"gpt:n_layer={layers},n_embd={width},n_head={heads},seq_len={SEQ},vocab=256"
    return subprocess.Popen([sys.executable, "-m", "vemesh", "plan", "--model", spec, "--world-size", "1",
                             "--global-batch-size", str(BATCH), "--dtype", "bf16", "--device-profile", profile, "--json"]
                            + (["--activation-checkpointing"] if checkpointing else [])
                            + (["--compile"] if compiled else []),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})


def finish_plan(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    if proc.returncode:
        raise SystemExit(f"{' '.join(proc.args)} exited with {proc.returncode}:\n{err}")
    return json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="append", default=None,
                        help="a device profile to predict with (NAME or FILE); repeat it to compare profiles on the "
                             "same measured runs (default h200-sxm)")
    parser.add_argument("--models", type=model_names, default=",".join(MODELS),
                        help=f"comma-separated, from {', '.join(MODELS)} (default: all)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    profiles = args.profile or ["h200-sxm"]
    from vemesh.planning.profiles import load_profile  # vemesh after the arguments: --help stays quick

    for profile in profiles:  # a bad name is said before any run on the GPU, not after it
        try:
            load_profile(profile)
        except ValueError as e:
            print(f"bench/one_gpu.py: --profile {e}", file=sys.stderr)
            return 2
    if not torch.cuda.is_available():
        print("bench/one_gpu.py needs a CUDA device; this torch sees none", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'model':<22}{'profile':<22}{'step measured':>15}{'predicted':>11}{'ratio':>7}{'peak measured':>15}"
          f"{'predicted':>11}{'ratio':>7}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:  # every run on the GPU first, then every plan at once on the host
        runs, failed = {}, []
        for name in args.models:  # a run that fails is said, and the others still run
            try:
                runs[name] = measure(*MODELS[name], Path(tmp) / f"{name}.jsonl")
            except (Exception, SystemExit):
                failed.append(name)
                print(f"{name}: the run failed:\n{traceback.format_exc()}", file=sys.stderr)
        started = {(name, p): start_plan(*MODELS[name], p) for name in runs for p in profiles}
        for name, (step, peak) in runs.items():
            plans = {profile: finish_plan(started[name, profile]) for profile in profiles}
            first = plans[profiles[0]]
            rows.append(dict(name=name, measured_step_s=step, measured_peak=peak, predicted_step_s=first["step_time"],
                             predicted_peak=first["peak"], time=first["time"],
                             by_profile={p: dict(step_s=plan["step_time"], peak=plan["peak"], time=plan["time"])
                                         for p, plan in plans.items()}))
            for profile, plan in plans.items():
                print(f"{name:<22}{Path(profile).stem[:21]:<22}{step * 1e3:>12.1f} ms{plan['step_time'] * 1e3:>8.1f} ms"
                      f"{plan['step_time'] / step:>7.2f}{peak / 1e9:>12.2f} GB{plan['peak'] / 1e9:>8.2f} GB"
                      f"{plan['peak'] / peak:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    if failed:
        print(f"bench/one_gpu.py: {len(failed)} run(s) failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
