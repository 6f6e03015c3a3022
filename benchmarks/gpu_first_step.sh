#!/usr/bin/env bash
# Issue 27's device check (at most 9.5 minutes on one H100 host, 16 cores): tiny.yaml's first
# training step cold (empty kernel caches) and warm, then the cold compile budget of every
# tiny example for sm_90 and sm_80 on the host's CPUs. JSON into ${OUT:-benchmarks/results}.
#   bash benchmarks/gpu_first_step.sh [PYTHON]
set -u
PY=${1:-python}
OUT=${OUT:-benchmarks/results}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
"$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
timeout 330 "$PY" benchmarks/first_step.py examples/tiny.yaml --timeout 150 \
    --out "$OUT/first_step_h100.json"
timeout 240 "$PY" benchmarks/compile_time.py examples/tiny.yaml examples/tiny_lmm.yaml \
    examples/tiny_attn.yaml examples/tiny_mag.yaml examples/tiny_mal.yaml --arch 90 80 \
    --jobs 16 --out "$OUT/compile_time_h100_host.json"
