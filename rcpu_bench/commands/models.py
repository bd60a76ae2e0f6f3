"""``rcpu-bench models``: the real pretrained models the harness knows by name (``--model smollm2-135m``), whether
each is installed and converted, and its size; ``--convert`` converts them now (else the first use does)."""

from __future__ import annotations

import argparse

from tabulate import tabulate

from rcpu_bench import console
from rcpu_bench.commands import command
from rcpu_bench.model import real_models


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--convert", metavar="NAME", action="append", choices=[*real_models.MODELS, "all"],
                        help="convert this model now (repeatable; 'all': every installed one)")
    console.add_quiet_option(parser)


def _size(size_bytes: int | None) -> str:
    return f"{size_bytes / 2**20:,.0f} MiB" if size_bytes is not None else "-"


def _parameters(count: int) -> str:
    return f"{count / 1e9:.2f} B" if count >= 1e9 else f"{count / 1e6:.0f} M"


@command()
def run(args: argparse.Namespace) -> int:
    """Convert what was asked (an uninstalled package is an error naming its pip install), then list every model."""
    wanted = args.convert or []
    names = [m.name for m in real_models.MODELS.values() if real_models.installed_version(m)] if "all" in wanted \
        else wanted
    for name in names:
        real_models.resolve(name)
    rows = []
    for model in real_models.MODELS.values():
        state = real_models.status(model)
        installed = state["installed"] or f"no: {model.install}"
        converted = "yes" if state["converted"] else ("-" if not state["installed"] else f"no ({state['problem']})")
        rows.append((model.name, model.title, model.architecture, _parameters(model.parameters),
                     f"{model.distribution} {installed}", f"{model.quantization} GGUF", converted,
                     _size(state["size_bytes"])))
    print(tabulate(rows, headers=["name", "model", "architecture", "parameters", "package", "source", "converted",
                                  "size"]))
    print(f"\nconverted directories: {real_models.cache_dir() / 'models'} (${real_models.CACHE_ENV} moves them); "
          "weights are the GGUF's, dequantized to float32")
    return 0
