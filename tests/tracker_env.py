"""Test helpers: an environment in which the experiment trackers run offline, with their files under a test's
directory and made-up secrets set where a tracker or the Hugging Face libraries would look for them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from rcpu_bench.plugins import DISABLE_AUTOLOAD

# Made-up credentials: none of them may appear in a record, a log line or a tracker's files.
SECRETS = {"WANDB_API_KEY": "wandb0secret0key0" + "7" * 23, "MLFLOW_TRACKING_TOKEN": "mlflow-secret-token-5e3c",
           "MLFLOW_TRACKING_PASSWORD": "mlflow-secret-password-9d1", "HF_TOKEN": "hf_secretTokenQx81Zr0pLm"}
CLEARED = ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_DIR", "WANDB_PROJECT", "WANDB_ENTITY",
           "WANDB_RUN_GROUP")


def offline(env: pytest.MonkeyPatch, root: Path) -> None:
    """No tracker configuration from the machine; W&B offline, its own cache, config and data under ``root``; no
    telemetry or error reports; the built-in methods only; the made-up :data:`SECRETS` set."""
    for name in CLEARED:
        env.delenv(name, raising=False)
    for name in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR"):
        env.setenv(name, str(root / "wandb-home" / name.lower()))
    env.setenv("WANDB_MODE", "offline")
    env.setenv("WANDB_ERROR_REPORTING", "false")
    env.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    env.setenv(DISABLE_AUTOLOAD, "1")
    for name, value in SECRETS.items():
        env.setenv(name, value)
    fresh_wandb()


def fresh_wandb() -> None:
    """W&B reads its environment once per process (``wandb.setup``): tear that down, so that the next run reads the
    environment a test set (an earlier test's WANDB_MODE would be kept otherwise)."""
    wandb = sys.modules.get("wandb")
    if wandb is not None:
        wandb.teardown()
