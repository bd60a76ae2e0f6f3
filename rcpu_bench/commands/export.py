"""``rcpu-bench export``: write a saved pruned model (or a model directory) in another engine's format; GGUF for
llama.cpp (:mod:`rcpu_bench.export.gguf`). Also ``prune --export-gguf``'s options, checks and export.

Everything an export can be refused for that the arguments, the model's config and its saved shapes decide is
refused before a model loads (for ``prune --export-gguf``: before it is pruned and saved): the destination (a new,
writable file that is none of the command's inputs), the family and tensor names, and q8_0's row lengths."""

from __future__ import annotations

import argparse
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rcpu_bench import console
from rcpu_bench.commands import command
from rcpu_bench.export.gguf import (
    DTYPES,
    Q8_0_BLOCK,
    check_dtype,
    check_exportable,
    check_q8_0_rows,
    export_gguf,
    gguf_name,
    gguf_rows,
    require_gguf,
)
from rcpu_bench.model.adapter import decoder_layers, layer_view
from rcpu_bench.model.loading import model_source
from rcpu_bench.model.persistence import check_model_argument, load_saved_or_model, weightless_model
from rcpu_bench.paths import check_not_input, check_output_file
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning.allocation import units_to_prune
from rcpu_bench.pruning.options import PruneConfig
from rcpu_bench.registry import Registry

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


def check_destination(out: str, outtype: str, *, overwrite: bool | None, inputs: Iterable[str | None]) -> None:
    """The type and the gguf package, and the file ``out``: none of the command's ``inputs``, new unless
    ``overwrite`` (None: the command has no ``--overwrite``), and writable (tried by creating and removing a file)."""
    check_dtype(outtype)
    require_gguf()
    check_not_input(out, inputs, "GGUF file")
    check_output_file(out, "GGUF file")
    if Path(out).exists() and not overwrite:
        also = "" if overwrite is None else ", or --overwrite to replace it"
        raise FileExistsError(f"GGUF file {out} already exists; allowed: a new path{also}")


def check_export(name: str, out: str, outtype: str, *, overwrite: bool = False) -> None:
    """Everything the export command can be refused for without loading the model: the destination (the model's own
    files are inputs), the model argument, and what its config and shapes decide (``check_exportable`` on its
    weightless model; a whole-model method's own saved format is refused)."""
    check_destination(out, outtype, overwrite=overwrite, inputs=[model_source(name)])
    check_model_argument(name, None)
    model = weightless_model(name)
    if model is None:
        raise ValueError(f"model {name} was saved by a whole-model method in its own format, which GGUF export does "
                         "not write; allowed: a directory saved by prune --save or a Llama model directory")
    check_exportable(model, outtype)


def check_prune_export(prune: PruneConfig, model_name: str, registry: Registry, *, revision: str | None,
                       trust_remote_code: bool, outtype: str) -> None:
    """What ``prune --export-gguf`` can be refused for before the model is loaded, pruned and saved: a whole-model
    method (it saves its own format), the model's family and tensor names, and for q8_0 the row lengths the options
    give the pruned model (``planned_rows``)."""
    if prune.model_method is not None:
        raise ValueError(f"--export-gguf with the whole-model method {prune.model_method!r}, which saves its own "
                         "format that GGUF export does not write; allowed: a scorer × compensator run")
    model = weightless_model(model_name, revision=revision, trust_remote_code=trust_remote_code)
    rows = gguf_rows(model)
    if outtype == "q8_0":
        check_q8_0_rows({**rows, **planned_rows(model, prune, registry)})


def planned_rows(model: Any, prune: PruneConfig, registry: Registry) -> dict[str, int]:
    """llama.cpp's name → row length of each pruned consumer (o_proj, down_proj) of ``model`` once pruned by
    ``prune``: kept units × unit size under the allocation's per-layer ratios; any multiple of q8_0's block under a
    ``round_to`` of such a multiple. A plan whose widths are chosen on the model (AL-AM, a model allocation) or
    rounded otherwise cannot be known before it runs: ValueError asking for such a round_to."""
    ratios = prune.layer_ratios(registry, len(decoder_layers(model)))
    aligned = prune.round_to and prune.round_to % Q8_0_BLOCK == 0
    if not aligned and (ratios is None or prune.round_to):
        raise ValueError(f"q8_0 needs rows of a multiple of {Q8_0_BLOCK} values, and the kept widths are chosen while "
                         f"pruning (structure={prune.structure!r}, allocation={prune.allocation!r}, "
                         f"round_to={prune.round_to}); allowed: --round-to {Q8_0_BLOCK} (or a multiple), or "
                         "--gguf-outtype float16")
    names = {id(module): name for name, module in model.named_modules()}
    rows = {}
    for index, layer in enumerate(decoder_layers(model)):
        view = layer_view(layer)
        for module in prune.pruned_modules:
            units = view.units(module, prune.gqa_rule)
            n = view.n_units(module, prune.gqa_rule)
            name = gguf_name(f"{names[id(view.projection(module))]}.weight")
            rows[name] = (Q8_0_BLOCK if aligned else
                          (n - units_to_prune(units, n, ratios[index], prune.rounding)) * units.unit_size)
    return rows


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
