"""``horizonrl report``: TensorBoard events of fake runs (written by the SummaryWriter the coordinator
uses) in, the chart and the markdown table out."""

import json
import subprocess
from pathlib import Path

import pytest
from helpers import horizonrl_cmd

from horizonrl.apps.report import MISSING, ReportError, first_last, read_run, report, smoothed

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def write_run(run_dir: Path, series: dict[str, list[tuple[int, float]]], *, config: dict | None = None) -> Path:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
    for tag, points in series.items():
        for step, value in points:
            writer.add_scalar(tag, value, step)
    writer.close()
    if config is not None:
        import yaml

        (run_dir / "config.yaml").write_text(yaml.safe_dump(config))
    return run_dir


def linear(first: float, last: float, steps: int) -> list[tuple[int, float]]:
    return [(s, first + (last - first) * (s - 1) / (steps - 1)) for s in range(1, steps + 1)]


@pytest.fixture
def two_runs(tmp_path):
    """'short' evaluated held-out success every 5 steps and used a KL to the reference; 'long' did neither."""
    short = write_run(tmp_path / "short", {
        "rollout/reward_mean": linear(0.1, 0.9, 10),
        "rollout/success_rate": linear(0.2, 0.8, 10),
        "batch/turns_mean": linear(4.0, 2.0, 10),
        "schedule/max_turns": [(s, 6.0) for s in range(1, 11)],
        "loss/entropy": linear(1.5, 0.5, 10),
        "loss/approx_kl": linear(0.01, 0.03, 10),
        "loss/kl_ref": linear(0.0, 0.2, 10),
        "eval/success_rate": [(0, 0.25), (5, 0.5), (10, 0.75)],
        "eval/babyai/success_rate": [(0, 0.2), (5, 0.4), (10, 0.7)],
        "eval/textcraft/success_rate": [(0, 0.3), (5, 0.6), (10, 0.8)],
        "time/elapsed_s": linear(10.0, 95.0, 10),
    }, config={"learner": {"use_kl_loss": True}})
    long = write_run(tmp_path / "long", {
        "batch/reward_mean": linear(0.0, 0.5, 20),  # no rollout/reward_mean: the fallback tag
        "rollout/success_rate": linear(0.1, 0.4, 20),
        "batch/turns_mean": linear(6.0, 8.0, 20),
        "schedule/max_turns": [(s, 6.0 if s <= 10 else 12.0) for s in range(1, 21)],
        "loss/entropy": linear(2.0, 1.0, 20),
        "loss/approx_kl": linear(0.02, 0.04, 20),
        "loss/kl_ref": [(s, 0.0) for s in range(1, 21)],  # what the learner logs without a reference model
        "time/elapsed_s": linear(5.0, 300.0, 20),
    }, config={"learner": {"use_kl_loss": False}})
    return short, long


