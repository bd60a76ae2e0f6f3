"""The peers' methods, each in a package of its own and registered through the same hooks as a third-party plugin:
Týr-the-Pruner's searched allocation (``search``), the depth baselines ShortGPT and ReplaceMe (``depth``), Olica's and
SlimLLM's refits (``olica``, ``slimllm``) and Minitron's importance score (``minitron``). The harness's own algorithm
stays in ``rcpu_bench.pruning`` and ``rcpu_bench.compensation``."""
