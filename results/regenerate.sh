#!/usr/bin/env bash
# Regenerates the committed leaderboard in results/leaderboard: the smoke matrix with the full perplexity
# protocols (results/leaderboard/matrix.yaml) on stories260K-mha (the matrix's own model) and on the GQA
# original stories260K, then the tables and plots from the records.
# Resumable: finished cells are kept; delete results/leaderboard/records.jsonl to recompute everything.
set -euo pipefail
cd "$(dirname "$0")/.."
out=results/leaderboard
rcpu-bench run --matrix "$out/matrix.yaml" --results "$out" --quiet
rcpu-bench run --matrix "$out/matrix.yaml" --model '${shared}/models/stories260K' --results "$out" --quiet
for format in md latex csv; do
  rcpu-bench tables --results "$out" --table all --format "$format" --out "$out/tables.$format"
done
rcpu-bench tables --results "$out" --table ppl --profile "tinystories[500:1000]" --out "$out/tables-tinystories.md"
rcpu-bench plots --results "$out" --out-dir "$out/plots"
# Zero-shot accuracy (all seven tasks, 300 examples each) of stories260K dense and pruned by 20 %.
rcpu-bench run --matrix results/zeroshot/matrix.yaml --results results/zeroshot --quiet
rcpu-bench tables --results results/zeroshot --table zeroshot --out results/zeroshot/tables.md
# The factorial experiment: selection × compensation × allocation (+ depth baselines), main effects.
rcpu-bench run --matrix factorial --results results/factorial --quiet
rcpu-bench tables --results results/factorial --table main-effects --out results/factorial/main-effects.md
rcpu-bench tables --results results/factorial --table ppl-other --out results/factorial/tables.md
rcpu-bench plots --results results/factorial --out-dir results/factorial/plots
