"""``rcpu-bench prune``: prune one model with one scorer × compensator, evaluate it, print a summary and optionally
append its record and save the pruned model.

Everything the arguments, the config and the files on disk decide is refused before the model loads: the
experiment (``Experiment.validate``: a saved model directory against its checksums, budgets, calibration), the
destinations (writable, none of the inputs) and the GGUF export. A saved pruned directory is loaded as every other
command loads it (``load_saved_or_model``)."""

from __future__ import annotations

import argparse
import contextlib
from functools import partial
from pathlib import Path

from rcpu_bench import paths
from rcpu_bench.commands import INPUT_ERRORS, command, export
from rcpu_bench.data import parse_calib
from rcpu_bench.declaration import add_argument
from rcpu_bench.experiment import DEFAULT_CALIB, DEFAULT_PPL_PROFILES, MODEL, Experiment, add_flags, run_experiment
from rcpu_bench.matrix.spec import BY_KEY
from rcpu_bench.model import real_models
from rcpu_bench.model.loading import model_source
from rcpu_bench.model.manifest import CARD
from rcpu_bench.model.persistence import load_saved_or_model
from rcpu_bench.paths import check_not_input, check_output_file, default_model
from rcpu_bench.plugins import default_registry
from rcpu_bench.pruning import options
from rcpu_bench.pruning.methods import method_label
from rcpu_bench.records import Record, append_record
from rcpu_bench.registry import failed_method
from rcpu_bench.tracking.content import prune_run
from rcpu_bench.tracking.trackers import open_trackers


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
    add_argument(p, BY_KEY["report_to"])  # a matrix's report_to, as a flag
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
    model = (str(real_models.model_dir(real_models.get(experiment.model))) if experiment.model in real_models.MODELS
             else model_source(experiment.model))  # where a real model is converted to, without converting it now
    return [model, source.removeprefix("file:") if source.startswith("file:") else None, data]


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
        export.check_destination(args.export_gguf, args.gguf_outtype, overwrite=None,
                                 inputs=[*read, args.out, args.save])
        export.check_prune_export(experiment.prune, experiment.model, default_registry(), revision=args.revision,
                                  trust_remote_code=args.trust_remote_code, outtype=args.gguf_outtype)


def run_name(experiment: Experiment) -> str:
    """A tracker's name for the run: method, model (a directory by its name) and ratio."""
    model = Path(experiment.model).name if Path(experiment.model).exists() else experiment.model
    return f"{method_label(experiment.prune.to_dict())} | {model} | ρ={experiment.prune.ratio:g}"


@command()
def run(args: argparse.Namespace) -> int:
    """Run the experiment and print its summary."""
    experiment = Experiment(model=args.model or default_model(), prune=options.from_args(args), calib=args.calib,
                            ppl_profiles=tuple(args.ppl or DEFAULT_PPL_PROFILES), revision=args.revision,
                            dtype=args.dtype, device=args.device, trust_remote_code=args.trust_remote_code,
                            eval_batch_size=args.eval_batch_size, data_dir=args.data_dir, save_dir=args.save)
    check_destinations(experiment, args)
    trackers = open_trackers(args.report_to, local_dir=Path(args.out).resolve().parent if args.out else None,
                             local_flag="--out FILE")
    # Validated whole before any work; the record is appended before the save, so a failing save keeps it.
    try:
        record = run_experiment(experiment, progress=not args.quiet,
                                load=partial(load_saved_or_model, registry=default_registry()),
                                keep_record=partial(append_record, args.out) if args.out else None)
    except Exception as error:
        line = None if isinstance(error, INPUT_ERRORS) else failed_method(error)  # bad input: already one line
        if line is None:
            raise
        raise ValueError(line) from error
    print(summary(record))
    if args.out:
        print(f"record appended to {args.out}")
    if args.save:
        print(f"pruned model saved to {args.save}")
    if trackers:  # after the record is appended and the model saved
        card = Path(args.save) / CARD if args.save else None
        trackers.log(prune_run(record.to_json(), name=run_name(experiment),
                               model_card=card if card and card.is_file() else None))
        for line in trackers.where():
            print(line)
    if args.export_gguf:
        print(export.describe(export.export_model(args.save, args.export_gguf, args.gguf_outtype)))
    return 0
