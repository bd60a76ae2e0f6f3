"""What the subcommands that load models check first: the dtype, the device and each model argument."""

from __future__ import annotations

import argparse

from rcpu_bench.model.loading import check_device, resolve_dtype
from rcpu_bench.model.persistence import check_model_argument


def check_models(names: list[str], args: argparse.Namespace) -> None:
    """Reject a bad ``--dtype`` or ``--device`` and any bad model argument (``check_model_argument``), before
    anything is loaded: what every command that loads models checks first."""
    resolve_dtype(args.dtype)
    check_device(args.device)
    for name in names:
        check_model_argument(name, args.revision, args.trust_remote_code)
