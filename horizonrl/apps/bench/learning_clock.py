"""Held-out success against the wall clock: the asynchronous design against a synchronous loop, at equal learning.

Every arm is a whole ``horizonrl train`` run of the same config (default ``configs/smollm2_babyai.yaml``: the
format-warmed SmolLM2-135M-Instruct on the demo's BabyAI levels), differing only in its arm's overrides, for the
same number of learner steps, saving a checkpoint every ``--save-every`` steps. Each checkpoint's held-out success
is measured afterwards with ``horizonrl eval`` (the test split, the config's turn budget and token limits, the
engine's dtype), off the clock, so that evaluation never slows the run it measures. A checkpoint's wall time is
when it was complete (its ``train_state.json``), counted from the launch of its run: start-up included, as a user
waits for it.

    arm                      overrides
    synchronous              rollout.synchronous=true           generate one batch, train, broadcast, repeat
    async                    (none)                             the config as it ships
    async_stale              max_staleness 4, 4 steps of buffer, no rollout correction (plain PPO against mu)
    async_stale_corrected    the same, with the decoupled loss and truncated importance weights (token, C = 2)
    async_lora               the config as it ships, training rank-16 LoRA adapters at 10x the learning rate

Runs go seed by seed, the arms' order alternating between seeds (``report.alternate``), so a neighbour's load
hits every arm alike. Reported per arm (median and range over seeds): the final held-out success; the wall time
at which the run first reaches the synchronous arm's final held-out success of the same seed (linear between
checkpoints) and the ratio of the two; samples/s, the learner's and the engines' idle shares, the staleness, and
the trainer-engine mismatch (``mismatch/mean``, ``correction/k3_kl``). Two bounds on the ratio come from the
synchronous runs themselves: with generation g and training t per step, a perfect overlap on hardware of their
own would give (g + t) / max(g, t) (``pipeline_bound``); on one machine whose cores both phases already use, the
overlap can at best fill the CPU time the synchronous loop leaves idle, 1 / its busy CPU share (``cpu_bound``,
from /proc/stat over the run; the machine must be otherwise quiet).

    python -m horizonrl.apps.bench.learning_clock [--out runs/learning-clock] [--seeds 0 1] [--arms ...]
        [--steps 10] [--save-every 2] [--episodes 100] [--peer trl=DIR] [--report]

Every stage is skipped where its result is already on disk (a run whose last checkpoint exists, an evaluation
whose JSON exists), so the study can be stopped and started again.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import time
from pathlib import Path

from horizonrl.apps.bench.report import alternate, progress, summarize
from horizonrl.apps.bench.training import REPO, groups_per_actor, read_scalars, run_training
from horizonrl.core.programs import horizonrl_command
from horizonrl.core.run_dirs import STATE_FILE, checkpoint_dir

CONFIG = REPO / "configs" / "smollm2_babyai.yaml"
STALE = ["buffer.max_staleness=4", "buffer.capacity_groups=16"]
ARMS = {
    "synchronous": ["rollout.synchronous=true"],
    "async": [],
    "async_stale": [*STALE, "algorithm.rollout_correction.is_level=none"],
    "async_stale_corrected": [*STALE, "learner.decoupled_loss=true", "algorithm.rollout_correction.is_level=token",
                              "algorithm.rollout_correction.is_cap=2.0"],
    # LoRA's usual learning rate is ~10x full fine-tuning's (the config's 1e-5); its update is the 9.77 MB adapter
    "async_lora": ["learner.lora.rank=16", "learner.lr=1.0e-4"],
}
# Every arm alike: the synchronous loop makes exactly one batch per version, so no arm's buffer drops
# equal-reward groups (the learner still leaves them out of the step: learner/batching.py), and every arm keeps
# one batch's worth of groups in flight (the synchronous loop plays its whole share at once).
EVERY_ARM = ["buffer.skip_equal_reward_groups=false"]
BASELINE = "synchronous"
RUN_TIMEOUT_S = 4 * 3600.0
EVAL_TIMEOUT_S = 1800.0


def run_command(config: Path, run_dir: Path, arm: str, seed: int, steps: int, save_every: int,
                extra: list[str]) -> list[str]:
    return horizonrl_command("train", str(config), f"run.output_dir={run_dir}", f"run.seed={seed}",
                             f"learner.total_steps={steps}", f"learner.save_every={save_every}", "eval.every=0",
                             *EVERY_ARM, *ARMS[arm], *extra)


def checkpoint_steps(steps: int, save_every: int) -> list[int]:
    return sorted({*range(save_every, steps + 1, save_every), steps})


def cpu_times() -> tuple[float, float]:
    """(busy, total) CPU time of the whole machine so far, in clock ticks (/proc/stat's first line)."""
    fields = [float(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user)
    return total - idle, total


def train_arm(out: Path, config: Path, arm: str, seed: int, steps: int, save_every: int, extra: list[str]) -> Path:
    """One run (skipped if its last checkpoint exists); writes ``clock.json`` with each checkpoint's wall time
    since the launch and the machine's busy CPU share over the run, then drops the checkpoints' optimizer state
    (only the weights are evaluated)."""
    run_dir = out / f"{arm}-s{seed}"
    if (checkpoint_dir(run_dir, steps) / STATE_FILE).exists() and (run_dir / "clock.json").exists():
        return run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    started, (busy0, total0) = time.time(), cpu_times()
    run_training(run_command(config, run_dir, arm, seed, steps, save_every, extra), out / f"{arm}-s{seed}.log",
                 timeout_s=RUN_TIMEOUT_S)
    busy1, total1 = cpu_times()
    clock = {step: (checkpoint_dir(run_dir, step) / STATE_FILE).stat().st_mtime - started
             for step in checkpoint_steps(steps, save_every)}
    (run_dir / "clock.json").write_text(json.dumps({"launched": started, "checkpoint_wall_s": clock,
                                                    "cpu_busy_share": (busy1 - busy0) / (total1 - total0)}, indent=1))
    for step in clock:
        shutil.rmtree(checkpoint_dir(run_dir, step) / "train_state", ignore_errors=True)
    return run_dir


def eval_settings(cfg) -> dict:
    """What ``horizonrl eval`` needs to play the config's held-out episodes as the demo does (core/config.py)."""
    from horizonrl.core.schedule import TurnBudgetSchedule

    if len(cfg.envs) != 1:
        raise ValueError(f"the study evaluates one environment, the config has {len(cfg.envs)}")
    env = cfg.envs[0]
    turns = cfg.eval.max_turns or TurnBudgetSchedule.from_config(cfg.algorithm.rounds_ctrl).final_max_turns
    return {"env": env.name, "settings": dict(env.settings), "max_turns": turns, "dtype": cfg.rollout.engine.dtype,
            "max_tokens": cfg.rollout.max_tokens_per_turn, "context": cfg.rollout.max_context_tokens,
            "temperature": cfg.eval.temperature, "system_prompt": cfg.rollout.system_prompt,
            "model": cfg.model.path}


def evaluate(model_dir: Path, out_json: Path, spec: dict, episodes: int) -> float:
    """Held-out success of one model directory (cached in ``out_json``)."""
    if not out_json.exists():
        command = horizonrl_command(
            "eval", "--model", str(model_dir), "--env", spec["env"], "--env-settings", json.dumps(spec["settings"]),
            "--episodes", str(episodes), "--max-turns", str(spec["max_turns"]), "--dtype", spec["dtype"],
            "--max-tokens-per-turn", str(spec["max_tokens"]), "--max-context-tokens", str(spec["context"]),
            "--temperature", str(spec["temperature"]), "--json", str(out_json))
        if spec["system_prompt"]:
            command += ["--system-prompt", spec["system_prompt"]]
        with open(out_json.with_suffix(".log"), "wb") as log:
            subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, check=True,
                           timeout=EVAL_TIMEOUT_S)
    return float(json.loads(out_json.read_text())["success_rate"])


def reach_time(curve: list[tuple[float, float]], target: float) -> float | None:
    """The first wall time at which the piecewise-linear ``curve`` [(wall_s, success), ...] reaches ``target``."""
    for (t0, y0), (t1, y1) in zip(curve, curve[1:]):
        if y0 >= target:
            return t0
        if y1 >= target:
            return t0 + (t1 - t0) * (target - y0) / (y1 - y0)
    return curve[-1][0] if curve and curve[-1][1] >= target else None


def run_figures(run_dir: Path, steps: int) -> dict[str, float]:
    """Throughput, idle shares, staleness and mismatch over learner steps 1..steps (the run's scalars)."""
    s = read_scalars(run_dir)

    def mean(tag: str) -> float:
        values = [v for k, v in s.get(tag, {}).items() if 1 <= k <= steps]
        return sum(values) / len(values) if values else float("nan")

    wall = s["time/elapsed_s"][steps] - s["time/elapsed_s"][1]
    engine_wall = s["rollout/engine_wall_s_total"][steps] - s["rollout/engine_wall_s_total"][1]
    batch_wait = sum(s["time/batch_wait_s"][k] for k in range(2, steps + 1))
    train = sum(s["time/step_s"][k] for k in range(2, steps + 1))
    return {
        "samples_per_s": sum(s["batch/trajectories"][k] for k in range(2, steps + 1)) / wall,
        "learner_idle_share": batch_wait / wall,
        "engine_idle_share": (s["rollout/engine_idle_s_total"][steps] - s["rollout/engine_idle_s_total"][1])
        / engine_wall,
        "generate_s_per_step": batch_wait / (steps - 1), "train_s_per_step": train / (steps - 1),
        "staleness": mean("batch/staleness_mean"), "mismatch_mean": mean("mismatch/mean"),
        "k3_kl": mean("correction/k3_kl"), "truncated_fraction": mean("correction/truncated_fraction"),
    }


def pipeline_bound(generate_s: float, train_s: float) -> float:
    """The speed-up a perfect overlap of a synchronous loop's phases could give on hardware of their own:
    (g + t) / max(g, t)."""
    return (generate_s + train_s) / max(generate_s, train_s)


def peer_curve(peer_dir: Path, start_success: float) -> dict:
    """A peer's run written by scripts/peer_trl.py: ``heldout.jsonl`` (step, wall seconds, success_rate) per
    checkpoint. Its clock is ``script_wall_s`` where the peer wrote it (since its script began, model loading
    included, as horizonrl's runs count from their launch); its curve starts, as theirs, at the shared starting
    model's success."""
    rows = [json.loads(line) for line in (peer_dir / "heldout.jsonl").read_text().splitlines() if line.strip()]
    points = sorted((r.get("script_wall_s", r["wall_s"]), r["success_rate"]) for r in rows)
    return {"curve": [(0.0, start_success), *points]}


def peer_summary(peer: dict, base: dict[str, dict]) -> dict:
    """A peer's one run against the baseline's seeds: its final success and wall time, and the time it took to
    reach the baseline runs' median final success, with the baseline's median wall time over that."""
    finals = sorted(r["curve"][-1][1] for r in base.values())
    walls = sorted(r["curve"][-1][0] for r in base.values())
    row: dict = {"final_success": peer["curve"][-1][1], "wall_min": peer["curve"][-1][0] / 60, "reached": "0/1"}
    if finals:
        t = reach_time(peer["curve"], finals[len(finals) // 2])
        if t:
            row.update(reach_baseline_min=t / 60, baseline_time_ratio=walls[len(walls) // 2] / t, reached="1/1")
    return row


def reach_peer(runs: dict[str, dict[str, dict]], peer: dict) -> dict[str, dict]:
    """Per arm: the wall time each seed's run took to reach the peer's final success, and the peer's wall time over
    it (the issue's goal against TRL: >= 2)."""
    target, peer_wall = peer["curve"][-1][1], peer["curve"][-1][0]
    out = {}
    for arm, by_seed in runs.items():
        times = [t for r in by_seed.values() if (t := reach_time(r["curve"], target))]
        row = {"reached": f"{len(times)}/{len(by_seed)}"}
        if times:
            row.update(reach_min=summarize([t / 60 for t in times]),
                       time_ratio=summarize([peer_wall / t for t in times]))
        out[arm] = row
    return out


def study(out: Path, config: Path, arms: list[str], seeds: list[int], steps: int, save_every: int, episodes: int,
          extra: list[str], train_only: bool = False) -> dict | None:
    from horizonrl.core.config import load_config

    out.mkdir(parents=True, exist_ok=True)
    cfg = load_config(config, extra)
    spec = eval_settings(cfg)
    extra = [*extra, f"rollout.groups_in_flight={groups_per_actor(cfg)}"]
    for r, seed in enumerate(seeds):
        for arm in alternate(r, arms):
            progress("learning-clock", f"seed {seed}: {arm}, {steps} learner steps")
            started = time.time()
            train_arm(out, config, arm, seed, steps, save_every, extra)
            progress("learning-clock", f"  {arm} s{seed}: {time.time() - started:.0f} s")
    if train_only:
        return None
    evals = out / "evals"
    evals.mkdir(exist_ok=True)
    start = evaluate(REPO / spec["model"], evals / "start.json", spec, episodes)
    progress("learning-clock", f"starting model: held-out {start:.3f}")
    runs: dict[str, dict[str, dict]] = {arm: {} for arm in arms}  # arm -> seed (as a JSON key) -> run
    for seed in seeds:
        for arm in arms:
            run_dir = out / f"{arm}-s{seed}"
            timing = json.loads((run_dir / "clock.json").read_text())
            clock = {int(step): wall_s for step, wall_s in timing["checkpoint_wall_s"].items()}
            curve = [(0.0, start)]
            for step, wall_s in sorted(clock.items()):
                success = evaluate(checkpoint_dir(run_dir, step), evals / f"{arm}-s{seed}-step{step}.json", spec,
                                   episodes)
                curve.append((wall_s, success))
                progress("learning-clock", f"{arm} s{seed} step {step}: held-out {success:.3f} "
                         f"at {wall_s / 60:.1f} min")
            runs[arm][str(seed)] = {"curve": curve, "cpu_busy_share": timing.get("cpu_busy_share", float("nan")),
                                    **run_figures(run_dir, steps)}
    return {"config": str(config.relative_to(REPO) if config.is_relative_to(REPO) else config), "overrides": extra,
            "arms": {arm: ARMS[arm] for arm in arms}, "seeds": seeds, "steps": steps, "save_every": save_every,
            "episodes": episodes, "start_success": start, "runs": runs}


def summary(result: dict) -> dict[str, dict]:
    """Per arm: summaries over seeds of the final success, the time to reach the baseline's final success, the
    paired ratio of the baseline's time to it, and the run figures; the baseline's 2-core bounds."""
    runs = result["runs"]
    base = runs.get(BASELINE, {})
    out = {}
    for arm, by_seed in runs.items():
        row: dict[str, dict] = {}
        finals = [r["curve"][-1][1] for r in by_seed.values()]
        row["final_success"] = summarize(finals)
        row["wall_min"] = summarize([r["curve"][-1][0] / 60 for r in by_seed.values()])
        reach, ratios = [], []
        for seed, r in by_seed.items():
            if seed not in base:
                continue
            b = base[seed]
            t = reach_time(r["curve"], b["curve"][-1][1])
            if t:  # None: never reached; 0: the starting model already had it (no time to compare)
                reach.append(t / 60)
                ratios.append(b["curve"][-1][0] / t)
        if reach:
            row["reach_baseline_min"] = summarize(reach)
            row["baseline_time_ratio"] = summarize(ratios)
        row["reached"] = f"{len(reach)}/{len(by_seed)}"
        for key in ("cpu_busy_share", "samples_per_s", "learner_idle_share", "engine_idle_share", "staleness",
                    "mismatch_mean", "k3_kl", "truncated_fraction", "generate_s_per_step", "train_s_per_step"):
            values = [r[key] for r in by_seed.values() if r[key] == r[key]]
            if values:
                row[key] = summarize(values)
        out[arm] = row
    if base:
        bounds = [{"pipeline_bound": pipeline_bound(r["generate_s_per_step"], r["train_s_per_step"]),
                   **({"cpu_bound": 1 / r["cpu_busy_share"]} if r.get("cpu_busy_share", 0) > 0 else {})}
                  for r in base.values()]
        out[BASELINE]["bounds"] = {k: summarize([b[k] for b in bounds]) for k in bounds[0]}
    return out


def _cell(value) -> str:
    if isinstance(value, dict) and "median" in value:
        return f"{value['median']:.3g} [{value['min']:.3g}–{value['max']:.3g}]"
    return f"{value:.3g}" if isinstance(value, float) else str(value)


def table(rows: dict[str, dict]) -> str:
    columns = ("final_success", "wall_min", "reach_baseline_min", "baseline_time_ratio", "reached", "cpu_busy_share",
               "samples_per_s",
               "learner_idle_share", "engine_idle_share", "staleness", "mismatch_mean", "k3_kl")
    lines = ["| arm | " + " | ".join(columns) + " |", "|---|" + "---|" * len(columns)]
    for arm, row in rows.items():
        lines.append(f"| {arm} | " + " | ".join(_cell(row.get(c, "–")) for c in columns) + " |")
    bounds = rows.get(BASELINE, {}).get("bounds")
    if bounds:
        lines.append("")
        lines.append("bounds from the synchronous runs' phases: "
                     + ", ".join(f"{k} {_cell(v)}" for k, v in bounds.items()))
    return "\n".join(lines)


def plot(result: dict, peers: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for k, (arm, by_seed) in enumerate({**result["runs"], **{n: {"0": p} for n, p in peers.items()}}.items()):
        for j, r in enumerate(by_seed.values()):
            xs, ys = zip(*r["curve"])
            ax.plot([x / 60 for x in xs], ys, marker="o", ms=3, color=colors[k % len(colors)], alpha=0.8,
                    label=arm if j == 0 else None)
    ax.set_xlabel("wall-clock minutes since launch (start-up included)")
    ax.set_ylabel("held-out success")
    ax.set_title(f"{result['config']}: held-out success against the wall clock, seeds {result['seeds']}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("runs/learning-clock"))
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--arms", nargs="+", default=list(ARMS), choices=list(ARMS))
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--steps", type=int, default=10, help="learner steps of every run")
    parser.add_argument("--save-every", type=int, default=2, help="a checkpoint (and a point on the curve) every N")
    parser.add_argument("--episodes", type=int, default=100, help="held-out episodes per evaluation")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a config override, every arm")
    parser.add_argument("--peer", action="append", default=[], metavar="NAME=DIR",
                        help="a peer's run to plot beside (scripts/peer_trl.py's output directory)")
    parser.add_argument("--report", action="store_true", help="only the table and plot of --out's results.json")
    parser.add_argument("--train-only", action="store_true",
                        help="only the timed runs (the evaluations, off the clock, can run later on a busy machine)")
    args = parser.parse_args(argv)
    path = args.out / "results.json"
    if args.report:
        result = json.loads(path.read_text())
    else:
        if not args.config.resolve().exists():
            parser.error(f"--config {args.config}: no such file")
        result = study(args.out.resolve(), args.config.resolve(), args.arms, args.seeds, args.steps, args.save_every,
                       args.episodes, args.set, args.train_only)
        if result is None:
            return
    peers = {}
    for item in args.peer:
        name, _, directory = item.partition("=")
        peers[name] = peer_curve(Path(directory), result["start_success"])
    result["peers"] = peers
    result["summary"] = summary(result)
    for name, peer in peers.items():  # one run each: its own row, read against the baseline's median
        result["summary"][name] = peer_summary(peer, result["runs"].get(BASELINE, {}))
        result[f"reach_{name}"] = reach_peer(result["runs"], peer)
    path.write_text(json.dumps(result, indent=1))
    plot(result, peers, args.out / "learning-clock.png")
    print(table(result["summary"]))
    for name in peers:
        print(f"\ntime to reach {name}'s final held-out success ({peers[name]['curve'][-1][1]:.3f} at "
              f"{peers[name]['curve'][-1][0] / 60:.1f} min):")
        for arm, row in result[f"reach_{name}"].items():
            print(f"  {arm}: " + ", ".join(f"{k} {_cell(v)}" for k, v in row.items()))
    print(f"results: {path}; plot: {args.out / 'learning-clock.png'}")


if __name__ == "__main__":
    main()
