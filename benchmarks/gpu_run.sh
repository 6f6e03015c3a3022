#!/usr/bin/env bash
# One device call on a fresh GPU machine (its own torch and Triton, no network), within
# ${BUDGET:-520} s: titanc laid out from the checkout (pyproject.toml's package-dir), then
#   1. tiny.yaml's first training step: cold (empty caches), warm, warm under cProfile
#      (benchmarks/first_step.py; alone on the machine: the precompile uses every core);
#   2. the GPU check (benchmarks/gpu_check.py) with the rest of the budget: $ONLY's jobs and
#      the profiled steps (benchmarks/gpu_profile.py).
# Everything lands in ${OUT:-/tmp/gpu-out}: first_step.json, results.json(l), summary.txt, logs/.
#   OUT=$OUT ONLY=checks,tiny_bf16 BUDGET=520 bash benchmarks/gpu_run.sh
#   GPU_CHECK_ARGS=--toy bash benchmarks/gpu_run.sh      # a dry run here (no GPU: toy sizes)
set -u
START=$(date +%s)
OUT=${OUT:-/tmp/gpu-out}
BUDGET=${BUDGET:-520}
ONLY=${ONLY:-checks,tiny_f32,tiny_tf32,tiny_bf16,tiny_bf16_scan_loops,tiny_bf16_remat_none,tiny_bf16_ffn176,medium_bf16,medium_bf16_scan_loops,medium_bf16_remat_none,large_bf16,large_bf16_chunk512,dense_large,peer_default}
PROFILE=${PROFILE-benchmarks/gpu_profile.py}     # PROFILE= : no profiled steps
# RUNS: the first-step runs (benchmarks/first_step.py --runs)
mkdir -p "$OUT"
# a container image may set PYTHONDONTWRITEBYTECODE: every process would then compile torch's
# and titanc's sources anew (seconds per start); an installed environment has their bytecode
echo "PYTHONDONTWRITEBYTECODE=${PYTHONDONTWRITEBYTECODE-unset} (unset for these runs)"
unset PYTHONDONTWRITEBYTECODE
SITE=$(mktemp -d)/site
mkdir -p "$SITE" && cp -r titanc "$SITE/titanc"
for p in ir passes codegen runtime; do cp -r "$p" "$SITE/titanc/$p"; done
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cores', __import__('os').cpu_count())"
timeout 200 python3 benchmarks/first_step.py examples/tiny.yaml --timeout 110 \
    --runs ${RUNS:-cold warm warm-profile} --out "$OUT/first_step.json" > "$OUT/first_step.stdout" 2>&1
python3 - "$OUT/first_step.json" <<'PY' || true
import json, sys
r = json.load(open(sys.argv[1]))
for run in ("cold", "warm", "warm-profile"):
    x = r.get(run, {})
    print(run, x.get("seconds_to_first_step"), "in-process compiles", x.get("compiled_in_process"),
          x.get("compiled_in_process_s"))
PY
LEFT=$(( BUDGET - ($(date +%s) - START) - 15 ))
echo "gpu_check deadline ${LEFT} s"
OUT="$OUT" python3 benchmarks/gpu_check.py --deadline "$LEFT" --only "$ONLY" \
    ${PROFILE:+--script profile=$PROFILE} ${GPU_CHECK_ARGS:-} > "$OUT/gpu_check.stdout" 2>&1
tail -40 "$OUT/gpu_check.stdout"
echo "total $(( $(date +%s) - START )) s"
