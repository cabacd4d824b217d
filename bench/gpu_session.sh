#!/usr/bin/env bash
# The checks that need a GPU, as one run on a lent one-GPU machine (its torch, not this project's pin):
#
#   bash bench/gpu_session.sh            # logs and results under $OUT (default /tmp/vemesh-gpu)
#
# 1. bench/one_gpu.py: the GPT example with --device cuda --dtype bf16 (with activation checkpointing, and with
#    --compile: inductor's blocks), its measured step time and CUDA peak beside `vemesh plan` (with --compile for the
#    compiled runs) with the built-in profile and the calibrated one of an earlier session
#    (bench/results/profile-h200-calibrated.json); the plans' peaks must hold within 10%;
# 2. the example under torchrun on one GPU (nccl), as a user starts it: 60 steps saved to a checkpoint, resumed to
#    90 with --compile and --activation-checkpointing (DCP's load of CUDA tensors, inductor under torchrun);
# 3. bench/attention_rate.py: torch's SDPA at the long-context shapes of the published tables, beside the matmul;
# 4. the `cuda`-marked tests: calibrate and plan, torch's ring flash attention (CUDA SDPA) and the MoE dispatch on
#    gloo ranks sharing the GPU (the one_gpu test is step 1's script, so it is not run twice);
# 5. `vemesh calibrate --device cuda --nproc 1`: the GPU's matmul rates (fp8 where it has them), memory bandwidth,
#    framework time per op, attention's forward and backward apart -> $OUT/profile.json;
# 6. bench/op_count.py: the ops the plan counts in a step beside the ops the real step dispatches on the GPU;
# 7. bench/step_profile.py: what the example's step is bound by, eager and compiled (torch.profiler's kernels and
#    host ops) -> $OUT/step_profile.json;
# 8. bench/step_syncs.py: the host's waits for the GPU in a step, eager and compiled, by where they come from.
#
# Each step has its own time limit, so that a slow one leaves the others their turn. Every step's whole output is
# appended to $OUT/session.log (the device tool brings back at most 8 files), and its last lines printed.
# A machine without a project venv: pydantic and expecttest travel as wheels in .whl/ (see the device notes in
# BENCHMARKS.md), installed into /tmp/site; vemesh runs from this checkout.
set -uo pipefail
OUT=${OUT:-/tmp/vemesh-gpu}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" > /dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD:${PYTHONPATH:-}
else
    export PYTHONPATH=$PWD:${PYTHONPATH:-}
fi
{ nvidia-smi -L; python3 -c "import torch, pydantic; print('torch', torch.__version__, torch.cuda.get_device_name(),
      'pydantic', pydantic.VERSION)"; } 2>&1 | tee "$OUT/session.log"

summary=()
step() {  # step NAME SECONDS COMMAND...: its output appended to $OUT/session.log, its status and time to the summary
    local name=$1 limit=$2 t0 rc
    shift 2
    t0=$(date +%s)
    echo "=== $name: $*" >> "$OUT/session.log"
    timeout "$limit" "$@" > /tmp/vemesh-step.log 2>&1
    rc=$?
    cat /tmp/vemesh-step.log >> "$OUT/session.log"
    summary+=("$name: rc $rc, $(($(date +%s) - t0)) s")
    echo "== $name: rc $rc, $(($(date +%s) - t0)) s"
    tail -n 14 /tmp/vemesh-step.log
}
profiles=(--profile h200-sxm)
case "$(nvidia-smi -L)" in *H100*) profiles=(--profile h100-sxm) ;; esac
profiles+=(--profile bench/results/profile-h200-calibrated.json)
step one_gpu 280 python3 bench/one_gpu.py "${profiles[@]}" --json "$OUT/one_gpu.json"
rm -rf /tmp/vemesh-ckpt
step example 150 bash -c "torchrun --standalone --nproc_per_node=1 examples/gpt/train.py --device cuda --dtype bf16 \
    --steps 60 --log-every 20 --checkpoint-dir /tmp/vemesh-ckpt && torchrun --standalone --nproc_per_node=1 \
    examples/gpt/train.py --device cuda --dtype bf16 --steps 90 --log-every 10 --checkpoint-dir /tmp/vemesh-ckpt \
    --compile --activation-checkpointing"
step attention 60 python3 bench/attention_rate.py --json "$OUT/attention.json"
step tests 120 python3 -m pytest -o addopts= -p no:cacheprovider -m cuda -ra -q --durations=8 \
    test/planning/test_calibrate_cuda.py test/parallel/context_parallel/test_ring_attention.py \
    test/examples/test_moe_dispatch.py
step calibrate 120 python3 -m vemesh calibrate --device cuda --nproc 1 --output "$OUT/profile.json"
step op_count 90 python3 bench/op_count.py --device cuda
step step_profile 150 python3 bench/step_profile.py --json "$OUT/step_profile.json"
step step_syncs 100 python3 bench/step_syncs.py
python3 - "$OUT" <<'PY' || true
import json, os, sys
out = sys.argv[1]
if os.path.exists(f"{out}/one_gpu.json"):
    for row in json.load(open(f"{out}/one_gpu.json")):
        ratio = row["predicted_peak"] / row["measured_peak"]
        print(f"{row['name']}: peak predicted / measured {ratio:.3f}", "ok" if abs(ratio - 1) <= 0.10 else "OVER 10%")
if os.path.exists(f"{out}/profile.json"):
    p = json.load(open(f"{out}/profile.json"))
    print("calibrated:", {k: f"{v / 1e12:.0f} TFLOP/s" for k, v in p["matmul_flops"].items()},
          f"memory {p['memory_bandwidth'] / 1e12:.2f} TB/s", f"transcendental {p['transcendental_bandwidth'] / 1e12:.2f} TB/s",
          f"op {p['op_overhead_s'] * 1e6:.1f} us", f"attention backward {p.get('attention_backward')}",
          "attention", [(a["seq"], a["head_dim"], round(a["achievable"], 3)) for a in p.get("attention", [])])
PY
printf '%s\n' "${summary[@]}"
