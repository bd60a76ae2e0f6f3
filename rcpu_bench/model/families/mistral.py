"""Mistral: Llama's layers; sliding-window attention (a mask, the same per head) changes nothing for pruning."""

from rcpu_bench.model.llama import Family

MISTRAL = Family("Mistral", ("mistral",))
