"""Saved directories are verified the same way by every command (weights and config.json by their checksums, a
missing manifest refused), no output destroys an input or another writer's output, a failed or interrupted write
leaves nothing torn, and outputs follow the user's umask."""

from __future__ import annotations

import copy
import errno
import json
import os
import signal
import stat
from pathlib import Path

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from test_bad_inputs import QUICK, assert_one_line_error, run
from tiny_models import STORIES, STORIES_MHA, apply_plan, needs_stories, random_plan, tiny_config, tiny_model

from rcpu_bench import atomic_file, records
from rcpu_bench.atomic_file import write_atomically, write_file_atomically
from rcpu_bench.model import loading, persistence
from rcpu_bench.model.manifest import MANIFEST, pruned_directory
from rcpu_bench.model.persistence import save_pruned

COMMANDS = {"prune": ["prune", *QUICK], "generate": ["generate", "--prompt", "Once", "--max-new-tokens", "2"],
            "speed": ["speed"], "eval": ["eval", "--tasks", "piqa", "--limit", "2"]}


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fail the test if weights are read, by any loader (a saved directory's too): the error must come before."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the bad input was reported")

    monkeypatch.setattr(loading.AutoModelForCausalLM, "from_pretrained", refuse)
    monkeypatch.setattr(persistence, "materialize", refuse)


@pytest.fixture
def saved(tmp_path, stories_260k) -> Path:
    """stories260K-mha with per-layer widths (an RcpuPrunedConfig), saved with its tokenizer."""
    dense = stories_260k["mha"]
    model = copy.deepcopy(dense.model)
    save_pruned(apply_plan(model, random_plan(model, seed=2)), tmp_path / "saved", tokenizer=dense.tokenizer)
    return tmp_path / "saved"


def edit_json(path: Path, edit) -> None:
    content = json.loads(path.read_text())
    edit(content)
    path.write_text(json.dumps(content))


def zero_weights(directory: Path) -> None:
    tensors = {name: torch.zeros_like(tensor) for name, tensor in load_file(directory / "model.safetensors").items()}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})


# ------------------------------------------------------------------------------------- saved directories


@needs_stories
@pytest.mark.parametrize("command", list(COMMANDS))
@pytest.mark.parametrize("damage, needles", [
    (zero_weights, ["model.safetensors is corrupted or was replaced"]),
    (lambda d: edit_json(d / "config.json", lambda c: c["base_config"].update(rope_theta=99.0)),
     ["config.json is corrupted or was replaced"]),
    (lambda d: (d / MANIFEST).unlink(), ["was saved by rcpu-bench", "rcpu_manifest.json is missing"]),
    (lambda d: edit_json(d / MANIFEST, lambda m: m["sha256"].pop("config.json")),
     ["sha256 records no checksum for config.json"]),
    (lambda d: edit_json(d / MANIFEST, lambda m: m.update(weights="tokenizer.json")),
     ["weights 'tokenizer.json' is not allowed; allowed: the name of a .safetensors file"]),
])
def test_every_command_verifies_a_saved_directory_before_loading(saved, command, damage, needles, capsys,
                                                                 nothing_loads):
    damage(saved)
    code, err = run([COMMANDS[command][0], "--model", str(saved), *COMMANDS[command][1:]], capsys)
    assert_one_line_error(code, err, *needles)


@needs_stories
def test_export_verifies_a_saved_directory_before_loading(saved, tmp_path, capsys, nothing_loads):
    zero_weights(saved)
    code, err = run(["export", "--format", "gguf", str(saved), str(tmp_path / "m.gguf")], capsys)
    assert_one_line_error(code, err, "model.safetensors is corrupted or was replaced")
    assert not (tmp_path / "m.gguf").exists()


@needs_stories
@pytest.mark.parametrize("keep, marker", [
    ("config.json", "config.json has model_type 'rcpu_pruned'"),
    ("README.md", "README.md is an rcpu-bench model card"),
    ("modeling_rcpu_pruned.py", "it holds modeling_rcpu_pruned.py"),
])
def test_a_saved_directory_without_its_manifest_is_refused_by_any_of_its_marks(saved, tmp_path, keep, marker):
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / keep).write_bytes((saved / keep).read_bytes())
    with pytest.raises(ValueError, match=f"saved by rcpu-bench \\({marker}\\) but its rcpu_manifest.json is missing"):
        pruned_directory(str(bare))


