"""The run's console (horizonrl/launcher/console.py, the records: horizonrl/protocol/status.py): the status block, the plain progress line, which lines of
the processes' output reach the console, and the live block's redraw — pure functions and a fake terminal."""

import io
import re

import pytest

from horizonrl.launcher.console import RunConsole, StepPace, fault_summary, format_duration, progress_line, shown_line, status_lines
from horizonrl.protocol.status import BUFFER_CAPACITY, BUFFER_GROUPS, StepStatus, parse_status_line, status_record_line

SCALARS = {
    "batch/reward_mean": 0.4213, "rollout/success_rate": 0.375, "batch/success_mean": 0.5, "batch/turns_mean": 1.94,
    "schedule/max_turns": 2.0, "schedule/next_max_turns": 3.0, "batch/staleness_mean": 0.8125,
    "rollout/tokens_per_s": 412.4, "throughput/learner_tokens_per_s": 3210.0, "time/step_s": 4.125,
    "buffer/dropped_total": 3.0, BUFFER_GROUPS: 5.0, BUFFER_CAPACITY: 16.0,
    "faults/actor_died": 1.0, "faults/actor_restarted": 1.0, "faults/actor_recovered": 1.0,
    "faults/recovery_s/actor": 41.5, "faults/episodes_lost": 2.0, "rollout/failures/actor_lost": 2.0,
    "rollout/failures/timeout": 0.0, "loss/policy": 0.1,
}


@pytest.fixture(autouse=True)
def terminal_of_100_columns(monkeypatch):
    """The live block fits the terminal's width; these tests read a 100-column one (the fallback without a
    terminal), whatever runs them: pytest-xdist's workers set COLUMNS=80."""
    monkeypatch.setenv("COLUMNS", "100")


def test_status_block_shows_every_field_of_a_step():
    lines = status_lines(StepStatus(12, 80, SCALARS), title="run demo", phase="training", elapsed_s=151.0,
                         eta_s=850.0, width=200)
    assert lines == [
        "run demo | training | step 12/80 [###---------------------]  15% | elapsed 2m31s | ETA 14m10s",
        "  reward 0.42 | success 0.38 | turns 1.9 of budget 2 (next 3) | staleness 0.81",
        "  tokens/s rollout 412 learner 3,210 | step 4.1 s | buffer 5/16 groups, dropped 3",
        "  faults: actor died 1, recovered 1, restarted 1; failed episodes: actor lost 2",
    ]


def test_status_block_before_the_first_step_and_in_a_narrow_terminal():
    lines = status_lines(StepStatus(0, 3), title="run t", phase="starting", elapsed_s=5.0, eta_s=None, width=60)
    assert lines[0] == "run t | starting | step 0/3 [------------------------]   ..."
    assert lines[1:] == ["  reward - | success - | turns - of budget - | staleness -",
                         "  tokens/s rollout - learner - | step - s | buffer - grou...",
                         "  faults: none"]
    assert all(len(line) <= 60 for line in lines)


def test_progress_line_is_one_plain_line_per_step():
    line = progress_line(StepStatus(12, 80, SCALARS), eta_s=850.0)
    assert line == ("step 12/80 | reward 0.42 | success 0.38 | turns 1.9 | max_turns 2 | staleness 0.81 | "
                    "rollout 412 tok/s | learner 3210 tok/s | step 4.12 s | buffer 5/16 | dropped 3 | died 1 | "
                    "eta 14m10s")
    assert progress_line(StepStatus(1, 3)).startswith("step 1/3 | reward - | success - |")


def test_success_falls_back_to_the_batch_when_no_episode_finished():
    scalars = {k: v for k, v in SCALARS.items() if k != "rollout/success_rate"}
    assert "success 0.50" in progress_line(StepStatus(1, 3, scalars))


def test_fault_summary():
    assert fault_summary({}) == "none"
    assert fault_summary({"faults/recovery_s/buffer": 3.0, "rollout/failures/timeout": 0.0}) == "none"
    assert fault_summary({"faults/buffer_died": 2.0, "faults/learner_gave_up": 1.0,
                          "rollout/failures/environment": 4.0}) == (
        "buffer died 2; learner gave up 1; failed episodes: environment 4")