def table_rows(table: str) -> dict[str, dict[str, str]]:
    """The first markdown table as {run: {column: cell}}."""
    lines = [line for line in table.split("\n\n")[0].splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = {}
    for line in lines[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_two_runs_make_one_chart_and_a_table_of_their_values(two_runs, tmp_path):
    out = tmp_path / "out"
    result = report(list(two_runs), out)
    png = out / "learning.png"
    assert png.read_bytes()[:8] == PNG_MAGIC
    import matplotlib.image

    height, width, _ = matplotlib.image.imread(png).shape  # decodes the whole image
    assert width > 800 and height > 600

    rows = table_rows(result["table"])
    assert set(rows) == {"short", "long"}
    short, long = rows["short"], rows["long"]
    assert short["steps"] == "10" and long["steps"] == "20"
    assert short["wall time"] == "95 s" and long["wall time"] == "5.0 min"
    assert short["reward"] == "0.1 → 0.9"
    assert long["reward"] == "0 → 0.5"  # from batch/reward_mean
    assert short["held-out success (before → after)"] == "0.25 → 0.75 (steps 0–10)"
    assert long["held-out success (before → after)"] == MISSING
    assert short["rollout success"] == "0.2 → 0.8" and long["rollout success"] == "0.1 → 0.4"
    assert short["turns"] == "4 → 2" and long["turns"] == "6 → 8"
    assert short["max-turn budget"] == "6 → 6" and long["max-turn budget"] == "6 → 12"
    assert short["entropy"] == "1.5 → 0.5" and long["entropy"] == "2 → 1"
    assert short["KL"] == "0.01 → 0.03"
    assert short["KL to reference"] == "0 → 0.2"
    assert long["KL to reference"] == MISSING  # use_kl_loss off: the logged zeros are not a measurement

    assert "Held-out success by environment" in result["table"]
    assert "0.2 → 0.7 (steps 0–10)" in result["table"] and "0.3 → 0.8 (steps 0–10)" in result["table"]
    assert (out / "learning.md").read_text().endswith(result["table"])
    values = json.loads((out / "learning.json").read_text())
    assert values[0]["tags"]["reward"] == "rollout/reward_mean" and values[1]["tags"]["reward"] == "batch/reward_mean"


def test_smoothing_averages_the_first_and_last_points_but_not_held_out_success(two_runs, tmp_path):
    result = report([two_runs[0]], tmp_path / "out", smooth=3)
    row = result["rows"][0]
    # reward 0.1 .. 0.9 in steps of 0.0889: the first three average 0.1889, the last three 0.8111
    assert row["reward"]["first"] == pytest.approx(0.1 + 0.8 / 9, abs=1e-6)
    assert row["reward"]["last"] == pytest.approx(0.9 - 0.8 / 9, abs=1e-6)
    assert (row["held-out success"]["first"], row["held-out success"]["last"]) == pytest.approx((0.25, 0.75))
    assert smoothed([1.0, 2.0, 3.0, 4.0], 2) == [1.0, 1.5, 2.5, 3.5]
    assert first_last([(1, 1.0), (2, 5.0)], 10) == (3.0, 3.0)


def test_a_resumed_run_reads_every_events_file_and_the_later_value_wins(tmp_path):
    run = tmp_path / "resumed"
    write_run(run, {"loss/entropy": [(1, 1.0), (2, 0.9), (3, 0.8)], "time/elapsed_s": [(1, 5.0), (3, 40.0)]})
    first = next((run / "tensorboard").glob("events.*"))
    first.rename(first.with_name("events.out.tfevents.1000.host.1.0"))
    # the resumed coordinator logs step 3 again (the checkpoint was at step 2), then steps 4-5
    write_run(run, {"loss/entropy": [(3, 0.7), (4, 0.6), (5, 0.5)], "time/elapsed_s": [(3, 8.0), (5, 20.0)]})
    second = next(f for f in (run / "tensorboard").glob("events.*") if f.name != "events.out.tfevents.1000.host.1.0")
    second.rename(second.with_name("events.out.tfevents.2000.host.1.0"))
    curves = read_run(run)
    entropy = curves.scalars["loss/entropy"]
    assert [step for step, _ in entropy] == [1, 2, 3, 4, 5]
    assert [value for _, value in entropy] == pytest.approx([1.0, 0.9, 0.7, 0.6, 0.5])
    assert curves.wall_s == pytest.approx(60.0)  # 40 s before the resume + 20 s after
    assert curves.steps == 5


def test_a_directory_without_events_is_a_clear_error(tmp_path, two_runs):
    (tmp_path / "empty" / "tensorboard").mkdir(parents=True)
    with pytest.raises(ReportError, match="no TensorBoard events"):
        report([two_runs[0], tmp_path / "empty"], tmp_path / "out")
    with pytest.raises(ReportError, match="no such directory"):
        report([tmp_path / "missing"], tmp_path / "out")
    with pytest.raises(ReportError, match="one per run"):
        report(list(two_runs), tmp_path / "out", labels=["only-one"])


def test_the_command_prints_the_table_labels_runs_and_fails_cleanly(two_runs, tmp_path):
    out = tmp_path / "cmd"
    done = subprocess.run(horizonrl_cmd("report", str(two_runs[0]), str(two_runs[1]), "--out", str(out),
                                        "--label", "fixed 6", "--label", "scaling 6→12", "--smooth", "2"),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert set(table_rows(done.stdout)) == {"fixed 6", "scaling 6→12"}
    assert (out / "learning.png").read_bytes()[:8] == PNG_MAGIC
    bad = subprocess.run(horizonrl_cmd("report", str(tmp_path / "nowhere")), capture_output=True, text=True,
                         timeout=120)
    assert bad.returncode == 2 and "no such directory" in bad.stderr
