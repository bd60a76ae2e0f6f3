"""The model families the harness prunes, one module each: a ``Family`` (``rcpu_bench.model.llama``) as data.

To add a Llama-like family: a module here with its ``Family`` (the config model types it covers and how
its layers differ from Llama's), listed in ``FAMILIES``, and its tiny model in ``tests/test_families.py``.
``REFUSED`` names the model types refused up front and why.
"""

from rcpu_bench.model.families.gemma import GEMMA2, GEMMA3
from rcpu_bench.model.families.granite import GRANITE
from rcpu_bench.model.families.mistral import MISTRAL
from rcpu_bench.model.families.moe import REFUSED
from rcpu_bench.model.families.olmo import OLMO, OLMO2
from rcpu_bench.model.families.phi3 import PHI3
from rcpu_bench.model.families.qwen import QWEN2, QWEN3
from rcpu_bench.model.llama import LLAMA, Family

FAMILIES: tuple[Family, ...] = (LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3, OLMO, OLMO2, GRANITE, PHI3)

__all__ = ["FAMILIES", "REFUSED", "Family"]