def test_format_duration():
    assert [format_duration(s) for s in (None, -1.0, 0.4, 42.0, 754.0, 3725.0)] == [
        "-", "-", "0s", "42s", "12m34s", "1h02m"]


def test_status_record_round_trip_keeps_only_what_the_console_shows():
    line = status_record_line(7, 80, SCALARS)
    status = parse_status_line(line)
    assert status is not None and (status.step, status.total, status.startup) == (7, 80, False)
    assert "loss/policy" not in status.scalars
    assert status.scalars["faults/actor_died"] == 1.0 and status.scalars[BUFFER_GROUPS] == 5.0
    assert parse_status_line(status_record_line(40, 80, {}, startup=True)) == StepStatus(40, 80, {}, True)
    assert parse_status_line("step 7/80 | reward 0.1") is None
    assert parse_status_line("status {not json") is None


def test_step_pace_extrapolates_the_last_steps_and_restarts_when_steps_go_back():
    pace = StepPace(window=2)
    assert pace.eta_s(10, 0.0) is None
    pace.add(1, 100.0)
    assert pace.eta_s(10, 100.0) is None
    pace.add(2, 110.0)
    assert pace.eta_s(10, 110.0) == 80.0  # 10 s per step, 8 steps left
    assert pace.eta_s(10, 114.0) == 76.0
    pace.add(3, 116.0)
    pace.add(4, 118.0)  # the window: steps 2..4, 4 s per step
    assert pace.eta_s(10, 118.0) == 24.0
    pace.add(3, 200.0)  # the learner restarted from its checkpoint at step 2
    assert pace.eta_s(10, 200.0) is None


VLLM_LINES = [
    "(EngineCore pid=11631) INFO 11-25 03:36:35 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config",
    "(Worker pid=11657) WARNING 11-25 03:37:00 [layerwise.py:266] RotaryEmbedding: Failed to load weights",
    "WARNING 11-25 03:36:29 [vllm.py:1703] Enforce eager set, disabling torch.compile",
    "03:36:28 actor-0[11580] WARNING vllm.triton_utils.importing: Triton is installed, but doesn't include CPU backend.",
    "Loading safetensors checkpoint shards: 100% Completed | 1/1 [00:00<00:00, 115.15it/s]",
    "[W1125 03:36:50.107812081 utils.cpp:68] Warning: NUMA binding: Using MEMBIND policy",
    "/x/dispatcher.py:138: FutureWarning: `torch.distributed.reduce_op` is deprecated",
    "Triton is installed, but doesn't include CPU backend. Disabling Triton.",
]


def test_only_lines_that_say_something_is_wrong_reach_the_console():
    for line in VLLM_LINES + ["03:37:13 learner-0[11578] INFO horizonrl.learner: step 3: loss 0.1 reward 0.2",
                              "Traceback (most recent call last):", '  File "x.py", line 1, in <module>', ""]:
        assert shown_line("actor-0", line) is None, line
    assert shown_line("actor-0", "03:37:13 actor-0[11580] WARNING horizonrl.actors.delivery: 8 trajectories "
                                 "unacknowledged") == "03:37:13 [actor-0] WARNING 8 trajectories unacknowledged"
    assert shown_line("buffer", "03:37:13 buffer[7] ERROR horizonrl.buffer: cannot write") == (
        "03:37:13 [buffer] ERROR cannot write")
    shown = shown_line("actor-1", "(EngineCore pid=9) ERROR 11-25 03:37:00 [core.py:1] EngineCore failed to start")
    assert shown is not None and shown.endswith("[actor-1] vLLM ERROR EngineCore failed to start")
    for line in ("OSError: no such model: /x", "torch.distributed.DistBackendError: peer gone", "KeyError: 'x'",
                 "error: this config has unresolved ports (0)"):
        shown = shown_line("learner-0", line)
        assert shown is not None and shown.endswith(f"[learner-0] {line}"), line


