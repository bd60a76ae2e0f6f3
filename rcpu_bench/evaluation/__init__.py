"""Evaluation of a (pruned) model: perplexity, zero-shot accuracy through lm-eval, inference speed, greedy text."""

EVAL_BATCH_SIZE = 8  # sequences per evaluation forward pass: the default of every command's --eval-batch-size
