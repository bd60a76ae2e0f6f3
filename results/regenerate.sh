#!/usr/bin/env bash
# Regenerates every committed result store, table and figure: the fixture leaderboard (the smoke matrix with the full
# perplexity protocols, results/leaderboard/matrix.yaml, on stories260K-mha and the GQA original stories260K), the
# fixture's zero-shot run, the calibration-size sweep, the factorial, the real models (the [models] extra; for
# Qwen2.5-Coder-1.5B the [models-large] one) and, where a CUDA GPU is present, SmolLM2-135M on it; then every table
# and figure of results/outputs.txt from the stores.
# Resumable: finished cells are kept; delete a store's records.jsonl to recompute it.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/leaderboard
rcpu-bench run --matrix "$out/matrix.yaml" --results "$out" --quiet
rcpu-bench run --matrix "$out/matrix.yaml" --model '${shared}/models/stories260K' --results "$out" --quiet
# Zero-shot accuracy (all seven tasks, 300 examples each) of stories260K dense and pruned by 20 %.
rcpu-bench run --matrix results/zeroshot/matrix.yaml --results results/zeroshot --quiet
# The calibration-size sweep with held-out reconstruction errors (generalisation tables and figures).
rcpu-bench run --matrix results/ncalib/matrix.yaml --results results/ncalib --quiet
# The factorial experiment: selection × compensation × allocation (+ depth baselines), main effects.
rcpu-bench run --matrix factorial --results results/factorial --quiet
# Real models (the [models] extra; the first use converts each GGUF once): SmolLM2-135M (the paper's comparison, its
# allocations and peers, a TinyStories-calibrated companion) and Gemma-3-270M.
rcpu-bench run --matrix real-smollm2 --results results/real/smollm2 --quiet
rcpu-bench run --matrix real-smollm2-allocation --results results/real/smollm2 --quiet
rcpu-bench run --matrix real-smollm2-peers --results results/real/smollm2 --quiet
rcpu-bench run --matrix real-smollm2-tinystories --results results/real/smollm2-tinystories --quiet
rcpu-bench run --matrix real-gemma3 --results results/real/gemma3 --quiet
# Qwen2.5-Coder-1.5B (the [models-large] extra): attention heads and MLP channels, calibrated on WikiText-2 and on
# Python code; about 15 minutes a cell on 2 idle cores, 34 cells a matrix.
rcpu-bench run --matrix real-qwen2.5-coder-1.5b --results results/real/qwen2.5-coder-1.5b --quiet
rcpu-bench run --matrix real-qwen2.5-coder-1.5b-code --results results/real/qwen2.5-coder-1.5b-code --quiet
# Where a CUDA GPU is present: the SmolLM2-135M perplexities again on it (no zero-shot), for its timings and the
# agreement of the two devices (results/real/smollm2-gpu: the paper's matrix and the searched allocations, on an H200).
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  for matrix in real-smollm2 real-smollm2-allocation; do
    rcpu-bench run --matrix "$matrix" --set device=cuda --set 'eval=[ppl]' --results results/real/smollm2-gpu --quiet
  done
fi
# Every table and figure, from the stores.
grep -v '^#' results/outputs.txt | while read -r command; do eval "$command"; done
