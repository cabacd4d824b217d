"""The host's waits for the GPU in one step of the GPT example, eager and compiled, and where each comes from.

    python bench/step_syncs.py [--models gpt-12x768,gpt-12x768-compiled] [--json FILE]

A GPU runs its queue while the host dispatches the next ops, so a step costs the larger of the two, not their sum,
as long as the host never waits for the device. Each wait (a ``.item()``, a tensor's value read on the host, a
synchronizing copy) empties the queue, and what follows runs host then device. This runs
``examples/gpt/train.py --device cuda --dtype bf16`` in this process (``bench/one_gpu.py``'s models, by name; 16
sequences of 1024 tokens, ZeRO-1) and, for step 12 alone, turns on torch's ``cuda.set_sync_debug_mode("warn")``,
which warns at every synchronizing call; each warning is counted by the innermost frame of vemesh, the example or,
where neither is on the stack, torch. Dynamo's caches are reset before each model. Needs a CUDA device (it says so
and exits 2 without).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import traceback
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
from one_gpu import BATCH, MODELS, SEQ, model_names  # noqa: E402

WATCHED = 12  # the step whose waits are counted (the compiled models compile in the first ones)


def where(stack: list[traceback.FrameSummary]) -> str:
    """The innermost frame of this project's code on ``stack`` (else of torch's), as ``path:function``."""
    for mine in (True, False):
        for frame in reversed(stack):
            path = frame.filename.replace("\\", "/")
            ours = "/vemesh/" in path or "/examples/gpt/" in path
            if (ours if mine else "/torch/" in path) and "/bench/" not in path:
                short = path.split("/vemesh/")[-1] if "/vemesh/" in path else path.split("/")[-1]
                return f"{'vemesh/' if '/vemesh/' in path else ''}{short}:{frame.name}"
    return "?"


def count(name: str) -> dict:
    """The waits of step WATCHED of one model, by where they come from."""
    sys.path.insert(0, str(ROOT / "examples" / "gpt"))
    import train

    from vemesh import VESCALE_DEVICE_MESH

    layers, width, heads, checkpointing, compiled = MODELS[name]
    torch._dynamo.reset()
    waits: collections.Counter[str] = collections.Counter()
    messages: collections.Counter[str] = collections.Counter()

    def show(message, category, filename, lineno, file=None, line=None) -> None:
        text = str(message)
        if "synchroniz" in text:
            waits[where(traceback.extract_stack()[:-1])] += 1
            messages[text.split("\n")[0][:100]] += 1

    mesh_class = type(VESCALE_DEVICE_MESH)
    mark_step = mesh_class.mark_step

    def marked(mesh, step: int) -> None:  # the top of each step: watch step WATCHED alone
        torch.cuda.set_sync_debug_mode("warn" if step == WATCHED else "default")
        mark_step(mesh, step)

    mesh_class.mark_step = marked
    shown, warnings.showwarning = warnings.showwarning, show
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            code = train.main(["--device", "cuda", "--dtype", "bf16", "--n-layer", str(layers), "--n-embd", str(width),
                               "--n-head", str(heads), "--seq-len", str(SEQ), "--global-batch-size", str(BATCH),
                               "--steps", str(WATCHED), "--eval-every", "0", "--eval-batches", "1",
                               "--sample-tokens", "0", "--log-every", "100", "--max-data-bytes", "8000000"]
                              + (["--activation-checkpointing"] if checkpointing else [])
                              + (["--compile"] if compiled else []))
    finally:
        torch.cuda.set_sync_debug_mode("default")
        mesh_class.mark_step = mark_step
        warnings.showwarning = shown
    if code:
        raise SystemExit(f"{name}: the example exited with {code}")
    return dict(name=name, waits=sum(waits.values()), by_place=dict(waits.most_common()),
                messages=dict(messages.most_common()))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", type=model_names, default="gpt-12x768,gpt-12x768-compiled",
                        help=f"comma-separated, from {', '.join(MODELS)}")
    parser.add_argument("--json", default=None, help="also write the rows to this JSON file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/step_syncs.py needs a CUDA device; this torch sees none", file=sys.stderr)
        return 2
    rows = []
    for name in args.models:
        row = count(name)
        rows.append(row)
        print(f"{name}: {row['waits']} waits for the GPU in step {WATCHED}")
        for place, n in row["by_place"].items():
            print(f"    {n:5d}  {place}")
        for text, n in row["messages"].items():
            print(f"    {n:5d}  {text}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
