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
# The calibration-size sweep with held-out reconstruction errors (generalisation tables and figures).
rcpu-bench run --matrix results/ncalib/matrix.yaml --results results/ncalib --quiet
rcpu-bench tables --results results/ncalib --table generalisation --out results/ncalib/generalisation.md
rcpu-bench tables --results results/ncalib --table ppl --profile "tinystories[500:530]" --out results/ncalib/tables.md
rcpu-bench plots --results results/ncalib --profile "tinystories[500:530]" --out-dir results/ncalib/plots
# The factorial experiment: selection × compensation × allocation (+ depth baselines), main effects.
rcpu-bench run --matrix factorial --results results/factorial --quiet
rcpu-bench tables --results results/factorial --table main-effects --out results/factorial/main-effects.md
rcpu-bench tables --results results/factorial --table ppl-other --out results/factorial/tables.md
rcpu-bench plots --results results/factorial --out-dir results/factorial/plots
# Real models (the [models] extra; the first use converts each GGUF once): SmolLM2-135M (the paper's comparison, its
# allocations, a TinyStories-calibrated companion) and Gemma-3-270M; every table (the ranking with paired bootstrap
# intervals among them) on each perplexity profile, and the figures.
rcpu-bench run --matrix real-smollm2 --results results/real/smollm2 --quiet
rcpu-bench run --matrix real-smollm2-allocation --results results/real/smollm2 --quiet
rcpu-bench run --matrix real-smollm2-peers --results results/real/smollm2 --quiet
rcpu-bench run --matrix real-smollm2-tinystories --results results/real/smollm2-tinystories --quiet
rcpu-bench run --matrix real-gemma3 --results results/real/gemma3 --quiet
for store in smollm2 smollm2-tinystories gemma3; do
  wikitext="rcpu128[0:256]"
  stories="tinystories[500:600]"
  [ "$store" = gemma3 ] && wikitext="rcpu128-bos[0:128]" && stories="tinystories[500:550]"
  rcpu-bench tables --results "results/real/$store" --table all --profile "$wikitext" --out "results/real/$store/tables.md"
  rcpu-bench tables --results "results/real/$store" --table all --profile "$stories" \
      --out "results/real/$store/tables-tinystories.md"
  rcpu-bench plots --results "results/real/$store" --profile "$wikitext" --out-dir "results/real/$store/plots"
done
# Where a CUDA GPU is present: the SmolLM2-135M perplexities again on it (no zero-shot), for its timings and the
# agreement of the two devices (results/real/smollm2-gpu: the paper's matrix and the searched allocations, on an H200).
if python -c "import sys, torch; sys.exit(not torch.cuda.is_available())"; then
  for matrix in real-smollm2 real-smollm2-allocation; do
    rcpu-bench run --matrix "$matrix" --set device=cuda --set 'eval=[ppl]' --results results/real/smollm2-gpu --quiet
  done
fi