@needs_stories
def test_a_pruned_directory_is_a_matrix_model(saved):
    """The matrix reads a model once and hands out deep copies of it."""
    from rcpu_bench.matrix.executors import clone_to
    from rcpu_bench.model.loading import load_model

    loaded = load_model(str(saved))
    ids = torch.tensor([[1, 5, 9, 30]])
    with torch.no_grad():
        assert torch.equal(clone_to(loaded.model, "cpu")(ids).logits, loaded.model(ids).logits)


# ------------------------------------------------------------------------------------- outputs and inputs


def test_tables_out_cannot_be_the_store(tmp_path, capsys):
    store = tmp_path / "records.jsonl"
    store.write_text(json.dumps({"cell_id": "a", "status": "failed"}) + "\n")
    before = store.read_bytes()
    code, err = run(["tables", "--results", str(tmp_path), "--out", str(store)], capsys)
    assert_one_line_error(code, err, f"--out file {store} is the command's input", "allowed: a path that is none")
    assert store.read_bytes() == before


@needs_stories
def test_export_cannot_overwrite_the_model_it_exports(saved, capsys, nothing_loads):
    weights = saved / "model.safetensors"
    before = weights.read_bytes()
    code, err = run(["export", "--format", "gguf", "--overwrite", str(saved), str(weights)], capsys)
    assert_one_line_error(code, err, f"GGUF file {weights} is a file of the input {saved}")
    assert weights.read_bytes() == before


@needs_stories
def test_prune_out_cannot_be_a_file_of_the_model(tmp_path, capsys, nothing_loads):
    model = tmp_path / "model"
    model.mkdir()
    for path in STORIES_MHA.iterdir():
        (model / path.name).write_bytes(path.read_bytes())
    before = (model / "config.json").read_bytes()
    code, err = run(["prune", "--model", str(model), *QUICK, "--out", str(model / "config.json")], capsys)
    assert_one_line_error(code, err, f"--out file {model / 'config.json'} is a file of the input {model}")
    assert (model / "config.json").read_bytes() == before


def test_a_file_another_writer_published_meanwhile_is_kept(tmp_path):
    target = tmp_path / "m.gguf"

    def write(staging: Path) -> None:
        assert str(os.getpid()) in staging.name  # each writer stages under a name of its own
        staging.write_bytes(b"mine")
        target.write_bytes(b"the other writer's")

    with pytest.raises(FileExistsError, match="was created by another writer while this one wrote it"):
        write_file_atomically(target, write, replace=False)
    assert target.read_bytes() == b"the other writer's" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


def test_a_directory_another_writer_published_meanwhile_is_kept(tmp_path):
    target = tmp_path / "saved"

    def write(staging: Path) -> None:
        (staging / "weights").write_bytes(b"mine")
        target.mkdir()
        (target / "weights").write_bytes(b"the other writer's")

    with pytest.raises(FileExistsError, match="was written by another writer while this one saved it"):
        write_atomically(target, write)
    assert (target / "weights").read_bytes() == b"the other writer's"
    assert [p.name for p in tmp_path.iterdir()] == ["saved"]


