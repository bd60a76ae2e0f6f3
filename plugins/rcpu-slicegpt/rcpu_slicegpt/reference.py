"""Which SliceGPT runs: the reference package (microsoft/TransformerCompression) or this one.

The reference is used only when ``import slicegpt`` works AND the transformers requirement that its
distribution declares admits the installed transformers version. The reference pins transformers 4.41,
while rcpu-bench needs transformers >= 4.48, so in a working rcpu-bench environment this package's own
implementation (``rcpu_slicegpt.slicing``) is the one that runs.
"""

from __future__ import annotations

import importlib
import importlib.metadata
from typing import Any

import torch
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from torch import Tensor, nn

from rcpu_bench.model import parameter_count
from rcpu_slicegpt.slicing import parameter_report

MODULE = "slicegpt"


def _transformers_requirement(module: str) -> Requirement | None:
    """The (unconditional) transformers requirement declared by the distribution that provides ``module``."""
    for dist in importlib.metadata.packages_distributions().get(module, []):
        for line in importlib.metadata.requires(dist) or []:
            requirement = Requirement(line)
            if canonicalize_name(requirement.name) == "transformers" and (
                    requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                return requirement
    return None


def reference_status(module: str = MODULE) -> tuple[bool, str]:
    """(use the reference?, why): true only if ``module`` imports and its transformers pin admits the installed one."""
    try:
        importlib.import_module(module)
    except Exception as error:  # noqa: BLE001 - any failure (missing, broken, incompatible) means unusable
        return False, f"import {module} fails ({type(error).__name__}: {error})"
    requirement = _transformers_requirement(module)
    installed = importlib.metadata.version("transformers")
    if requirement is None:
        return False, f"{module} declares no transformers requirement to check against transformers {installed}"
    if not requirement.specifier.contains(installed, prereleases=True):
        return False, f"{module} requires {requirement}, but transformers {installed} is installed"
    return True, f"{module} requires {requirement}, which admits the installed transformers {installed}"


def slice_with_reference(model: nn.Module, calib_ids: Tensor, dim: int, *, batch_size: int) -> dict[str, Any]:
    """Slice ``model`` to ``dim`` with the reference's own replace_layers → fuse_modules → rotate_and_slice (PCA
    final orientation). Only called when ``reference_status()`` is true; not exercisable in this environment."""
    from slicegpt import layernorm_fusion, rotate
    from slicegpt.adapters.llama_adapter import LlamaModelAdapter
    from slicegpt.slicing_scheduler import ConstSlicingScheduler

    dense = parameter_count(model)
    adapter = LlamaModelAdapter(model)
    layernorm_fusion.replace_layers(adapter)
    layernorm_fusion.fuse_modules(adapter)
    batches = [{"input_ids": ids, "attention_mask": torch.ones_like(ids)} for ids in calib_ids.split(batch_size)]
    rotate.rotate_and_slice(adapter, batches, ConstSlicingScheduler(dim), final_orientation="pca")
    return {"method": "slicegpt", "implementation": "slicegpt (microsoft/TransformerCompression)",
            "hidden_size": model.config.hidden_size, "sliced_hidden_size": dim,
            "sliced_fraction": 1 - dim / model.config.hidden_size,
            "parameters": parameter_report(dense, parameter_count(model))}
