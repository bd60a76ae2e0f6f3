"""An example rcpu-bench plugin package."""
