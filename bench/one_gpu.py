"""The GPT example on one CUDA device: its measured step time and CUDA peak beside ``vemesh plan``'s prediction.

    python bench/one_gpu.py [--profile h200-sxm] [--json bench/results/one_gpu.json]

For each model: ``examples/gpt/train.py --device cuda --dtype bf16`` in this process (one rank, ZeRO-1's optimizer,
16 sequences of 1024 tokens, 40 steps), the median step after step 10 from its metrics and
``torch.cuda.max_memory_allocated()``; then ``vemesh plan --model gpt:... --world-size 1 --dtype bf16
--device-profile PROFILE --json``. It prints each pair and its ratio. Needs a CUDA device (it says so and exits 2
without one); the built-in profiles are published specifications, so use the one of the GPU it runs on.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gpt-12x768": (12, 768, 12), "gpt-24x1024": (24, 1024, 16)}
BATCH, SEQ, STEPS = 16, 1024, 40


def measure(layers: int, width: int, heads: int, metrics: Path) -> tuple[float, int]:
    """(median seconds per step after step 10, CUDA peak bytes) of the example on this GPU."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    import train

    torch.cuda.reset_peak_memory_stats()
    code = train.main(["--device", "cuda", "--dtype", "bf16", "--n-layer", str(layers), "--n-embd", str(width),
                       "--n-head", str(heads), "--seq-len", str(SEQ), "--global-batch-size", str(BATCH), "--steps",
                       str(STEPS), "--eval-every", "0", "--sample-tokens", "0", "--log-every", "10",
                       "--max-data-bytes", "8000000", "--metrics-file", str(metrics)])
    if code:
        raise SystemExit(f"the example exited with {code}")
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    step = statistics.median(BATCH * SEQ / r["tokens_per_s"] for r in records if r["step"] > 10)
    return step, torch.cuda.max_memory_allocated()


def predict(layers: int, width: int, heads: int, profile: str) -> dict:
    spec = f"gpt:n_layer={layers},n_embd={width},n_head={heads},seq_len={SEQ},vocab=256"
    out = subprocess.run([sys.executable, "-m", "vemesh", "plan", "--model", spec, "--world-size", "1",
                          "--global-batch-size", str(BATCH), "--dtype", "bf16", "--device-profile", profile, "--json"],
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="h200-sxm", help="the device profile to predict with (NAME or FILE)")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/one_gpu.py needs a CUDA device; this torch sees none", file=sys.stderr)
        return 2
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, profile {args.profile}")
    print(f"{'model':<14}{'step measured':>15}{'predicted':>11}{'ratio':>7}{'peak measured':>15}{'predicted':>11}"
          f"{'ratio':>7}")
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (layers, width, heads) in MODELS.items():
            step, peak = measure(layers, width, heads, Path(tmp) / f"{name}.jsonl")
            plan = predict(layers, width, heads, args.profile)
            row = dict(name=name, measured_step_s=step, predicted_step_s=plan["step_time"], measured_peak=peak,
                       predicted_peak=plan["peak"], time=plan["time"])
            rows.append(row)
            print(f"{name:<14}{step * 1e3:>12.1f} ms{plan['step_time'] * 1e3:>8.1f} ms{plan['step_time'] / step:>7.2f}"
                  f"{peak / 1e9:>12.2f} GB{plan['peak'] / 1e9:>8.2f} GB{plan['peak'] / peak:>7.3f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
