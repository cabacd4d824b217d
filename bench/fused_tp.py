"""What nanoGPT's global-size attention costs under TP: DTensors through the attention against local heads.

nanoGPT's forward splits its fused ``c_attn`` output with global sizes (``split(n_embd)``, ``view(B, T, n_head,
hs)``). Under TP that needs ``FusedColwiseParallel(3, use_local_output=False)``: a DTensor of the global shape,
whose ``split`` torch gathers first, so every TP rank runs every head (exact, docs/checking.md). A forward that
reads local heads (``view(B, T, 3, -1, hs)``) takes ``FusedColwiseParallel(3)``'s local tensor and runs only its
own heads. Both models come from ``test/models/nanogpt_like.py`` (the same sizes; the ``local`` flag picks the
forward); each step is a forward and backward of one micro-batch on 2 gloo ranks (TP 2), timed alternately in one
run so the machine's load falls on both alike. The ratio is global-size / local-heads (median step over rounds).

    python bench/fused_tp.py [--n-embd 256] [--n-layer 4] [--seq 256] [--batch 4] [--rounds 12]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "test" / "models")]

from two_ranks import run_on_ranks  # noqa: E402


def _steps(n_embd: int, n_layer: int, seq: int, batch: int, rounds: int) -> dict:
    import nanogpt_like as nano

    from vemesh import VESCALE_DEVICE_MESH as mesh
    from vemesh.parallel import ParallelDims

    ParallelDims(2, tp=2).build("cpu")
    size = dict(n_embd=n_embd, n_layer=n_layer, n_head=8, block_size=seq, vocab=512)
    models = {}
    for name, local, parallelize in (("global-size (DTensor)", False, nano.parallelize),
                                     ("local heads", True, nano.parallelize_local)):
        torch.manual_seed(0)
        models[name] = parallelize(nano.GPT(**size, local=local), mesh)
    tokens = torch.randint(0, 512, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(model: torch.nn.Module) -> float:
        start = time.perf_counter()
        _, loss = model(x, y)
        loss.backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - start

    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 2):  # 2 warm-up rounds
        order = list(models) if r % 2 == 0 else list(reversed(models))
        for name in order:
            seconds = step(models[name])
            if r >= 2:
                times[name].append(seconds)
    return {name: statistics.median(t) for name, t in times.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n-embd", type=int, default=256)
    p.add_argument("--n-layer", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--json", metavar="FILE", help="also write the figures to FILE")
    a = p.parse_args()
    medians = run_on_ranks(2, _steps, a.n_embd, a.n_layer, a.seq, a.batch, a.rounds)
    glob, local = medians["global-size (DTensor)"], medians["local heads"]
    print(f"nanoGPT-shaped GPT, n_embd {a.n_embd}, {a.n_layer} layers, 8 heads, seq {a.seq}, batch {a.batch}; TP 2 on "
          f"2 gloo ranks; median forward+backward over {a.rounds} alternating rounds")
    for name, s in medians.items():
        print(f"  {name:24} {s * 1e3:9.1f} ms")
    print(f"  global-size / local heads: {glob / local:.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "median_s": medians, "ratio": glob / local}, indent=2))


if __name__ == "__main__":
    main()
