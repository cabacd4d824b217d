"""The ops a plan counts in a step of the GPT example, beside the ops the real step dispatches.

    python bench/op_count.py [--device cpu|cuda] [--json FILE]

A plan charges the framework's time per op (the profile's ``op_overhead_s``) for every op its trace counts, and on a
GPU whose steps are bound by the host that is most of the step. The trace runs on fake tensors, which dispatch what
a real tensor answers in C++ (its device wherever torch asks for it): counted, those reads were 60% of a GPT step's
ops. For each model this runs ``examples/gpt/train.py`` in this process (one rank, ZeRO-1) for 2 and then 4 steps
under a dispatch mode that counts every op, takes the difference over 2 as the real step's ops, and plans the same
model with ``vemesh plan``'s preset; it prints both counts and their ratio, and the real step's ops by name.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parents[1]
#: name: (layers, width, heads, sequence length, global batch)
MODELS = {"gpt-2x192": (2, 192, 4, 64, 8), "gpt-12x768": (12, 768, 12, 64, 4)}


class Dispatched(TorchDispatchMode):
    """Every op dispatched while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops[f"{func.namespace}.{func.overloadpacket.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def real_ops(device: str, layers: int, width: int, heads: int, seq: int, batch: int) -> collections.Counter[str]:
    """The ops one step of the example dispatches: runs of 2 and 4 steps, the difference over 2 (one held-out batch
    at the end of each: the same in both, so out of the difference)."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    import train

    def run(steps: int) -> collections.Counter[str]:
        with Dispatched() as counted:
            code = train.main(["--device", device, "--dtype", "bf16" if device == "cuda" else "fp32", "--n-layer",
                               str(layers), "--n-embd", str(width), "--n-head", str(heads), "--seq-len", str(seq),
                               "--global-batch-size", str(batch), "--steps", str(steps), "--eval-every", "0", "--eval-batches", "1",
                               "--sample-tokens", "0", "--log-every", "1000", "--max-data-bytes", "2000000"])
        if code:
            raise SystemExit(f"the example exited with {code}")
        return counted.ops

    two, four = run(2), run(4)
    return collections.Counter({k: (four[k] - two.get(k, 0)) // 2 for k in four if four[k] > two.get(k, 0)})


def planned_ops(device: str, layers: int, width: int, heads: int, seq: int, batch: int) -> int:
    from vemesh.planning.api import answer
    from vemesh.planning.request import PlanRequest

    # a GPU's profile plans the optimizer as torch runs it on CUDA (foreach, ZeRO-1's runs whole), a CPU's as on a CPU
    profile = "h200-sxm" if device == "cuda" else str(ROOT / "bench" / "results" / "profile-calibrated-4.json")
    request = PlanRequest(model=f"gpt:n_layer={layers},n_embd={width},n_head={heads},seq_len={seq},vocab=256",
                          world_size=1, global_batch_size=batch, dtype="bf16" if device == "cuda" else "fp32",
                          device_profile=profile)
    return answer(request).fit.classes[0].ops


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        print("bench/op_count.py --device cuda needs a CUDA device; this torch sees none", file=sys.stderr)
        return 2
    rows = []
    for name, shape in MODELS.items():
        real = real_ops(args.device, *shape)
        plan = planned_ops(args.device, *shape)
        rows.append(dict(name=name, device=args.device, real=sum(real.values()), planned=plan,
                         ratio=plan / sum(real.values()), real_by_op=dict(real.most_common())))
    print(f"{'model':<14}{'device':>8}{'real step':>11}{'planned':>9}{'planned / real':>16}")
    for row in rows:
        print(f"{row['name']:<14}{row['device']:>8}{row['real']:>11}{row['planned']:>9}{row['ratio']:>16.2f}")
    for row in rows:
        print(f"{row['name']}, the real step's ops by name:",
              ", ".join(f"{k} {v}" for k, v in list(row["real_by_op"].items())[:12]))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
