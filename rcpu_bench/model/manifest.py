"""The manifest of a saved pruned model (``rcpu_manifest.json``) and the checks every command runs on it first.

The manifest holds the shape of every layer (query/kv heads, head size, intermediate size, o_proj/down_proj
biases), the parameter count, the kind of config written, the method, the provenance and the sha256 of the weights
file and of config.json (``"sha256": {file: hex digest}``). ``check_saved`` verifies both before anything in the
directory is read; a directory of an earlier format is refused, naming ``rcpu-bench migrate``, which converts it
(``rcpu_bench.model.migrate``), and one that rcpu-bench saved (its config class, model card or model source files say
so) but whose manifest is gone is refused (``pruned_directory``): deleting the manifest does not turn the checks off.
"""

from __future__ import annotations

import functools
import json
import logging
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from transformers import PreTrainedModel

from rcpu_bench.atomic_file import file_sha256
from rcpu_bench.model.adapter import model_view
from rcpu_bench.model.hf_format import RcpuPrunedConfig
from rcpu_bench.model.hf_format.modeling_rcpu_pruned import SOURCE_FILES
from rcpu_bench.model.loading import model_source, parameter_count
from rcpu_bench.model.model_card import TITLE
from rcpu_bench.model.views import MODULES
from rcpu_bench.paths import inside
from rcpu_bench.records import library_versions

FORMAT = "rcpu-bench-pruned"
FORMAT_VERSION = 4  # 4: config.json's sha256 recorded too; earlier versions: rcpu_bench.model.migrate
MANIFEST = "rcpu_manifest.json"
WEIGHTS = "model.safetensors"
CONFIG = "config.json"
CARD = "README.md"
SAVED_CONFIG_TYPES = (RcpuPrunedConfig.model_type, "rcpu_llama")  # config.json model types only rcpu-bench writes
MIGRATE = "convert it with `rcpu-bench migrate {directory}`"

log = logging.getLogger(__name__)


def layer_records(model: PreTrainedModel) -> list[dict[str, Any]]:
    """Per decoder layer: its geometry and whether its attention / MLP consumers (o_proj, down_proj) have a bias."""
    return [{**asdict(view.geometry), **{view.bias_key(m): view.projection(m).bias is not None for m in MODULES}}
            for view in model_view(model).views()]


def build_manifest(model: PreTrainedModel, method: dict | None = None, provenance: dict | None = None,
                   config_kind: str = "original") -> dict:
    """The manifest describing ``model``'s pruned shape and the kind of config.json saved with it."""
    return {"format": FORMAT, "format_version": FORMAT_VERSION, "weights": WEIGHTS, "config": config_kind,
            "model_type": model.config.model_type,
            "parameter_count": parameter_count(model), "layers": layer_records(model),
            "method": method or {}, "provenance": provenance or {}, "saved_with": library_versions()}


def weights_file(directory: Path, name: Any) -> Path:
    """The manifest's ``weights`` file: a relative name of a safetensors file that stays inside ``directory`` (else
    ValueError)."""
    path = directory / str(name)
    if (not isinstance(name, str) or not name or Path(name).is_absolute() or not inside(path, directory)
            or Path(name).suffix != ".safetensors"):
        raise ValueError(f"{directory / MANIFEST}: weights {name!r} is not allowed; allowed: the name of a "
                         f".safetensors file inside {directory}")
    if not path.is_file():
        raise FileNotFoundError(f"{directory / MANIFEST} names the weights file {name!r}, which is missing")
    return path


def recorded_sha256(manifest: dict[str, Any], where: Path) -> str | None:
    """The sha256 the manifest at ``where`` records for its ``weights`` file (which must lie in the manifest's
    directory); None for a format that records none (a model method's own, written before its checksums)."""
    weights_file(where.parent, manifest.get("weights"))
    checksums = manifest.get("sha256")
    if checksums is None:
        return None
    if not isinstance(checksums, dict) or not isinstance(checksums.get(manifest.get("weights")), str):
        raise ValueError(f"{where}: sha256 records no checksum for the weights file {manifest.get('weights')!r}")
    return checksums[manifest["weights"]]


def verify_checksum(path: Path, expected: str | None) -> None:
    """Compare ``path``'s sha256 with the manifest's; a format that records none is loaded with a warning."""
    if expected is None:
        warn_once(f"{path} has no recorded sha256 (saved before its format recorded checksums): a corrupted or "
                  "replaced file would load unnoticed; save it again to record them")
        return
    found = file_sha256(path)
    if found != expected:
        raise ValueError(f"{path} is corrupted or was replaced: its sha256 is {found}, the manifest records "
                         f"{expected}")


@functools.cache
def warn_once(message: str) -> None:
    """Log ``message`` as a warning once per process: a directory is checked before it loads and again as it loads."""
    log.warning(message)