@needs_stories
def test_concurrent_exports_to_one_file_never_replace_each_other(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoTokenizer

    from rcpu_bench.export.gguf import export_gguf

    target = tmp_path / "m.gguf"
    write_tensors = gguf.GGUFWriter.write_tensors_to_file

    def and_the_other_export_finishes(self, *args, **kwargs):
        write_tensors(self, *args, **kwargs)
        target.write_bytes(b"the other export")

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", and_the_other_export_finishes)
    with pytest.raises(FileExistsError, match=f"{target} was created by another writer"):
        export_gguf(tiny_model(tiny_config(vocab=512)), AutoTokenizer.from_pretrained(STORIES), target)
    assert target.read_bytes() == b"the other export" and [p.name for p in tmp_path.iterdir()] == ["m.gguf"]


# ------------------------------------------------------------------------------------- a full disk


def enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_a_record_on_a_full_disk_is_not_torn(tmp_path, monkeypatch):
    path = tmp_path / "r.jsonl"
    records.append_record(path, {"first": 1})
    before = path.read_bytes()
    write = os.write

    def half_then_full(descriptor, data):
        write(descriptor, bytes(data[: len(data) // 2]))
        enospc()

    monkeypatch.setattr(records.os, "write", half_then_full)
    with pytest.raises(OSError, match=f"cannot write {path}: No space left on device"):
        records.append_record(path, {"second": "x" * 10_000})
    monkeypatch.undo()
    assert path.read_bytes() == before
    records.append_record(path, {"third": 3})
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"first": 1}, {"third": 3}]


@needs_stories
def test_save_on_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, monkeypatch, capsys):
    def half_then_full(tensors, path, metadata=None):
        Path(path).write_bytes(b"half a model")
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    monkeypatch.setattr(persistence, "save_file", half_then_full)
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--save", str(tmp_path / "pruned")], capsys)
    assert_one_line_error(code, err, f"cannot write {tmp_path / 'pruned'}", "No space left on device")
    assert list(tmp_path.iterdir()) == []


@needs_stories
def test_a_gguf_file_on_a_full_disk_leaves_nothing(tmp_path, monkeypatch):
    import gguf
    from transformers import AutoTokenizer

    from rcpu_bench.export.gguf import export_gguf

    monkeypatch.setattr(gguf.GGUFWriter, "write_tensors_to_file", enospc)
    with pytest.raises(OSError, match=f"cannot write {tmp_path / 'm.gguf'}: No space left on device"):
        export_gguf(tiny_model(tiny_config(vocab=512)), AutoTokenizer.from_pretrained(STORIES), tmp_path / "m.gguf")
    assert list(tmp_path.iterdir()) == []


def test_a_torn_lm_eval_results_file_is_not_published(tmp_path):
    from rcpu_bench.commands.eval import staged_output

    out = tmp_path / "lm-eval"
    out.mkdir()
    with pytest.raises(OSError, match=f"cannot write {out / 'model' / 'results.json'}: lm-eval wrote it torn"):
        with staged_output(str(out)) as staging:
            (Path(staging) / "model").mkdir()
            (Path(staging) / "model" / "samples.jsonl").write_text('{"doc": 1}\n')
            (Path(staging) / "model" / "results.json").write_text('{"results": {"piqa": ')
    assert list(out.iterdir()) == []


# ------------------------------------------------------------------------------------- before the work


@needs_stories
def test_an_unwritable_destination_is_found_by_writing_and_named_as_given(tmp_path, monkeypatch, capsys, nothing_loads):
    """os.access says yes to root, where a read-only file system then refuses the write."""
    import tempfile

    read_only = tmp_path / "mount"
    read_only.mkdir()
    create = tempfile.mkstemp

    def refuse_under_mount(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).is_relative_to(read_only):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS))
        return create(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", refuse_under_mount)
    for option, what in [("--save", "--save directory"), ("--out", "--out file")]:
        target = read_only / "new"
        code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, option, str(target)], capsys)
        assert_one_line_error(code, err, f"{what} {target}: cannot write in {read_only} (Read-only file system)")
        assert ".partial" not in err


@needs_stories
@pytest.mark.parametrize("args, needles", [
    (["--gguf-outtype", "q8_0"], ["q8_0 needs rows of a multiple of 32", "blk.0.attn_output.weight has 56"]),
    (["--model-method", "shortgpt"], ["--export-gguf with the whole-model method 'shortgpt'"]),
])
def test_gguf_export_refusals_come_before_pruning(tmp_path, args, needles, capsys, nothing_loads):
    code, err = run(["prune", "--model", str(STORIES_MHA), *QUICK, "--save", str(tmp_path / "s"),
                     "--export-gguf", str(tmp_path / "m.gguf"), *args], capsys)
    assert_one_line_error(code, err, *needles)
    assert list(tmp_path.iterdir()) == []


@needs_stories
def test_a_family_gguf_cannot_express_is_refused_before_pruning(tmp_path, capsys, nothing_loads):
    from tiny_families import family_model
    from transformers import AutoTokenizer

    model = tmp_path / "mistral"
    family_model("mistral").save_pretrained(model)
    AutoTokenizer.from_pretrained(STORIES).save_pretrained(model)
    code, err = run(["prune", "--model", str(model), *QUICK, "--save", str(tmp_path / "s"),
                     "--export-gguf", str(tmp_path / "m.gguf")], capsys)
    assert_one_line_error(code, err, "model type 'mistral' is not exported to GGUF")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mistral"]


# ------------------------------------------------------------------------------------- modes, signals, leftovers


