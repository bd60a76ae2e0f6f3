"""``rcpu-bench export``: write a saved pruned model (or a model directory) in another engine's format; GGUF for
llama.cpp (:mod:`rcpu_bench.export.gguf`). Also ``prune --export-gguf``'s options and export."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from rcpu_bench import console
from rcpu_bench.commands import command
from rcpu_bench.export.gguf import DTYPES, check_dtype, export_gguf, require_gguf
from rcpu_bench.model.persistence import check_model_argument, load_saved_or_model
from rcpu_bench.plugins import default_registry

FORMATS = ("gguf",)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", required=True, choices=FORMATS, help="output format")
    p.add_argument("--outtype", default="float16", choices=DTYPES,
                   help="type of the matrices (norms and biases stay float32)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output file")
    p.add_argument("model", metavar="DIR", help="directory written by prune --save (or a Llama model directory)")
    p.add_argument("out", metavar="OUT.gguf", help="the file to write")
    console.add_quiet_option(p)


def add_prune_arguments(parser: argparse.ArgumentParser) -> None:
    """``prune``'s ``--export-gguf PATH`` and ``--gguf-outtype``: export the model saved by ``--save``."""
    parser.add_argument("--export-gguf", metavar="PATH", help="also write the saved model (needs --save) as a GGUF "
                        "file for llama.cpp")
    parser.add_argument("--gguf-outtype", default="float16", choices=DTYPES, help="type of --export-gguf's matrices")


def check_export(name: str, out: str, outtype: str, *, overwrite: bool = False, check_model: bool = True) -> None:
    """Everything an export can be refused for without loading the model: the output path, the type, the gguf
    package and (``check_model``) the model argument."""
    check_dtype(outtype)
    require_gguf()
    if Path(out).exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass --overwrite to replace it)")
    if check_model:
        check_model_argument(name, None)


def export_model(name: str, out: str, outtype: str, *, overwrite: bool = False) -> dict[str, Any]:
    """Load ``name`` (a saved pruned directory or a model) in float32 on the CPU and write it to the GGUF ``out``."""
    loaded = load_saved_or_model(name, revision=None, dtype="float32", device="cpu", registry=default_registry())
    return export_gguf(loaded.model, loaded.tokenizer, out, dtype=outtype, name=Path(name).name, overwrite=overwrite)


def describe(summary: dict[str, Any]) -> str:
    """One line about a written GGUF file."""
    widths = ("per-layer widths: heads " + ",".join(map(str, summary["heads"])) + "; kv heads "
              + ",".join(map(str, summary["kv_heads"])) + "; channels " + ",".join(map(str, summary["channels"])))
    return (f"wrote {summary['path']} ({summary['architecture']} architecture, {summary['dtype']}, "
            f"{summary['tensors']} tensors; {widths})")


@command()
def run(args: argparse.Namespace) -> int:
    """Check, load, write, one line about the file."""
    check_export(args.model, args.out, args.outtype, overwrite=args.overwrite)
    print(describe(export_model(args.model, args.out, args.outtype, overwrite=args.overwrite)))
    return 0
