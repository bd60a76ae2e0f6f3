"""Every test runs offline: any accidental Hugging Face hub access fails fast instead of retrying."""

import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"
