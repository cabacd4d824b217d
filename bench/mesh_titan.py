"""torchtitan's 4-D mesh at scale: vemesh's init, flattens and mixed views against torch's own, in one run.

One process plays rank ``world // 2 + 1`` of a 16384-rank world on torch's fake backend, as in
``bench/mesh_scale.py``. Both sides build ``(dp_replicate, dp_shard, cp, tp) = (8, 64, 4, 8)``,
flatten ``dp``, ``dp_shard_cp`` and ``dp_cp`` (vemesh's ``dp_cp`` from the flattened
``dp_shard_cp``), and take the views torchtitan takes: ``["dp_replicate", "dp_shard_cp"]`` (FSDP2's
HSDP view), ``["dp", "cp"]``, ``["dp_cp", "tp"]``, ``"tp"``. Rounds alternate the order, each on
a fresh fake world, and the ratio is the median over rounds of vemesh / torch (target <= 1.1).

    python bench/mesh_titan.py [--json bench/results/mesh_titan.json] [--world 1024] [--repeats 9]
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

sys.path.insert(0, str(Path(__file__).resolve().parent))
from mesh_scale import fresh_world  # noqa: E402

from vemesh import VeDeviceMesh  # noqa: E402

NAMES = ("dp_replicate", "dp_shard", "cp", "tp")
SHAPES = {16384: (8, 64, 4, 8), 1024: (2, 16, 4, 8), 64: (2, 2, 2, 8)}
VIEWS = [("dp_replicate", "dp_shard_cp"), ("dp", "cp"), ("dp_cp", "tp"), "tp"]


def build_torch(shape: tuple[int, ...]) -> None:
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
    mesh["dp_replicate", "dp_shard", "cp"]._flatten("dp_cp")
    for view in VIEWS:
        mesh[view]


def build_vemesh(shape: tuple[int, ...]) -> None:
    mesh = VeDeviceMesh()
    mesh.init_device_mesh("cpu", shape, mesh_dim_names=NAMES)
    mesh.flatten(("dp_replicate", "dp_shard"), "dp")
    mesh.flatten(("dp_shard", "cp"), "dp_shard_cp")
    mesh.flatten(("dp_replicate", "dp_shard_cp"), "dp_cp")
    for view in VIEWS:
        mesh[view]


def run(world: int, repeats: int) -> dict:
    shape, rank = SHAPES[world], world // 2 + 1
    times: dict[str, list[float]] = {"vemesh": [], "torch": []}
    builds = {"vemesh": build_vemesh, "torch": build_torch}
    for i in range(repeats + 1):  # round 0 warms up
        for key in (("vemesh", "torch") if i % 2 else ("torch", "vemesh")):
            fresh_world(world, rank)
            gc.collect()
            gc.disable()
            t0 = time.perf_counter()
            builds[key](shape)
            elapsed = time.perf_counter() - t0
            gc.enable()
            if i:
                times[key].append(elapsed)
    ratio = statistics.median(v / t for v, t in zip(times["vemesh"], times["torch"]))
    return {"world": world, "shape": list(shape), "rank": rank, "repeats": repeats,
            "vemesh_ms": 1e3 * statistics.median(times["vemesh"]), "torch_ms": 1e3 * statistics.median(times["torch"]),
            "ratio": ratio, "target": 1.1, "met": ratio <= 1.1}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, choices=sorted(SHAPES), default=16384)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    r = run(args.world, args.repeats)
    print(f"# mesh_titan: {args.world} ranks {tuple(r['shape'])} {NAMES}, rank {r['rank']}, fake backend, {args.repeats} rounds")
    print("| | vemesh ms | torch ms | vemesh / torch | target |\n|---|---:|---:|---:|---:|")
    print(f"| init + 3 flattens + 4 views | {r['vemesh_ms']:.1f} | {r['torch_ms']:.1f} | {r['ratio']:.3f} | <= 1.1 "
          f"({'PASS' if r['met'] else 'MISS'}) |")
    if args.json:
        args.json.write_text(json.dumps(r, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
