"""lm-eval task configurations ``rcpu_<task>``: the built-in zero-shot tasks on the local data files.

Each YAML copies its built-in task's prompt fields, choices, metrics and version verbatim and reads
the shared zero-shot files through ``utils.read_local``; ``utils`` converts the documents back to the
built-in's fields. ``rcpu_bench.evaluation.zeroshot`` builds the configs from these files.
"""
