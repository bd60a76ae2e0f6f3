"""Pruned models written for other inference engines: GGUF for llama.cpp (``rcpu_bench.export.gguf``)."""
