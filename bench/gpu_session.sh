#!/usr/bin/env bash
# The checks that need a GPU, as one run on a lent one-GPU machine (its torch, not this project's pin):
#
#   bash bench/gpu_session.sh            # logs and results under $OUT (default /tmp/vemesh-gpu)
#
# 1. `vemesh calibrate --device cuda --nproc 1`: the GPU's matmul rates (fp8 where it has them), memory bandwidth,
#    framework time per op -> $OUT/profile.json;
# 2. bench/one_gpu.py: the GPT example with --device cuda --dtype bf16 (and with activation checkpointing), its
#    measured step time and CUDA peak beside `vemesh plan` with the built-in profile and the calibrated one;
# 3. the `cuda`-marked tests: calibrate and plan, torch's ring flash attention (CUDA SDPA) and the MoE dispatch on
#    gloo ranks sharing the GPU, the example's peak against the plan;
# 4. bench/op_count.py: the ops the plan counts in a step beside the ops the real step dispatches on the GPU;
# 5. the example under torchrun on one GPU (nccl), as a user starts it.
#
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
      'pydantic', pydantic.VERSION)"; } 2>&1 | tee "$OUT/env.log"

summary=()
step() {  # step NAME COMMAND...: its output to $OUT/NAME.log, its exit status and seconds to the summary
    local name=$1 t0 rc
    shift
    t0=$(date +%s)
    "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    summary+=("$name: rc $rc, $(($(date +%s) - t0)) s")
    echo "== $name: rc $rc"
    tail -n 12 "$OUT/$name.log"
}
step calibrate python3 -m vemesh calibrate --device cuda --nproc 1 --output "$OUT/profile.json"
profiles=(--profile h200-sxm)
case "$(nvidia-smi -L)" in *H100*) profiles=(--profile h100-sxm) ;; esac
[ -f "$OUT/profile.json" ] && profiles+=(--profile "$OUT/profile.json")
step one_gpu python3 bench/one_gpu.py "${profiles[@]}" --json "$OUT/one_gpu.json"
step tests python3 -m pytest -o addopts= -p no:cacheprovider -m cuda -ra -q --durations=8 \
    test/planning/test_calibrate_cuda.py test/parallel/context_parallel/test_ring_attention.py \
    test/examples/test_moe_dispatch.py test/bench/test_bench_one_gpu.py
step op_count python3 bench/op_count.py --device cuda
step example torchrun --standalone --nproc_per_node=1 examples/gpt/train.py --device cuda --dtype bf16 --steps 60 \
    --log-every 20
python3 - "$OUT/profile.json" <<'EOF' || true
import json, sys
p = json.load(open(sys.argv[1]))
print("calibrated:", {k: f"{v / 1e12:.0f} TFLOP/s" for k, v in p["matmul_flops"].items()},
      f"memory {p['memory_bandwidth'] / 1e12:.2f} TB/s", f"transcendental {p['transcendental_bandwidth'] / 1e12:.2f} TB/s",
      f"op {p['op_overhead_s'] * 1e6:.1f} us")
EOF
printf '%s\n' "${summary[@]}"