def check_config_checksum(directory: Path, manifest: dict[str, Any]) -> None:
    """Compare config.json's sha256 with the one the manifest records (a missing one is an error)."""
    checksums = manifest.get("sha256")
    expected = checksums.get(CONFIG) if isinstance(checksums, dict) else None
    if expected is None:
        raise ValueError(f"{directory / MANIFEST}: sha256 records no checksum for {CONFIG}; allowed: the manifest as "
                         "save_pruned wrote it")
    path = directory / CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"{directory} has no {CONFIG}; allowed: the directory as save_pruned wrote it")
    verify_checksum(path, expected)


def check_saved(directory: Path, manifest: dict[str, Any]) -> None:
    """Verify a ``save_pruned`` directory against its manifest before anything in it is read: the weights file (a
    safetensors file inside it) and config.json by their sha256. Every command that loads such a directory calls
    this, through ``load_pruned`` and ``check_model_argument``."""
    check_config_checksum(directory, manifest)
    verify_checksum(weights_file(directory, manifest.get("weights")), recorded_sha256(manifest, directory / MANIFEST))


def read_manifest(directory: str | os.PathLike) -> dict:
    """The manifest of a directory written by ``save_pruned``, checked for format and version."""
    path = Path(directory) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: {directory} was not written by save_pruned "
                                "(load an unpruned checkpoint with rcpu_bench.model.loading.load_model)")
    manifest = read_json_manifest(path)
    check_format(manifest, path)
    return manifest


def check_format(manifest: dict[str, Any], path: Path) -> None:
    """ValueError unless the manifest at ``path`` is ``save_pruned``'s, of the version this rcpu-bench reads; an
    earlier version's message names the command that converts it."""
    version = manifest.get("format_version")
    if manifest.get("format") == FORMAT and isinstance(version, int) and 0 < version < FORMAT_VERSION:
        raise ValueError(f"{path.parent} was saved by an earlier rcpu-bench (format version {version}; this release "
                         f"reads version {FORMAT_VERSION}): {MIGRATE.format(directory=path.parent)}")
    if manifest.get("format") != FORMAT or version != FORMAT_VERSION:
        raise ValueError(f"{path} has format {manifest.get('format')!r} version {version!r}; supported: {FORMAT!r} "
                         f"version {FORMAT_VERSION}")


def read_json_manifest(path: Path) -> dict[str, Any]:
    """The JSON object of a manifest file; anything else is a one-line ValueError naming it."""
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not a valid manifest ({error}); allowed: the manifest as it was saved") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{path} is not a valid manifest (a JSON {type(manifest).__name__}); allowed: the manifest "
                         "as it was saved")
    return manifest


def saved_by_model_method(manifest: dict[str, Any]) -> bool:
    """Whether a manifest is a whole-model method's (its own saver and loader), not ``save_pruned``'s."""
    return manifest.get("format") != FORMAT and "model_method" in manifest


def saved_marker(directory: Path) -> str | None:
    """What shows that rcpu-bench saved ``directory`` (its config class, model card or model source files), or None."""
    config = directory / CONFIG
    try:
        model_type = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    except (OSError, ValueError, AttributeError):
        model_type = None
    if model_type in SAVED_CONFIG_TYPES:
        return f"{CONFIG} has model_type {model_type!r}"
    card = directory / CARD
    if card.is_file() and TITLE in card.read_text(errors="replace").splitlines()[:40]:
        return f"{CARD} is an rcpu-bench model card"
    sources = [name for name in SOURCE_FILES if (directory / name).is_file()]
    return f"it holds {', '.join(sources)}" if sources else None


def pruned_directory(name: str) -> Path | None:
    """``name`` as a directory written by ``save_pruned`` or a model method's saver (it has a manifest), or None; a
    directory rcpu-bench saved (``saved_marker``) whose manifest is missing is a ValueError: without it nothing in it
    can be verified."""
    path = Path(name).expanduser()
    if (path / MANIFEST).is_file():
        return path
    marker = saved_marker(path) if path.is_dir() else None
    if marker is not None:
        raise ValueError(f"model directory {path} was saved by rcpu-bench ({marker}) but its {MANIFEST} is missing, "
                         "so its weights and config cannot be verified; allowed: the directory with the manifest it "
                         "was saved with (or the model saved again with --save)")
    return None


def check_saved_model(name: str) -> tuple[Path, dict[str, Any]] | None:
    """The saved directory ``name`` means (``pruned_directory``) and its manifest, verified (``check_saved``; a model
    method's directory is verified by its own loader), or None for any other model."""
    directory = pruned_directory(model_source(name))
    if directory is None:
        return None
    manifest = read_json_manifest(directory / MANIFEST)
    if not saved_by_model_method(manifest):
        check_format(manifest, directory / MANIFEST)
        check_saved(directory, manifest)
    return directory, manifest
