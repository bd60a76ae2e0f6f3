"""``rcpu-bench prune``: prune one model with one scorer × compensator, evaluate it, print a summary and optionally
append its record and save the pruned model.

Everything the arguments, the config and the files on disk decide is refused before the model loads: the
experiment (``Experiment.validate``: a saved model directory against its checksums, budgets, calibration), the
destinations (writable, none of the inputs) and the GGUF export. A saved pruned directory is loaded as every other
command loads it (``load_saved_or_model``)."""

from __future__ import annotations

import argparse
import contextlib
import traceback
from functools import partial

from rcpu_bench import paths
from rcpu_bench.commands import INPUT_ERRORS, command, export
from rcpu_bench.data import parse_calib
from rcpu_bench.experiment import DEFAULT_CALIB, DEFAULT_PPL_PROFILES, MODEL, Experiment, add_flags, run_experiment
from rcpu_bench.model.loading import model_source
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import check_not_input, check_output_file, default_model
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning import options
from rcpu_bench.pruning.walk import LayerStep
from rcpu_bench.records import Record, append_record
from rcpu_bench.registry import Method, PluginContractError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="local model directory or Hugging Face hub id "
                   "(default: the stories260K-mha fixture in the shared directory)")
    add_flags(p, MODEL)
    options.add_arguments(p)
    p.add_argument("--calib", default=DEFAULT_CALIB,
                   help="calibration data SOURCE[:NxSEQLEN][:seed=S]; sources wikitext2, tinystories, file:PATH")
    p.add_argument("--ppl", action="append", default=None, metavar="PROFILE",
                   help="perplexity profile(s): rcpu128, std2048, tinystories, tinystories[START:STOP] "
                        f"(default: {', '.join(DEFAULT_PPL_PROFILES)})")
    add_flags(p, ["eval_batch_size"])
    p.add_argument("--data-dir", help="data directory (default: $RCPU_BENCH_DATA or ../shared/data)")
    p.add_argument("--save", metavar="DIR", help="save the pruned model (safetensors + shape manifest)")
    p.add_argument("--out", metavar="JSONL", help="append the result record to this file")
    export.add_prune_arguments(p)
    p.add_argument("--quiet", action="store_true", help="no progress bars")


def summary(record: Record) -> str:
    """Parameters before and after, pruning time and peak memory, and each perplexity."""
    params = record.parameters
    lines = [f"parameters: {params.before:,} -> {params.after:,} ({params.removed_fraction:.2%} removed)",
             f"pruning time: {sum(record.timing.prune_seconds.values()):.1f} s, "
             f"peak memory {record.peak_memory_bytes / 2**20:.0f} MiB"]
    lines += [f"ppl[{p.profile}] = {p.ppl:.4f}  ({p.n_windows} windows, {p.n_tokens:,} tokens, seqlen {p.seqlen})"
              for p in record.perplexity]
    return "\n".join(lines)


def inputs(experiment: Experiment) -> list[str | None]:
    """What a run reads and no output may be: the model (its directory), the calibration file and the data
    directory."""
    source = parse_calib(experiment.calib).source
    data = experiment.data_dir
    if data is None:
        with contextlib.suppress(FileNotFoundError):  # no shared fixtures: no default data directory to protect
            data = str(paths.data_dir())
    return [model_source(experiment.model), source.removeprefix("file:") if source.startswith("file:") else None, data]


def check_destinations(experiment: Experiment, args: argparse.Namespace) -> None:
    """``--out`` and ``--export-gguf``: writable and none of the run's inputs (``--save`` is a new or empty
    directory, checked by ``Experiment.validate``); the GGUF export's feasibility."""
    read = inputs(experiment)
    if args.out:
        check_not_input(args.out, read, "--out file")
        check_output_file(args.out, "--out file")
    if args.export_gguf:
        if not args.save:
            raise ValueError("--export-gguf needs --save DIR (the GGUF file is written from the saved model)")
        export.check_destination(args.export_gguf, args.gguf_outtype, overwrite=False,
                                 inputs=[*read, args.out, args.save])
        export.check_prune_export(experiment.prune, experiment.model, default_registry(), revision=args.revision,
                                  trust_remote_code=args.trust_remote_code, outtype=args.gguf_outtype)


def method_failure(error: BaseException) -> str | None:
    """One line naming the registered method whose call failed with ``error`` and the decoder layer being pruned
    (read from the traceback: the innermost method call, the layer walk's step or index), or None for bad input
    (already one line) or when no registered method was running: a plugin that fails on a real layer is reported
    like bad input, not as a crash."""
    if isinstance(error, INPUT_ERRORS):
        return None
    method, layer = None, None
    for frame, _ in traceback.walk_tb(error.__traceback__):
        step = frame.f_locals.get("step")
        if isinstance(step, LayerStep) or frame.f_code.co_name == "walk_layers":
            layer = step.index if isinstance(step, LayerStep) else frame.f_locals.get("index")
        if frame.f_code.co_name == "__call__" and isinstance(frame.f_locals.get("self"), Method):
            method = frame.f_locals["self"]
    where = "" if layer is None else f" on layer {layer}"
    if isinstance(error, PluginContractError):
        return f"{error}{where}"
    if method is None:
        return None
    return f"{method.kind} {method.name!r} from {method.provider} failed{where}: {type(error).__name__}: {error}"


@command()
def run(args: argparse.Namespace) -> int:
    """Run the experiment and print its summary."""
    experiment = Experiment(model=args.model or default_model(), prune=options.from_args(args), calib=args.calib,
                            ppl_profiles=tuple(args.ppl or DEFAULT_PPL_PROFILES), revision=args.revision,
                            dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                            eval_batch_size=args.eval_batch_size, data_dir=args.data_dir, save_dir=args.save)
    check_destinations(experiment, args)
    # Validated whole before any work; the record is appended before the save, so a failing save keeps it.
    try:
        record = run_experiment(experiment, progress=not args.quiet,
                                load=partial(load_saved_or_model, registry=default_registry()),
                                keep_record=partial(append_record, args.out) if args.out else None)
    except Exception as error:
        line = method_failure(error)
        if line is None:
            raise
        raise ValueError(line) from error
    print(summary(record))
    if args.out:
        print(f"record appended to {args.out}")
    if args.save:
        print(f"pruned model saved to {args.save}")
    if args.export_gguf:
        print(export.describe(export.export_model(args.save, args.export_gguf, args.gguf_outtype)))
    return 0
