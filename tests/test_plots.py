"""Plots from results-store entries: the plotted values (computed apart from drawing, by hand here), their
stability, and the PNG files the command writes."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from test_tables import entry, ridge_grid, stored

from rcpu_bench.commands import main
from rcpu_bench.tables.figures import DPI
from rcpu_bench.tables.plots import (
    LambdaCurve,
    bar_data,
    dense_data,
    lambda_data,
    ncalib_data,
    write_plots,
)

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def store_entries() -> list[dict]:
    """Llama-7B: two scorers × several compensators, a three-λ ridge grid, RCPU at three N_calib."""
    return [
        entry("original", 0.0, 12.4),
        entry("wanda-sp", 0.1, 14.66), entry("wanda-sp", 0.2, 16.70),
        entry("custom", 0.1, 14.0, label="WANDA-sp+Rot.", prune={"scorer": "wanda-sp", "compensator": "procrustes"}),
        entry("rcpu-rot", 0.1, 13.55), entry("rcpu-rot", 0.2, 14.40),
        entry("rcpu-rot", 0.1, 13.48, n_calib=512), entry("rcpu-rot", 0.1, 20.0, n_calib=32),
        entry("ls-best", 0.1, 15.0, lam=1e-2, calibration_ppl=9.0),  # λ_best: lowest calibration perplexity
        entry("ls-best", 0.1, 14.0, lam=1.0, calibration_ppl=10.0),
        entry("ls-best", 0.1, 16.0, lam=100.0, calibration_ppl=11.0),
        entry("flap", 0.1, 14.14),  # FLAP's global structure: in the N_calib plot, not among the bars
        entry("rcpu-rot", 0.3, 18.0, prune={"compensate": []}),  # an ablation run: in no plot
        entry("ls-damped", 0.1, 13.0),  # ridge at a damping relative to G_KK, not on the λ axis: in no plot
    ]


def plotted() -> list:
    return stored(store_entries())


def test_bar_data():
    assert bar_data(plotted()) == {"Llama-7B": {
        (128, "wanda-sp"): {"No comp.": {0.1: 14.66, 0.2: 16.70}, "Rot.": {0.1: 14.0}},
        (128, "variance"): {"LS (λ_best)": {0.1: 15.0}, "Rot.": {0.1: 13.55, 0.2: 14.40}},
        (512, "variance"): {"Rot.": {0.1: 13.48}},
        (32, "variance"): {"Rot.": {0.1: 20.0}},
    }}


def test_lambda_data():
    assert lambda_data(plotted()) == {"Llama-7B": {
        (128, "variance", 0.1): LambdaCurve(lams=(0.01, 1.0, 100.0), ppl=(15.0, 14.0, 16.0), best=0.01)}}


def test_ncalib_data_has_the_methods_run_at_several_ncalib():
    assert ncalib_data(plotted()) == {"Llama-7B": {("RCPU (Rot.)", 0.1): {32: 20.0, 128: 13.55, 512: 13.48}}}
    assert ncalib_data([r for r in plotted() if r.n_calib == 128]) == {}


@pytest.mark.parametrize("data_of", [bar_data, lambda_data, ncalib_data, dense_data])
def test_plotted_values_are_the_same_every_time_and_in_any_store_order(data_of):
    first = repr(data_of(plotted()))  # the values and the order they are drawn in
    assert repr(data_of(plotted())) == first and repr(data_of(plotted()[::-1])) == first


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_lambda_data_under_the_holdout_rule_stars_the_lowest_held_out_error():
    grid = stored(ridge_grid({1e-2: 0.31, 1.0: 0.12, 100.0: 0.25}))
    assert lambda_data(grid, lambda_rule="holdout") == {"Llama-7B": {
        (128, "variance", 0.1): LambdaCurve(lams=(0.01, 1.0, 100.0), ppl=(15.0, 14.0, 16.0), best=1.0)}}
    assert bar_data(grid, lambda_rule="holdout") == {"Llama-7B": {(128, "variance"): {"LS (λ_best)": {0.1: 14.0}}}}


def test_dense_data_is_the_original_models_perplexity():
    assert dense_data(plotted()) == {"Llama-7B": 12.4}
    assert dense_data([r for r in plotted() if r.ratio > 0]) == {}


KINDS = ("ppl_vs_ratio", "ppl_vs_lambda", "ppl_vs_ncalib")


@pytest.mark.slow  # ~20 s on 2 loaded cores: figures written twice
def test_write_plots_png_pdf_and_svg_per_kind(tmp_path):
    paths = write_plots(plotted(), tmp_path / "a")
    assert [p.name for p in paths] == [f"{kind}_Llama-7B.{fmt}" for kind in KINDS for fmt in ("png", "pdf", "svg")]
    pngs = [p for p in paths if p.suffix == ".png"]
    (bars_w, bars_h), *others = [png_size(p) for p in pngs]
    panel_w, panel_h = 5 * DPI, 3.6 * DPI  # one panel of 5 × 3.6 in
    assert all(0.8 * panel_w < w < 1.4 * panel_w and 0.8 * panel_h < h < 1.7 * panel_h for w, h in others)
    # the paper's bar grid: a row per N_calib (32, 128, 512), a column per scorer (WANDA-sp, variance)
    assert 2 * 0.8 * panel_w < bars_w < 2 * 1.4 * panel_w and 3 * 0.8 * panel_h < bars_h < 3 * 1.7 * panel_h
    assert all(p.read_bytes().startswith(b"%PDF-") for p in paths if p.suffix == ".pdf")
    assert all(b"<svg" in p.read_bytes()[:2000] for p in paths if p.suffix == ".svg")
    assert all(5_000 < p.stat().st_size < 5_000_000 for p in paths)
    again = write_plots(plotted(), tmp_path / "b")
    assert [p.read_bytes() for p in again] == [p.read_bytes() for p in paths]


def test_every_figure_draws_the_dense_reference_line():
    from rcpu_bench.tables.plots import PLOTS
    for kind, (data_of, draw) in PLOTS.items():
        (panels,) = data_of(plotted()).values()
        figure = draw("Llama-7B", panels, "rcpu128", 12.4)
        lines = [line for ax in figure.axes for line in ax.get_lines() if line.get_label().startswith("dense model")]
        assert lines and all(list(line.get_ydata()) == [12.4, 12.4] for line in lines), kind


def run_cli(argv: list[str]) -> int:
    return main(["plots", *argv])


@pytest.fixture
def results(tmp_path) -> Path:
    (tmp_path / "records.jsonl").write_text("".join(json.dumps(e) + "\n" for e in store_entries()), encoding="utf-8")
    return tmp_path


@pytest.mark.slow  # draws all nine figures (10-15 s); the figures' own tests draw one each
def test_cli_writes_pngs_only_into_the_plots_directory(results, capsys):
    assert run_cli(["--results", str(results)]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(printed) == sorted(str(p) for p in (results / "plots").iterdir())
    assert len(printed) == 9 and sorted(p.name for p in results.iterdir()) == ["plots", "records.jsonl"]


def test_cli_reports_an_unknown_profile(results, capsys):
    assert run_cli(["--results", str(results), "--out-dir", str(results / "out"), "--profile", "std2048"]) == 2
    assert "no entry has perplexity profile 'std2048'" in capsys.readouterr().err
    assert not (results / "out").exists()
