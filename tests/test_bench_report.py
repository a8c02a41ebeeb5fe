"""The benchmark report helpers: summaries, per-repeat ratios, the table, results.json and chart.png."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from horizonrl.apps.bench.report import alternate, make_result, paired_ratio, print_table, summarize, write_results


def test_summarize_gives_median_min_max_and_count():
    assert summarize([3.0, 1.0, 2.0]) == {"median": 2.0, "min": 1.0, "max": 3.0, "n": 3}
    assert summarize([1, 2, 3, 10])["median"] == 2.5
    with pytest.raises(ValueError):
        summarize([])


def test_ratio_is_taken_per_repeat_then_summarized():
    # Repeat 2 ran on a busy machine: both sides slowed down, their ratio did not.
    candidate = [200.0, 100.0, 210.0]
    baseline = [100.0, 50.0, 100.0]
    ratio = paired_ratio(candidate, baseline)
    assert ratio == {"median": 2.0, "min": 2.0, "max": 2.1, "n": 3}
    # Not the ratio of the medians (200 / 100 = 2.0 here by chance) nor of the pooled values:
    assert paired_ratio([1.0, 4.0], [1.0, 1.0])["max"] == 4.0
    with pytest.raises(ValueError):
        paired_ratio([1.0], [1.0, 2.0])


def test_measurement_order_alternates_between_repeats():
    assert alternate(0, ["a", "b", "c"]) == ["a", "b", "c"]
    assert alternate(1, ["a", "b", "c"]) == ["c", "b", "a"]
    assert alternate(2, ("a", "b")) == ["a", "b"]


def _result(part: str = "demo") -> dict:
    rows = [
        {"label": "small / ours", "MB_per_s": summarize([10.0, 12.0, 11.0]), "MB": 1.5, "ok": True},
        {"label": "small / raw", "MB_per_s": summarize([20.0, 22.0, 24.0]), "MB": 1.5},
    ]
    ratios = {"small: ours / raw": paired_ratio([10.0, 12.0, 11.0], [20.0, 22.0, 24.0])}
    return make_result(part, rows, ratios, {"repeats": 3}, chart={"metric": "MB_per_s", "log": True})


def test_table_shows_median_and_range_of_every_row_and_ratio():
    out = io.StringIO()
    print_table(_result(), file=out)
    text = out.getvalue()
    assert "== demo ==" in text
    assert "11 [10–12]" in text and "22 [20–24]" in text
    assert "small: ours / raw" in text and "0.5 [0.458–0.545]" in text
    assert "True" in text and '"repeats": 3' in text


def test_results_json_and_chart_are_written(tmp_path):
    paths = write_results([_result("one"), _result("two")], tmp_path / "out")
    saved = json.loads(paths["json"].read_text())
    assert [r["part"] for r in saved["results"]] == ["one", "two"]
    assert saved["results"][0]["ratios"]["small: ours / raw"]["n"] == 3
    assert saved["machine"]["cpu_count"] >= 1 and "torch" in saved["machine"]
    assert "hostname" not in json.dumps(saved["machine"]).lower()
    png = paths["chart"].read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_a_benchmark_run_started_from_another_directory_finds_its_model(tmp_path, monkeypatch):
    """The bench's runs start in the checkout, so the relative paths the caller gave (its .cache/ model, its run
    directory, its config) are resolved against the caller's directory before they are handed over."""
    from horizonrl.apps.bench.training import train_command

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".cache" / "tiny-signpost").mkdir(parents=True)
    command = train_command(Path("my.yaml"), ".cache/tiny-signpost", Path("runs/x"), 2, [])
    assert f"model.path={tmp_path / '.cache' / 'tiny-signpost'}" in command
    assert f"run.output_dir={tmp_path / 'runs' / 'x'}" in command and str(tmp_path / "my.yaml") in command
    assert "model.path=HuggingFaceTB/SmolLM2" in train_command(Path("c.yaml"), "HuggingFaceTB/SmolLM2", Path("r"), 1, [])