def test_verbose_shows_every_line_without_control_codes():
    assert shown_line("actor-0", VLLM_LINES[0], verbose=True) == f"[actor-0] {VLLM_LINES[0]}"
    assert shown_line("actor-0", "Loading\r 50%\x1b[2K done", verbose=True) == "[actor-0] Loading 50% done"


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_plain_console_prints_one_line_per_step_and_no_cursor_codes():
    out, clock = io.StringIO(), FakeClock()
    console = RunConsole(out, title="run t", total=3, live=False, clock=clock)
    console.status(StepStatus(0, 3, startup=True))  # the learner started: nothing to print yet
    console.line("12:00:00 [actor-0] WARNING something odd")
    for step in (1, 2):
        clock.now += 10
        console.status(StepStatus(step, 3, SCALARS))
        console.tick()
    console.close("finished")
    lines = out.getvalue().splitlines()
    assert lines[0] == "12:00:00 [actor-0] WARNING something odd"
    assert [line.split(" |")[0] for line in lines[1:]] == ["step 1/3", "step 2/3"]
    assert lines[-1].endswith("| eta 10s")
    assert "\x1b" not in out.getvalue()


def screen_after(raw: str) -> list[str]:
    """What a terminal shows after ``raw``, for the codes the live console writes (and nothing else)."""
    rows, row = [""], 0
    for token in re.findall(r"\x1b\[\d*[AJ]|\r|\n|[^\x1b\r\n]+", raw):
        if token == "\n":
            row += 1
            rows += [""] * (row + 1 - len(rows))
        elif token == "\r":
            pass  # every line the console writes starts at column 0
        elif token.endswith("A"):
            row -= int(token[2:-1])
        elif token.endswith("J"):
            del rows[row:]
            rows.append("")
        else:
            rows[row] += token
    assert "".join(re.findall(r"\x1b\[\d*[AJ]|\r|\n|[^\x1b\r\n]+", raw)) == raw, "an unexpected escape code"
    return rows[:-1] if rows[-1] == "" else rows


def test_live_console_redraws_its_block_in_place_under_the_lines_that_stay():
    out, clock = io.StringIO(), FakeClock()
    console = RunConsole(out, title="run t", total=3, live=True, clock=clock)
    console.set_phase("starting")
    assert screen_after(out.getvalue())[0].startswith("run t | starting | step 0/3")
    clock.now += 30
    console.status(StepStatus(1, 3, SCALARS))
    console.line("12:00:00 [actor-0] WARNING something odd")
    clock.now += 10
    console.status(StepStatus(2, 3, SCALARS))
    clock.now += 0.5
    console.tick()  # less than a second since the last draw: nothing
    drawn = out.getvalue()
    clock.now += 1.5
    console.tick()
    assert out.getvalue() != drawn
    console.close("finished")
    screen = screen_after(out.getvalue())
    assert screen[0] == "12:00:00 [actor-0] WARNING something odd"
    assert screen[1].startswith("run t | finished | step 2/3 [################--------]  67% | elapsed 42s | ETA 8s")
    assert len(screen) == 5 and screen[4] == "  faults: actor died 1, recovered 1, restarted 1; failed episodes: actor lost 2"
    console.line("after the run")  # the final block stays; later lines go below it
    assert screen_after(out.getvalue())[1:] == screen[1:] + ["after the run"]


def test_a_restarted_learner_keeps_the_last_scalars_on_screen_until_its_next_step():
    console = RunConsole(io.StringIO(), title="run t", total=8, live=True, clock=FakeClock())
    console.status(StepStatus(5, 8, SCALARS))
    console.status(StepStatus(4, 8, {BUFFER_GROUPS: 0.0}, startup=True))  # resumed from the step-4 checkpoint
    lines = console.lines()
    assert "step 4/8" in lines[0] and "buffer 0/16 groups" in lines[2] and "actor died 1" in lines[3]


def test_status_block_and_line_show_the_groups_in_flight_and_the_kv_cache():
    scalars = {**SCALARS, "rollout/groups_in_flight": 6.0, "rollout/kv_cache_usage": 0.734,
               "rollout/engine_preemptions": 12.0}
    lines = status_lines(StepStatus(12, 80, scalars), title="run demo", phase="training", elapsed_s=151.0,
                         eta_s=850.0, width=200)
    assert lines[3] == "  in flight 6 groups | KV cache 73% | preempted 12"
    assert len(lines) == 5 and lines[4].startswith("  faults:")
    assert "| in flight 6 (KV 73%) |" in progress_line(StepStatus(12, 80, scalars))
    record = parse_status_line(status_record_line(12, 80, scalars))
    assert record.scalars["rollout/groups_in_flight"] == 6.0 and record.scalars["rollout/engine_preemptions"] == 12.0
