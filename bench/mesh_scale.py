"""What the mesh costs at scale: vemesh vs bare torch and veScale-style tensor searches.

One process plays one rank of a huge world on torch's fake backend (no
communication, no devices), so a laptop can time what rank ``world // 2 + 1`` of
a 16384-rank job pays to build its mesh and to ask questions about it.

    python bench/mesh_scale.py                      # full run, about a minute on 1 core
    python bench/mesh_scale.py --quick              # smoke test, under 10 s (worlds 64 and 1024)
    python bench/mesh_scale.py --json bench/results/mesh_scale.json --plot bench/results/mesh_scale.png

What is timed, for each world size (64, 1024, 8192, 16384) and each shape
family, 3-D (PP, DP, TP) and 4-D (PP, DP, CP, TP):

  init    ``VeDeviceMesh().init_device_mesh`` + every standard view (PP, DP, TP, DP x TP)
          vs torch ``init_device_mesh`` + the same slices.          target: <= 1.1x torch
  view    a repeated ``m["TP"]``-style lookup: vemesh's cached view
          vs torch slicing again.                                   target: >= 100x faster
  coord   ``get_strategy_coordinate(r)`` for a spread of ranks
          vs veScale's ``(grid == r).nonzero(as_tuple=True)``.      target: >= 20x faster
  rank    ``get_global_rank(c)`` for the same ranks' coordinates
          vs indexing the rank grid ``int(grid[c])``.                target: >= 20x faster
  mine    ``get_strategy_coordinate()`` (own rank)
          vs torch ``DeviceMesh.get_coordinate()`` (a cached tuple).  no target; shown
  flat    each vemesh query at the largest world vs the smallest.   target: <= 1.5x

plus the core issue's check: ``get_strategy_coordinate(r)`` vs a bare
``(grid == r).nonzero()`` on a 16x64x8 mesh (target >= 10x).

Every comparison runs interleaved (A, B, B, A, ...) and reports the median of
15 repeats (3 with --quick); each repeat is a timeit-style loop of
``perf_counter_ns`` over at least 3 ms (1 ms) with the garbage collector off.
Init builds each mesh on a fresh fake world, once per repeat, and its ratio is
the median of the per-round ratios. Growth with world size comes from a
separate sweep that visits every world size in each repeat, so load drift on
a shared machine does not pass for growth; the plot shows that sweep. Ratios
say how many times faster (or, for init, slower) vemesh is. The script never
fails on a MISS: timings are for people.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.testing._internal.distributed.fake_pg import FakeStore

from vemesh import VeDeviceMesh

SHAPES: dict[str, dict[int, tuple[int, ...]]] = {
    "3-D": {64: (2, 4, 8), 1024: (4, 32, 8), 8192: (16, 64, 8), 16384: (16, 128, 8)},
    "4-D": {64: (2, 2, 2, 8), 1024: (4, 8, 4, 8), 8192: (8, 32, 4, 8), 16384: (16, 32, 4, 8)},
}
NAMES = {"3-D": ("PP", "DP", "TP"), "4-D": ("PP", "DP", "CP", "TP")}
VIEWS: list[str | tuple[str, ...]] = ["PP", "DP", "TP", ("DP", "TP")]
N_RANKS = 64  # ranks queried per world size, spread from 0 to world - 1

# name: (what vemesh does, the alternative, target ratio alternative/vemesh or None)
QUERIES = {
    "view": ("cached m[view]", "torch slicing", 100.0),
    "coord": ("get_strategy_coordinate(r)", "(grid == r).nonzero", 20.0),
    "rank": ("get_global_rank(c)", "int(grid[c])", 20.0),
    "mine": ("get_strategy_coordinate()", "torch get_coordinate()", None),
}
INIT_TARGET = 1.1  # vemesh init + views <= 1.1x torch
FLAT_TARGET = 1.5  # vemesh per-call at the largest world <= 1.5x the smallest
CORE_TARGET = 10.0  # vs bare (grid == r).nonzero() on 16x64x8


# ============================================================== timing
def vemesh_version() -> str:
    """The commit measured, plus ``+dirty`` if the timed modules differ from it (read-only git calls)."""
    root = Path(__file__).resolve().parents[1]
    timed = ["vemesh/mesh", "vemesh/layout"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True,
                              text=True, timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "diff", "--name-only", "HEAD", "--", *timed], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.split()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (head or "unknown") + (f"+dirty({','.join(dirty)})" if dirty else "")


def fresh_world(world: int, rank: int) -> None:
    """A new fake default process group: this process is ``rank`` of ``world``."""
    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def loop_ns(fn: Callable, args: Sequence | None, number: int) -> tuple[float, float]:
    """Nanoseconds per call of ``fn(a)`` for ``a`` in ``args`` (or ``fn()``), over ``number`` passes.

    Returns (wall, cpu): ``perf_counter_ns`` is the measure; ``thread_time_ns``, read
    around the same loop, leaves out the moments another job held the core.
    """
    calls = number * (len(args) if args is not None else 1)
    gc_was_on = gc.isenabled()
    gc.disable()
    try:
        if args is None:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(number):
                fn()
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
        else:
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            for _ in range(number):
                for a in args:
                    fn(a)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
    finally:
        if gc_was_on:
            gc.enable()
    return (t1 - t0) / calls, (c1 - c0) / calls


def calibrate(fn: Callable, args: Sequence | None, min_ns: float) -> int:
    """Passes needed for one sample to take at least ``min_ns`` (timeit's autorange)."""
    number = 1
    while True:
        total = loop_ns(fn, args, number)[0] * (len(args) if args is not None else 1) * number
        if total >= min_ns or number >= 1 << 20:
            return number
        number = max(number * 2, int(number * min_ns / max(total, 1.0) * 1.2))


def ab_per_call(a: tuple, b: tuple, repeats: int, min_ns: float) -> dict:
    """Median ns per call of two ``(fn, args)`` pairs (a: vemesh, b: the alternative), sampled A B B A ..."""
    na, nb = calibrate(*a, min_ns), calibrate(*b, min_ns)
    ta: list[tuple[float, float]] = []
    tb: list[tuple[float, float]] = []
    for i in range(repeats):
        order = [(a, na, ta), (b, nb, tb)] if i % 2 == 0 else [(b, nb, tb), (a, na, ta)]
        for (fn, args), number, out in order:
            out.append(loop_ns(fn, args, number))
    ve, alt = statistics.median(t[0] for t in ta), statistics.median(t[0] for t in tb)
    ve_cpu, alt_cpu = statistics.median(t[1] for t in ta), statistics.median(t[1] for t in tb)
    ve_best, alt_best = min(t[0] for t in ta), min(t[0] for t in tb)
    return {"vemesh_ns": ve, "alt_ns": alt, "speedup": alt / ve,
            "vemesh_cpu_ns": ve_cpu, "alt_cpu_ns": alt_cpu, "cpu_speedup": alt_cpu / ve_cpu,
            "vemesh_best_ns": ve_best, "alt_best_ns": alt_best, "best_speedup": alt_best / ve_best}


# ============================================================== what is timed
def build_torch(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    mesh = torch_init_device_mesh("cpu", shape, mesh_dim_names=names)
    for view in VIEWS:
        mesh[view]


def build_vemesh(shape: tuple[int, ...], names: tuple[str, ...]) -> None:
    vm = VeDeviceMesh()
    vm.init_device_mesh("cpu", shape, mesh_dim_names=names)
    for view in VIEWS:
        vm[view]


def time_init(world: int, rank: int, shape, names, repeats: int) -> dict:
    """Time to build the mesh and its views, vemesh and torch alternately, each on a fresh world.

    Returns medians and the median of the per-round ratios vemesh/torch: a round's
    two builds run back to back, so their ratio shrugs off load drift. Wall time
    (``perf_counter_ns``) is the measure; this process's CPU time
    (``thread_time_ns``) is kept beside it because, on a shared machine, wall time
    also counts the moments another job held the core.
    """
    runs = {"vemesh": build_vemesh, "torch": build_torch}
    wall: dict[str, list[float]] = {k: [] for k in runs}
    cpu: dict[str, list[float]] = {k: [] for k in runs}
    gc.collect()  # once: a full collection with torch loaded costs ~0.1 s
    for i in range(repeats + 1):  # round 0 warms imports and torch's caches
        for key in (("vemesh", "torch") if i % 2 else ("torch", "vemesh")):
            fresh_world(world, rank)
            gc.disable()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            runs[key](shape, names)
            t1, c1 = time.perf_counter_ns(), time.thread_time_ns()
            gc.enable()
            if i:
                wall[key].append((t1 - t0) / 1e9)
                cpu[key].append((c1 - c0) / 1e9)
    return {
        "vemesh_s": statistics.median(wall["vemesh"]),
        "torch_s": statistics.median(wall["torch"]),
        "ratio": statistics.median(v / t for v, t in zip(wall["vemesh"], wall["torch"])),
        "vemesh_cpu_s": statistics.median(cpu["vemesh"]),
        "torch_cpu_s": statistics.median(cpu["torch"]),
        "cpu_ratio": statistics.median(v / t for v, t in zip(cpu["vemesh"], cpu["torch"])),
    }


def spread(world: int, count: int = N_RANKS) -> list[int]:
    """``count`` global ranks from 0 to ``world - 1``, evenly spaced (all of them if fewer)."""
    if world <= count:
        return list(range(world))
    return [round(i * (world - 1) / (count - 1)) for i in range(count)]


def time_queries(world: int, rank: int, shape, names, repeats: int, min_ns: float) -> tuple[dict, dict]:
    """Median ns per call for each query, vemesh vs its alternative, on one fresh world.

    Also returns the ``(fn, args)`` pairs timed, for :func:`time_growth`, which
    re-creates this world's fake process group before timing them again.
    """
    fresh_world(world, rank)
    vm = VeDeviceMesh()
    mesh = vm.init_device_mesh("cpu", shape, mesh_dim_names=names)
    grid = mesh.mesh  # the rank grid tensor, as veScale keeps it
    ranks = spread(world)
    coords = [tuple(vm.get_strategy_coordinate(r)) for r in ranks]
    for r, c in zip(ranks, coords):  # both sides must give the same answers
        assert [int(i) for i in (grid == r).nonzero(as_tuple=True)] == list(c)
        assert vm.get_global_rank(c) == int(grid[c]) == r
    assert list(vm.get_strategy_coordinate()) == list(mesh.get_coordinate())
    for view in VIEWS:  # the first lookup builds and caches the view
        assert vm[view].mesh.tolist() == mesh[view].mesh.tolist()

    def vescale_coordinate(r: int) -> list[int]:
        return [int(i) for i in (grid == r).nonzero(as_tuple=True)]

    def grid_rank(c: tuple[int, ...]) -> int:
        return int(grid[c])

    pairs = {
        "view": ((vm.__getitem__, VIEWS), (mesh.__getitem__, VIEWS)),
        "coord": ((vm.get_strategy_coordinate, ranks), (vescale_coordinate, ranks)),
        "rank": ((vm.get_global_rank, coords), (grid_rank, coords)),
        "mine": ((vm.get_strategy_coordinate, None), (mesh.get_coordinate, None)),
    }
    out = {}
    for query, (a, b) in pairs.items():
        out[query] = ab_per_call(a, b, repeats, min_ns)

    def rebuild() -> None:  # on a re-created world (time_growth): a mesh refuses questions once its world is gone
        vm.init_device_mesh("cpu", shape, mesh_dim_names=names)
        for view in VIEWS:  # cached again, as they were when timed here
            vm[view]

    return out, dict(pairs, rebuild=(vm, rebuild))


def time_growth(pairs_by_world: dict[int, dict], repeats: int, min_ns: float) -> dict:
    """Per-call cost of every query at every world size, sampled round-robin across the worlds.

    The per-world tables above are taken minutes apart, so load drift on a shared
    machine can pass for growth; here each repeat visits every world size back to
    back (in rotating order), so growth is measured against the same background.
    Each visit first re-creates that world's fake process group (torch slicing
    looks up this process's rank) and builds vemesh's mesh again on it (a mesh
    refuses every question once its process group is gone), outside the timed loop.
    """
    worlds = sorted(pairs_by_world)

    def visit(w: int) -> None:
        if dist.get_world_size() != w:
            fresh_world(w, w // 2 + 1)
        vm, rebuild = pairs_by_world[w]["rebuild"]
        if not vm.is_initialized():  # built on a world re-created since: built again, outside the timed loop
            rebuild()

    out: dict[str, dict] = {}
    for query in QUERIES:
        entry: dict[str, list] = {"worlds": worlds}
        for side, key in ((0, "vemesh"), (1, "alt")):
            runs = [pairs_by_world[w][query][side] for w in worlds]
            numbers = []
            for w, (fn, args) in zip(worlds, runs):
                visit(w)
                numbers.append(calibrate(fn, args, min_ns))
            samples: list[list[tuple[float, float]]] = [[] for _ in worlds]
            for i in range(repeats):
                for j in [(i + k) % len(worlds) for k in range(len(worlds))]:
                    visit(worlds[j])
                    samples[j].append(loop_ns(*runs[j], numbers[j]))
            entry[f"{key}_ns"] = [statistics.median(t[0] for t in x) for x in samples]
            entry[f"{key}_cpu_ns"] = [statistics.median(t[1] for t in x) for x in samples]
            entry[f"{key}_growth"] = entry[f"{key}_ns"][-1] / entry[f"{key}_ns"][0]
            entry[f"{key}_cpu_growth"] = entry[f"{key}_cpu_ns"][-1] / entry[f"{key}_cpu_ns"][0]
        out[query] = entry
    return out


def time_core_check(repeats: int, min_ns: float) -> dict:
    """The core issue's check: coordinate arithmetic vs a bare ``(grid == r).nonzero()`` on 16x64x8."""
    shape, world = (16, 64, 8), 16 * 64 * 8
    fresh_world(world, world // 2 + 1)
    vm = VeDeviceMesh()
    grid = vm.init_device_mesh("cpu", shape, mesh_dim_names=("PP", "DP", "TP")).mesh
    ranks = spread(world)

    def nonzero(r: int) -> torch.Tensor:
        return (grid == r).nonzero()

    # at least 9 samples each: the verdict is on the fastest of them (timeit's advice), which a busy machine
    # cannot inflate the way it inflates a median of 3 (a 215 ns call read 3.07 us under a test suite's load)
    result = ab_per_call((vm.get_strategy_coordinate, ranks), (nonzero, ranks), max(repeats, 9), min_ns)
    return {"shape": list(shape), **result}


# ============================================================== reporting
def verdict(ok: bool) -> str:
    return "PASS" if ok else "MISS"


def fmt_x(ratio: float) -> str:
    return f"{ratio:.0f}x" if ratio >= 100 else f"{ratio:.1f}x" if ratio >= 1 else f"{ratio:.2f}x"


def fmt_ns(ns: float) -> str:
    if ns >= 1e6:
        return f"{ns / 1e6:.2f} ms"
    if ns >= 1e3:
        return f"{ns / 1e3:.2f} us"
    return f"{ns:.0f} ns"


def print_table(title: str, header: list[str], rows: list[list[str]]) -> None:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    print(f"\n{title}")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))


def report(results: dict) -> None:
    cases = results["cases"]
    rows = [
        [c["family"], str(c["world"]), "x".join(map(str, c["shape"])),
         f"{c['init']['vemesh_s'] * 1e3:.1f} ms", f"{c['init']['torch_s'] * 1e3:.1f} ms",
         f"{c['init']['ratio']:.2f}x", verdict(c["init"]["ratio"] <= INIT_TARGET), f"{c['init']['cpu_ratio']:.2f}x"]
        for c in cases
    ]
    print_table(f"Mesh init + views PP, DP, TP, DPxTP (median wall time; vemesh/torch = median of paired ratios; "
                f"target <= {INIT_TARGET}x; CPU = the same ratio in this process's CPU time)",
                ["shape", "world", "mesh", "vemesh", "torch", "vemesh/torch", "target", "CPU vemesh/torch"], rows)

    for query, (ve_name, alt_name, target) in QUERIES.items():
        rows = []
        for c in cases:
            q = c["queries"][query]
            ok = "info" if target is None else verdict(q["speedup"] >= target)
            rows.append([c["family"], str(c["world"]), fmt_ns(q["vemesh_ns"]), fmt_ns(q["alt_ns"]),
                         fmt_x(q["speedup"]), ok, fmt_x(q["cpu_speedup"])])
        goal = "no target" if target is None else f"target >= {target:g}x"
        print_table(f"Per call: vemesh {ve_name} vs {alt_name} (median wall ns; speedup = alt/vemesh; {goal}; "
                    f"CPU = the same in CPU time)",
                    ["shape", "world", "vemesh", "alternative", "speedup", "target", "CPU speedup"], rows)

    for fam, growth in results["growth"].items():
        worlds = growth["view"]["worlds"]
        rows = []
        for query, g in growth.items():
            for side, label in (("vemesh", "vemesh"), ("alt", QUERIES[query][1])):
                rows.append([query if side == "vemesh" else "", label, *(fmt_ns(ns) for ns in g[f"{side}_ns"]),
                             fmt_x(g[f"{side}_growth"]),
                             verdict(g["vemesh_growth"] <= FLAT_TARGET) if side == "vemesh" else "",
                             fmt_x(g[f"{side}_cpu_growth"])])
        print_table(f"Growth per call, {fam}: all world sizes sampled round-robin (median wall ns; growth = "
                    f"{worlds[-1]} vs {worlds[0]}; target vemesh <= {FLAT_TARGET}x: flat; CPU = growth in CPU time)",
                    ["query", "who", *(str(w) for w in worlds), "growth", "target", "CPU growth"], rows)

    core = results["core"]
    print_table(f"Core issue: rank arithmetic vs (grid == r).nonzero() on 16x64x8 (target >= {CORE_TARGET:g}x, "
                "judged on the fastest sample of each; median and CPU beside it)",
                ["query", "vemesh", "nonzero", "speedup", "target", "median speedup", "CPU speedup"],
                [["get_strategy_coordinate(r)", fmt_ns(core["vemesh_best_ns"]), fmt_ns(core["alt_best_ns"]),
                  fmt_x(core["best_speedup"]), verdict(core["best_speedup"] >= CORE_TARGET), fmt_x(core["speedup"]),
                  fmt_x(core["cpu_speedup"])]])


def plot(results: dict, path: Path) -> None:
    """Log-log per-call cost vs world size, one panel per shape family, from the round-robin sweep."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"\nmatplotlib is not installed: skipping the plot {path} (pip install -e '.[plot]')")
        return
    colors = {"view": "tab:blue", "coord": "tab:orange", "rank": "tab:green", "mine": "tab:purple"}
    growth = results["growth"]
    fig, axes = plt.subplots(1, len(growth), figsize=(6 * len(growth), 5), sharey=True, squeeze=False)
    for ax, (fam, queries) in zip(axes[0], growth.items()):
        for query, (ve_name, alt_name, _) in QUERIES.items():
            g = queries[query]
            ax.plot(g["worlds"], g["vemesh_ns"], "-o", color=colors[query], label=f"vemesh {ve_name}")
            ax.plot(g["worlds"], g["alt_ns"], "--s", color=colors[query], mfc="none", label=alt_name)
        worlds = queries["view"]["worlds"]
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(worlds, [str(w) for w in worlds])
        ax.minorticks_off()
        ax.set_xlabel("world size (ranks)")
        ax.set_title(f"{fam} mesh ({', '.join(NAMES[fam])})")
        ax.grid(True, which="major", alpha=0.3)
    axes[0][0].set_ylabel("median time per call (ns, log scale)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, fontsize=8.5, frameon=False)
    m = results["machine"]
    fig.suptitle(f"Per-call query cost vs world size (solid: vemesh, dashed: what you would use instead)\n"
                 f"{m['cpus']} CPUs shared, torch {m['torch']}, fake backend, one simulated rank, "
                 f"vemesh {m['vemesh']}", fontsize=10)
    fig.tight_layout(rect=(0, 0.12, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"\nwrote {path}")


# ============================================================== main
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small worlds, few repeats: a smoke test")
    parser.add_argument("--repeats", type=int, default=None, help="samples per median (default 15, quick 3)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--plot", type=Path, default=None, help="write a PNG of per-call cost vs world size here")
    args = parser.parse_args(argv)

    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)  # the machine is shared; small-tensor ops are single-threaded anyway
    repeats = args.repeats or (3 if args.quick else 15)
    min_ns = 1e6 if args.quick else 3e6  # per sample
    worlds = [64, 1024] if args.quick else [64, 1024, 8192, 16384]

    machine = {
        "cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
        "platform": platform.platform(), "backend": "fake", "loadavg_start": os.getloadavg()[0],
        "vemesh": vemesh_version(),
    }
    print(f"mesh_scale: vemesh {machine['vemesh']}, {machine['cpus']} CPUs, python {machine['python']}, "
          f"torch {machine['torch']}, fake backend, {repeats} repeats, load average {machine['loadavg_start']:.2f}"
          + (" (quick)" if args.quick else ""))
    cases = []
    pairs_by_world: dict[str, dict[int, dict]] = {}
    for family, shapes in SHAPES.items():
        for world in worlds:
            shape, names, rank = shapes[world], NAMES[family], world // 2 + 1
            t0 = time.perf_counter()
            init = time_init(world, rank, shape, names, repeats)
            queries, pairs = time_queries(world, rank, shape, names, repeats, min_ns)
            pairs_by_world.setdefault(family, {})[world] = pairs
            cases.append({
                "family": family, "world": world, "shape": list(shape), "names": list(names), "rank": rank,
                "init": init,
                "queries": queries,
            })
            print(f"  {family} {world:>6} ranks {'x'.join(map(str, shape)):>12}: {time.perf_counter() - t0:.1f} s",
                  flush=True)
    t0 = time.perf_counter()
    growth = {family: time_growth(by_world, repeats, min_ns) for family, by_world in pairs_by_world.items()}
    print(f"  growth sweep across world sizes: {time.perf_counter() - t0:.1f} s", flush=True)
    core = time_core_check(repeats, min_ns)
    if dist.is_initialized():
        dist.destroy_process_group()
    machine["loadavg_end"] = os.getloadavg()[0]
    results = {
        "machine": machine, "repeats": repeats, "quick": args.quick,
        "targets": {"init_max_ratio": INIT_TARGET, "flat_max_growth": FLAT_TARGET, "core_min_speedup": CORE_TARGET,
                    **{f"{q}_min_speedup": t for q, (_, _, t) in QUERIES.items() if t is not None}},
        "cases": cases, "growth": growth, "core": core,
    }
    report(results)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
