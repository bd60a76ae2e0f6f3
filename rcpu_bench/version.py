"""The version of rcpu-bench (the one pyproject.toml declares)."""

__version__ = "0.2.1"
