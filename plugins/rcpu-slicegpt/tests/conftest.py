"""Shared fixtures: offline runs, the stories260K fixture models, calibration windows, an exact float64 norm."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch
from slicegpt_helpers import STORIES
from transformers.models.llama import modeling_llama

from rcpu_bench import data
from rcpu_bench.model.loading import load_model
from rcpu_bench.paths import shared_dir


@pytest.fixture(scope="session")
def stories():
    """name → LoadedModel for both fixture models (tests work on deep copies)."""
    return {name: load_model(str(shared_dir() / "models" / name)) for name in STORIES}


@pytest.fixture(scope="session")
def calib_ids(stories):
    """16 windows of 64 TinyStories tokens (stories 0–499, disjoint from the evaluation stories)."""
    return data.calibration_data("tinystories:16x64", stories["stories260K"].tokenizer).tokens


@pytest.fixture
def exact_llama_norm(monkeypatch):
    """Hugging Face's LlamaRMSNorm rounds to float32 inside; the float64 reference uses the exact formula."""
    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))
    monkeypatch.setattr(modeling_llama.LlamaRMSNorm, "forward", forward)
