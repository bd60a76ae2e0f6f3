#!/bin/bash
# The GPU checks (docs/benchmarks.md, "On a GPU"), from the repository root, with the package's dependencies
# importable: OUT=DIR bash benchmarks/gpu_checks.sh STEP...
# Steps: env (versions), cmp (the 7B layer side by side at 16k and 65k tokens), p7 (a random-init 7B written and
# pruned), p13 (the same at 13B with --offload), smoke (the smoke matrix). Each step has its own time limit; a failed
# step does not stop the others; results go to OUT, the random models to /dev/shm (or /tmp) and are removed.
# A quick check on the CPU: OUT=/tmp/out DEV=cpu SCALE=0.02 LAYERS=2 bash benchmarks/gpu_checks.sh env cmp p7 p13 smoke
set -u
OUT=${OUT:?} DEV=${DEV:-cuda} SCALE=${SCALE:-1.0} PY=${PY:-python3}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 RCPU_BENCH_SHARED=${RCPU_BENCH_SHARED:-$PWD/../shared}
export RCPU_BENCH_DISABLE_PLUGIN_AUTOLOAD=1
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1
W=/dev/shm; [ "$(df --output=avail -k /dev/shm | tail -1)" -gt 40000000 ] || W=/tmp/rcpu-gpu
mkdir -p "$W" "$OUT"
small=(--scale "$SCALE"); [ -n "${LAYERS:-}" ] && small+=(--layers "$LAYERS")
say() { echo "== $(date -u +%T) $*"; }
run() { local limit=$1; shift; say "start ($limit s): $*"; local t0=$SECONDS
        timeout "$limit" "$@"; local rc=$?; say "rc=$rc after $((SECONDS - t0)) s: $1 $2 $3"; }
prune() {  # prune SHAPE OUTFILE [extra options]
  local shape=$1 out=$2; shift 2
  run 120 $PY benchmarks/make_random_llama.py --shape "$shape" --dtype float16 --device "$DEV" "${small[@]}" \
      --out "$W/r$shape"
  run 240 $PY -m rcpu_bench.cli prune --model "$W/r$shape" --dtype float32 --device "$DEV" \
      --calib tinystories:128x128 --ppl "rcpu128[0:256]" --scorer variance --compensator procrustes --ratio 0.2 \
      --out "$OUT/$out" "$@"
  rm -rf "$W/r$shape"
}
for step in "$@"; do case $step in
  env) say env; { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
                  lscpu | grep -E '^Model name|^CPU\(s\)'; free -g | head -2; df -h /dev/shm /tmp | tail -2
                  $PY -c 'import torch, transformers, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, transformers.__version__, torch.cuda.is_available())'
                  git log -1 --format=%H; } 2>&1 | tee "$OUT/env.txt" ;;
  cmp) run 240 $PY benchmarks/compare_stats_vs_activations.py --shape 7b --scale "$SCALE" --tokens 16384 65536 \
           --compensator procrustes --device "$DEV" --repeats 2 --no-rerun --out "$OUT/stats_vs_official_7b_cuda.json" ;;
  p7) prune 7b prune_7b_cuda.jsonl ;;
  p13) prune 13b prune_13b_cuda_offload.jsonl --offload ;;
  smoke) run 240 $PY -m rcpu_bench.cli run --matrix smoke --results "$W/smoke" --set device="$DEV" --quiet
         cp "$W/smoke/records.jsonl" "$OUT/smoke_cuda_records.jsonl" ;;
  *) say "unknown step $step" ;;
esac; done
say done
