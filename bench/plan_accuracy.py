"""The planner against the run: predicted peak memory and bytes per dim, beside what the GPT example measures.

Run (each configuration is one torchrun of the example with ``--memory-report``; about 3 minutes on 2 cores):

    python bench/plan_accuracy.py --json bench/results/plan_accuracy.json
    python bench/plan_accuracy.py --only ddp-fp32,pp2-1f1b    # some of them
    python bench/plan_accuracy.py --scale-only                # just the 70B plan over 1024 ranks

For every configuration it runs ``vemesh plan --model ... --json`` for the same job and mesh (before
launch: nothing of the run is read), then ``torchrun examples/gpt/train.py ... --memory-report`` for
a few steps, and prints per rank class the predicted and the measured peak (torch's MemTracker, the
largest rank of the class) and per mesh dim the predicted and the counted bytes per step (the mean
over the class's ranks). The issue's targets: every peak within 10%, every dim's bytes within 1%. The JSON rows
also hold each dim's collective calls per step, predicted and counted: equal (the example's clipping and loss
all-reduces included, as the preset's ``before_optimizer`` runs them), but for ZeRO-1 on gloo, which gathers its
shards by one broadcast per DP rank where the fake backend's trace runs one all-gather (the step time counts the
broadcasts: ``vemesh.planning.step_time``).

The user's own model (``USER_CONFIGS``): the Llama-style model of the any-model tests and its MoE, each with a
user's parallelize function and step (``test/models/llama_jobs.py``), planned with ``--parallelize``/``--step``
and run by ``bench/plan_user_run.py`` with the same functions. A MoE configuration is planned again with the
run's own load factor (``--moe-load-factor``: the busiest EP rank's slots over its share, measured in the run).

Then it times ``vemesh plan`` for a 70B-class model over 1024 ranks with 80 GiB per device and 8
devices per host, the GPT preset and a user's Llama-3-70B with its FSDP2 + TP function (target: under 60 s,
and the top choice keeps TP within a host).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TRAIN = ROOT / "examples" / "gpt" / "train.py"

#: name -> (processes, the example's flags, the planner's flags). The model is the example's default
#: shape (n_embd 192, 4 heads, seq_len 64, vocab 256) with the layers each configuration sets.
CONFIGS: dict[str, tuple[int, list[str], list[str]]] = {
    "ddp-fp32": (2, ["--mesh-shape", "2,1", "--no-distributed-optimizer"], ["--dp-mode", "ddp"]),
    "zero1-bf16": (2, ["--mesh-shape", "2,1", "--dtype", "bf16"], ["--dtype", "bf16"]),
    "fsdp2-fp32": (2, ["--mesh-shape", "2,1", "--fsdp"], ["--dp-mode", "fsdp"]),
    "tp2-dp2-zero1": (4, ["--mesh-shape", "2,2"], ["--tp", "2"]),
    "tp2-sp-bf16": (2, ["--mesh-shape", "1,2", "--sequence-parallel", "--dtype", "bf16"],
                    ["--tp", "2", "--sequence-parallel", "--dtype", "bf16"]),
    "pp2-1f1b": (2, ["--mesh-shape", "2,1,1", "--n-layer", "4", "--pp-schedule", "1f1b", "--microbatches", "4"],
                 ["--pp", "2", "--n-layer", "4", "--pp-schedule", "1f1b", "--micro-batch-size", "8"]),
    "pp2-gpipe": (2, ["--mesh-shape", "2,1,1", "--n-layer", "4", "--pp-schedule", "gpipe", "--microbatches", "4"],
                  ["--pp", "2", "--n-layer", "4", "--pp-schedule", "gpipe", "--micro-batch-size", "8"]),
    "pp2-interleaved": (2, ["--mesh-shape", "2,1,1", "--n-layer", "4", "--pp-schedule", "interleaved-1f1b",
                            "--microbatches", "4"],
                        ["--pp", "2", "--n-layer", "4", "--pp-schedule", "interleaved-1f1b", "--micro-batch-size", "8"]),
    "pp2-tp2-1f1b-bf16": (4, ["--mesh-shape", "2,1,2", "--n-layer", "4", "--microbatches", "4", "--dtype", "bf16"],
                          ["--pp", "2", "--tp", "2", "--n-layer", "4", "--micro-batch-size", "8", "--dtype", "bf16"]),
    "fsdp2-bf16-ckpt": (2, ["--mesh-shape", "2,1", "--fsdp", "--dtype", "bf16", "--activation-checkpointing"],
                        ["--dp-mode", "fsdp", "--dtype", "bf16", "--activation-checkpointing"]),
    "zero1-ckpt": (2, ["--mesh-shape", "2,1", "--activation-checkpointing"], ["--activation-checkpointing"]),
    "moe-ep2-tp2": (4, ["--mesh-shape", "2,2", "--moe-experts", "8", "--ep", "2"], ["--tp", "2", "--ep", "2"]),
    "moe-ep2-ddp": (2, ["--mesh-shape", "2,1", "--moe-experts", "4", "--ep", "2", "--no-distributed-optimizer"],
                    ["--ep", "2", "--dp-mode", "ddp"]),
    "cp2": (2, ["--mesh-dims", "DP,CP", "--mesh-shape", "1,2"], ["--cp", "2"]),
    "ddp-accumulate": (2, ["--mesh-shape", "2,1", "--no-distributed-optimizer", "--micro-batch-size", "4"],
                       ["--dp-mode", "ddp", "--micro-batch-size", "4"]),
    # FSDP2 over 4 passes: the gradients averaged on the last (every unsharded gradient held until it), or on each
    "fsdp2-accumulate": (2, ["--mesh-shape", "2,1", "--fsdp", "--micro-batch-size", "4"],
                         ["--dp-mode", "fsdp", "--micro-batch-size", "4"]),
    "fsdp2-accumulate-each": (2, ["--mesh-shape", "2,1", "--fsdp", "--micro-batch-size", "4", "--gradient-sync", "each"],
                              ["--dp-mode", "fsdp", "--micro-batch-size", "4", "--gradient-sync", "each"]),
}


#: The user's own model (``test/models/llama_jobs.py``: the Llama-style model of the any-model tests and its MoE, with
#: a user's parallelize functions and step), planned with ``--parallelize``/``--step`` and measured by
#: ``bench/plan_user_run.py`` running the same functions: name -> (processes, factory, parallelize, flags for both).
JOBS = "test/models/llama_jobs.py"
HF_JOBS = "test/models/hf_jobs.py"  # Hugging Face transformers' LlamaForCausalLM, as transformers ships it
EXAMPLES_JOBS = "test/models/examples_llama2_jobs.py"  # pytorch/examples' Llama2, from a checkout of the repository
TITAN_JOBS = "test/models/titan_jobs.py"  # torchtitan's MoE module, as torchtitan 0.3.0 ships it (the titan extra)
PIPELINE = ["--step", f"{JOBS}:step_pp", "--loss", f"{JOBS}:loss_fn"]
USER_CONFIGS: dict[str, tuple[int, str, str, list[str]]] = {
    "llama-fsdp2-tp2-sp": (4, "make_dense", "parallelize_fsdp", ["--tp", "2"]),
    "llama-zero1-tp2": (4, "make_dense", "parallelize_ddp", ["--tp", "2", "--dp-mode", "zero1"]),
    "llama-cp2": (2, "make_dense", "parallelize_ddp", ["--cp", "2", "--dp", "1", "--dp-mode", "ddp"]),
    "llama-moe-ep2": (2, "make_moe", "parallelize_ddp", ["--ep", "2", "--dp-mode", "ddp"]),
    "llama-moe-ep2-fsdp2": (2, "make_moe", "parallelize_fsdp", ["--ep", "2"]),
    "llama-fsdp2-checkpointed": (2, "make_dense", "parallelize_checkpointed", []),
    "llama-ddp-accumulate": (2, "make_dense", "parallelize_ddp", ["--dp-mode", "ddp", "--micro-batch-size", "2"]),
    "llama-torch-ddp": (2, "make_dense", "parallelize_torch_ddp", ["--dp-mode", "ddp"]),
    "llama-torch-ddp-view-accumulate": (2, "make_dense", "parallelize_torch_ddp_bucket_view",
                                        ["--dp-mode", "ddp", "--micro-batch-size", "2"]),
    "llama-torch-replicate-accumulate": (2, "make_dense", "parallelize_torch_replicate",
                                         ["--dp-mode", "ddp", "--micro-batch-size", "2"]),
    # a fine-tune's frozen embedding and norms, which no op returns where no DDP broadcasts them (TP alone)
    "llama-frozen-tp2": (2, "make_dense_frozen", "parallelize_any", ["--tp", "2", "--dp-mode", "ddp"]),
    "llama-trunc-normal-fsdp2-tp2": (4, "make_dense_trunc_normal", "parallelize_fsdp", ["--tp", "2"]),
    "llama-trunc-normal-zero1-tp2": (4, "make_dense_trunc_normal", "parallelize_ddp", ["--tp", "2", "--dp-mode", "zero1"]),
    "hf-llama-fsdp2-tp2": (4, f"{HF_JOBS}:make_llama", f"{HF_JOBS}:parallelize_fsdp", ["--tp", "2"]),
    "hf-llama-zero1-tp2": (4, f"{HF_JOBS}:make_llama", f"{HF_JOBS}:parallelize_ddp", ["--tp", "2", "--dp-mode", "zero1"]),
    # HF's fused MoE experts (transformers 5's grouped_mm, fp32 on CPU) under vemesh's ExpertParallel
    "hf-qwen3moe-ep2-ddp": (2, f"{HF_JOBS}:make_qwen3_moe", f"{HF_JOBS}:parallelize_ddp", ["--ep", "2", "--dp-mode", "ddp"]),
    "hf-qwen3moe-ep2-fsdp2": (4, f"{HF_JOBS}:make_qwen3_moe", f"{HF_JOBS}:parallelize_fsdp", ["--ep", "2"]),
    # pytorch/examples' Llama2 as that repository ships it (trunc_normal_ in its constructor), with its own TP + SP
    # plan: FSDP2 as its fsdp_tp_example.py, and vemesh DDP + ZeRO-1 (PYTORCH_EXAMPLES: a checkout of it)
    "examples-llama2-fsdp2-tp2": (4, f"{EXAMPLES_JOBS}:make", f"{EXAMPLES_JOBS}:parallelize_fsdp", ["--tp", "2"]),
    "examples-llama2-zero1-tp2": (4, f"{EXAMPLES_JOBS}:make", f"{EXAMPLES_JOBS}:parallelize_ddp",
                                  ["--tp", "2", "--dp-mode", "zero1"]),
    "titan-moe-ep2-ddp": (2, f"{TITAN_JOBS}:make_moe", f"{TITAN_JOBS}:parallelize_ddp", ["--ep", "2", "--dp-mode", "ddp"]),
    "titan-moe-ep2-fsdp2": (2, f"{TITAN_JOBS}:make_moe", f"{TITAN_JOBS}:parallelize_fsdp", ["--ep", "2"]),
    # torchtitan's Llama3 (trunc_normal_ in its init_states), with the SDPA attention torchtitan ships
    "titan-llama3-fsdp2-tp2": (4, f"{TITAN_JOBS}:make_llama3", f"{TITAN_JOBS}:parallelize_llama3_fsdp",
                               ["--tp", "2", "--step", f"{TITAN_JOBS}:step_llama3"]),
    "titan-llama3-zero1-tp2": (4, f"{TITAN_JOBS}:make_llama3", f"{TITAN_JOBS}:parallelize_llama3_ddp",
                               ["--tp", "2", "--dp-mode", "zero1", "--step", f"{TITAN_JOBS}:step_llama3"]),
    # torchtitan's Qwen3 MoE model, whole (its debugmodel_moe with 2 blocks of 8 experts), experts in bf16 as shipped
    "titan-qwen3moe-ep2-fsdp2": (4, f"{TITAN_JOBS}:make_qwen3_moe", f"{TITAN_JOBS}:parallelize_qwen3_fsdp",
                                 ["--ep", "2", "--step", f"{TITAN_JOBS}:step_llama3"]),
    "titan-qwen3moe-ep2-tp2-zero1": (4, f"{TITAN_JOBS}:make_qwen3_moe", f"{TITAN_JOBS}:parallelize_qwen3_ddp",
                                     ["--ep", "2", "--tp", "2", "--dp-mode", "zero1", "--step",
                                      f"{TITAN_JOBS}:step_llama3"]),
    # PP: the parallelize function returns torch PipelineStages, the step runs the schedule, the loss is the schedule's
    "llama-pp2-1f1b": (4, "make_dense", "parallelize_pp_1f1b", ["--pp", "2", *PIPELINE]),
    "llama-pp2-1f1b-torch-ddp": (4, "make_dense", "parallelize_pp_1f1b_torch_ddp", ["--pp", "2", *PIPELINE]),
    "llama-pp2-interleaved": (4, "make_dense", "parallelize_pp_interleaved",
                              ["--pp", "2", "--pp-schedule", "interleaved-1f1b", *PIPELINE]),
}
#: The configurations whose router is skewed in a real run: re-planned with the run's measured load factor.
LOADED = ("moe-ep2-ddp", "moe-ep2-tp2", "llama-moe-ep2", "llama-moe-ep2-fsdp2", "hf-qwen3moe-ep2-ddp",
          "hf-qwen3moe-ep2-fsdp2", "titan-moe-ep2-ddp", "titan-moe-ep2-fsdp2", "titan-qwen3moe-ep2-fsdp2",
          "titan-qwen3moe-ep2-tp2-zero1")
#: The configurations whose model comes from outside the test extra: name -> (what, whether it is here, how to get it).
NEEDS = {
    **{name: ("torchtitan", lambda: importlib.util.find_spec("torchtitan") is not None,
              'pip install -c constraints.txt -e ".[test,titan]"') for name in USER_CONFIGS if name.startswith("titan-")},
    **{name: ("pytorch/examples", lambda: _examples_checkout() is not None,
              "git clone --depth 1 https://github.com/pytorch/examples and set PYTORCH_EXAMPLES to it")
       for name in USER_CONFIGS if name.startswith("examples-")},
}


def _examples_checkout() -> Path | None:
    sys.path.insert(0, str(ROOT / "test" / "models"))
    import examples_llama2_jobs

    return examples_llama2_jobs.model_dir()


def _model(example_flags: list[str], plan_flags: list[str]) -> str:
    n_layer = plan_flags[plan_flags.index("--n-layer") + 1] if "--n-layer" in plan_flags else "2"
    experts = example_flags[example_flags.index("--moe-experts") + 1] if "--moe-experts" in example_flags else None
    return f"gpt:n_layer={n_layer},n_embd=192,n_head=4,vocab=256,seq_len=64" + (f",moe_experts={experts}" if experts else "")


def predicted(procs: int, example_flags: list[str], plan_flags: list[str],
              plan: Callable[[list[str]], dict[str, Any]] | None = None) -> dict[str, Any]:
    flags = [f for i, f in enumerate(plan_flags) if f != "--n-layer" and (i == 0 or plan_flags[i - 1] != "--n-layer")]
    return (plan or vemesh_plan)(["--model", _model(example_flags, plan_flags), "--world-size", str(procs),
                                  "--global-batch-size", "32", "--device-type", "cpu", *flags])


def vemesh_plan(args: list[str]) -> dict[str, Any]:
    """``vemesh plan ARGS --json`` from the repository's root, in a process of its own."""
    cmd = [sys.executable, "-m", "vemesh", "plan", *args, "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)}\n{out.stderr}")
    return json.loads(out.stdout)