def test_every_file_of_a_saved_directory_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        def write(staging: Path) -> None:  # a writer that stages privately inside (mkstemp / mkdtemp modes)
            (staging / "nested").mkdir(mode=0o700)
            (staging / "nested" / "tokenizer.json").write_text("{}")
            (staging / "nested" / "tokenizer.json").chmod(0o600)
            (staging / "model.safetensors").write_bytes(b"x")

        write_atomically(tmp_path / "saved", write)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in tmp_path.rglob("*")}
    assert modes == {"saved": 0o755, "saved/nested": 0o755, "saved/nested/tokenizer.json": 0o644,
                     "saved/model.safetensors": 0o644}


def test_lm_eval_outputs_follow_the_umask(tmp_path):
    from rcpu_bench.commands.eval import staged_output

    old = os.umask(0o022)
    try:
        with staged_output(str(tmp_path / "out")) as staging:
            (Path(staging) / "model").mkdir(mode=0o700)
            (Path(staging) / "model" / "results.json").write_text("{}")
            (Path(staging) / "model" / "results.json").chmod(0o600)
    finally:
        os.umask(old)
    assert stat.S_IMODE((tmp_path / "out" / "model" / "results.json").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "out" / "model").stat().st_mode) == 0o755


def test_sigterm_exits_143_and_removes_the_staging(tmp_path, monkeypatch, capsys):
    (tmp_path / "records.jsonl").write_text("")
    follow_umask = atomic_file.follow_umask

    def terminated_mid_write(path):
        follow_umask(path)
        os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(atomic_file, "follow_umask", terminated_mid_write)
    previous = signal.getsignal(signal.SIGTERM)
    code, err = run(["tables", "--results", str(tmp_path), "--out", str(tmp_path / "tables.md")], capsys)
    assert code == 143 and "rcpu-bench: interrupted" in err and "Traceback" not in err
    assert [p.name for p in tmp_path.iterdir()] == ["records.jsonl"]
    assert signal.getsignal(signal.SIGTERM) == previous


def test_stale_hidden_partial_files_are_removed_by_the_next_write(tmp_path):
    plots = tmp_path / "plots"
    plots.mkdir()
    dead = plots / ".ppl.png.4194304999.ab12.partial"  # no such pid
    unnamed = plots / ".ppl.png.ab12cd.partial"  # written before staging names carried a pid
    live = plots / f".ppl.png.{os.getpid()}.ab12.partial"
    for path in (dead, unnamed, live):
        path.write_bytes(b"half a figure")
    write_file_atomically(plots / "ppl.png", lambda path: path.write_bytes(b"figure"))
    assert sorted(p.name for p in plots.iterdir()) == sorted(["ppl.png", live.name])


def test_a_report_removes_the_hidden_partial_files_of_killed_reports(tmp_path):
    from matplotlib.figure import Figure

    from rcpu_bench.tables.figures import save_figure

    stale = tmp_path / ".ppl_vs_ratio.pdf.4194304999.ab12.partial"  # another figure's, its writer gone
    stale.write_bytes(b"half a figure")
    save_figure(Figure(), tmp_path, "other")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["other.pdf", "other.png", "other.svg"]


@needs_stories
def test_resume_notices_changed_evaluation_data(tmp_path, monkeypatch):
    from tiny_matrices import tiny_matrix
    from tiny_models import TINYSTORIES

    from rcpu_bench.matrix.fingerprints import Fingerprints, changes
    from rcpu_bench.matrix.spec import expand
    from rcpu_bench.matrix.store import Entry
    from rcpu_bench.plugins import default_registry

    stories = tmp_path / "data" / "tinystories" / "validation_first1000.jsonl"
    stories.parent.mkdir(parents=True)
    stories.write_bytes(TINYSTORIES.read_bytes())
    monkeypatch.setenv("RCPU_BENCH_DATA", str(tmp_path / "data"))
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("Once upon a time there was a cat. " * 200)
    matrix = tiny_matrix(["wanda-sp"], calib={"source": f"file:{corpus}", "n_calib": [4], "seqlen": 32})
    cell = expand(matrix, default_registry())[0]
    stored = Entry(cell_id="c", cell={}, status="ok", fingerprint=Fingerprints().of(cell))
    lines = stories.read_text().splitlines()
    row = json.loads(lines[905])
    lines[905] = json.dumps({**row, "text": row["text"] + " The end."})  # a story the profile evaluates on
    stories.write_text("\n".join(lines) + "\n")
    assert changes(stored, Fingerprints().of(cell)) == ["evaluation"]