def torchrun(script: Path, argv: list[str], procs: int, cwd: str) -> tuple[int, str, str]:
    """``torchrun --standalone --nproc_per_node=procs script argv`` from ``cwd``: (exit code, stdout, stderr)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={procs}", str(script), *argv]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return out.returncode, out.stdout, out.stderr


def measured(procs: int, flags: list[str], workdir: str, script: Path = TRAIN,
             launch: Callable[..., tuple[int, str, str]] = torchrun) -> tuple[dict[str, Any], float | None]:
    """The run's report by rank class, and its expert load (the busiest EP rank's slots over its share) if MoE.
    ``launch(script, argv, procs, cwd)`` starts the ranks (torchrun; the tests pass their forkserver's launcher)."""
    report = os.path.join(workdir, "report.json")
    metrics = os.path.join(workdir, "metrics.jsonl")
    extra = ["--steps", "3", "--sample-tokens", "0", "--memory-report", report, "--metrics-file", metrics] \
        if script == TRAIN else ["--report", report, "--expert-load", os.path.join(workdir, "load.json")]
    code, stdout, stderr = launch(script, [*flags, *extra], procs, workdir if script == TRAIN else str(ROOT))
    if code:  # the first rank's exception line first: a long message's start falls out of the tails
        cause = re.search(r"^\[rank\d+\]: \w+(?:Error|Exception): .*$", stderr, re.M)
        raise SystemExit(f"{script} {' '.join([*flags, *extra])} on {procs} ranks exited with {code}\n"
                         f"{cause.group(0) if cause else ''}\n{stdout[-3000:]}\n{stderr[-3000:]}")
    with open(report) as f:
        classes = json.load(f)["classes"]
    return classes, _load_of(workdir, metrics, flags)


def _load_of(workdir: str, metrics: str, flags: list[str]) -> float | None:
    """The run's expert load factor: the largest, over layers and steps, of the busiest EP rank's slots over the
    mean (from the example's ``expert_load`` per expert, or the user run's own count)."""
    load = os.path.join(workdir, "load.json")
    if os.path.exists(load):
        value = json.loads(Path(load).read_text())["expert_load"]
        return value or None
    if "--ep" not in flags or not os.path.exists(metrics):
        return None
    ep = int(flags[flags.index("--ep") + 1])
    worst = 1.0
    for line in Path(metrics).read_text().splitlines():
        for layer in json.loads(line).get("expert_load", []):
            per = len(layer) // ep
            ranks = [sum(layer[r * per:(r + 1) * per]) for r in range(ep)]
            worst = max(worst, max(ranks) / (sum(ranks) / ep))
    return worst


def _rows(name: str, plan: dict[str, Any], run: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for cls in plan["classes"]:
        got = run[cls["name"]]
        dims = sorted(set(cls["bytes_per_step"]) | {d for d in got["bytes_per_step"] if d != "other"})
        rows.append({
            "config": name, "rank_class": cls["name"], "predicted_peak": cls["peak"], "measured_peak": got["peak"],
            "peak_ratio": cls["peak"] / got["peak"],
            "bytes": {d: {"predicted": cls["bytes_per_step"].get(d, 0), "measured": got["bytes_per_step"].get(d, 0)}
                      for d in dims},
            "calls": {d: {"predicted": cls["calls_per_step"].get(d, 0), "measured": got["calls_per_step"].get(d, 0)}
                      for d in dims},
        })
    return rows


def compare(name: str, launch: Callable[..., tuple[int, str, str]] = torchrun,
            plan: Callable[[list[str]], dict[str, Any]] = vemesh_plan) -> list[dict[str, Any]]:
    """Plan, run, and (for a skewed router) plan again with the run's load factor. ``launch`` starts a run's ranks
    (:func:`torchrun`) and ``plan`` answers ``vemesh plan ARGS --json`` (:func:`vemesh_plan`); the tests pass
    their own, which start no new interpreter."""
    if name in USER_CONFIGS:
        procs, factory, parallelize, flags = USER_CONFIGS[name]
        jobs = factory.rpartition(":")[0] or JOBS
        factory, parallelize = (f if ":" in f else f"{JOBS}:{f}" for f in (factory, parallelize))
        functions = ["--model", f"module:{factory}", "--parallelize", parallelize,
                     *(["--step", f"{jobs}:step"] if "--step" not in flags else []), "--global-batch-size", "8"]
        plan_args = [*functions, "--world-size", str(procs), "--device-type", "cpu", *flags]  # the run's device
        with tempfile.TemporaryDirectory() as workdir:
            run, load = measured(procs, [*functions, *flags], workdir, ROOT / "bench" / "plan_user_run.py", launch)
        planned = plan(plan_args)
    else:
        procs, flags, plan_flags = CONFIGS[name]
        planned = predicted(procs, flags, plan_flags, plan)
        with tempfile.TemporaryDirectory() as workdir:
            run, load = measured(procs, flags, workdir, launch=launch)
        plan_args = None
    rows = _rows(name, planned, run)
    if name in LOADED and load:
        if plan_args is None:
            again = predicted(procs, flags, [*plan_flags, "--moe-load-factor", f"{load:.4f}"], plan)
        else:
            again = plan([*plan_args, "--moe-load-factor", f"{load:.4f}"])
        rows += [dict(r, config=f"{name} F={load:.2f}", load_factor=load) for r in _rows(name, again, run)]
    return rows


SCALE = ["plan", "--model", "gpt:n_layer=80,n_embd=8192,n_head=64,vocab=128256,seq_len=4096", "--world-size", "1024",
         "--device-memory", "80GiB", "--devices-per-host", "8", "--global-batch-size", "1024", "--dtype", "bf16"]


SCALE_USER = ["plan", "--model", f"module:{JOBS}:make_70b", "--parallelize", f"{JOBS}:parallelize_fsdp", "--step",
              f"{JOBS}:step", "--world-size", "1024", "--device-memory", "80GiB", "--devices-per-host", "8",
              "--global-batch-size", "1024", "--dtype", "bf16"]


def at_scale(command: list[str] = SCALE) -> dict[str, Any]:
    """``vemesh plan`` for a 70B-class model over 1024 ranks: its wall time and its top choice."""
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "vemesh", *command, "--json"], capture_output=True, text=True, cwd=ROOT)
    seconds = time.perf_counter() - start
    if out.returncode:
        raise SystemExit(out.stderr)
    doc = json.loads(out.stdout)
    best = doc["fits"][0]
    return {"command": "vemesh " + " ".join(command), "seconds": seconds, "fits": len(doc["fits"]),
            "rejected": len(doc["rejected"]), "best": best["degrees"], "best_peak": best["peak"],
            "best_inter_host_dims": best["inter_host_dims"], "tp_within_a_host": "TP" not in best["inter_host_dims"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help=f"comma-separated, from: {', '.join([*CONFIGS, *USER_CONFIGS])}")
    parser.add_argument("--json", help="write the rows here")
    parser.add_argument("--scale-only", action="store_true", help="only the 70B plan over 1024 ranks")
    args = parser.parse_args()
    known = [*CONFIGS, *USER_CONFIGS]
    names = [] if args.scale_only else args.only.split(",") if args.only else known
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown configuration {unknown[0]!r}; valid: {', '.join(known)}")
    absent = {n: NEEDS[n] for n in names if n in NEEDS and not NEEDS[n][1]()}
    if absent and args.only:
        name, (what, _, install) = next(iter(absent.items()))
        parser.error(f"{name} needs {what}, which is not here: {install}")
    for name, (what, _, install) in absent.items():
        print(f"left out: {name} ({what} is not here: {install})")
    names = [n for n in names if n not in absent]
    rows = []
    if names:
        print(f"{'configuration':26} {'rank class':11} {'predicted':>10} {'measured':>10} {'ratio':>6}   bytes per step "
              "by dim: predicted / counted (ratio)")
    for name in names:
        for row in compare(name):
            rows.append(row)
            dims = "; ".join(f"{d} {b['predicted'] / 2**20:.3f}/{b['measured'] / 2**20:.3f} MiB"
                             + (f" ({b['predicted'] / b['measured']:.4f})" if b["measured"] else "")
                             for d, b in row["bytes"].items()) or "-"
            print(f"{row['config']:26} {row['rank_class']:11} {row['predicted_peak'] / 2**20:8.2f}MiB "
                  f"{row['measured_peak'] / 2**20:8.2f}MiB {row['peak_ratio']:6.3f}   {dims}", flush=True)
    if rows:
        loaded = {r["config"].split(" F=")[0] for r in rows if "load_factor" in r}
        judged = [r for r in rows if r["config"] not in loaded]  # a skewed router's plan: with the run's F
        worst_peak = max(abs(r["peak_ratio"] - 1) for r in judged)
        balanced = [r for r in rows if "load_factor" not in r]  # bytes: the mean over ranks is the balanced share
        worst_bytes = max((abs(b["predicted"] / b["measured"] - 1) for r in balanced for b in r["bytes"].values()
                           if b["measured"] and b["predicted"] > 64), default=0.0)
        print(f"worst peak error {100 * worst_peak:.1f}% (target 10%; a skewed router's configuration with the run's "
              f"load factor F); worst bytes error {100 * worst_bytes:.2f}% (target 1%; dims under 64 bytes per step, "
              "the norm's and the loss's scalars, left out; with F = 1, whose bytes are the mean over the ranks)")
    scale = scale_user = None
    if not args.only:
        scale, scale_user = at_scale(), at_scale(SCALE_USER)  # the GPT preset; a user's Llama-3-70B and its function
        for s in (scale, scale_user):
            print(f"at scale: {s['command']}\n  {s['seconds']:.1f} s (target 60 s); {s['fits']} meshes fit, "
                  f"{s['rejected']} rejected; top choice {s['best']}, peak {s['best_peak'] / 2**30:.1f} GiB, "
                  f"TP within a host: {s['tp_within_a_host']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"configurations": rows, "at_scale": scale, "at_scale_user": scale_user},
                                              indent=1) + "\n")


if __name__ == "__main__":
    main()
