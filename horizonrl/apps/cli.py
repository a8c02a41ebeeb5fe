"""``horizonrl`` command line. Heavy modules are imported inside each command, so
``--help`` answers at once.

Commands:
  train CONFIG [key=value ...]   launch a whole run (coordinator, buffer, learner ranks, actors); launcher.type=
                                 local (subprocesses here) or ray (a Ray cluster)
  slurm CONFIG [key=value ...]   the run as a Slurm batch script (horizonrl slurm CONFIG > job.sbatch)
  demo                           build the tiny model, evaluate, train on the CPU, evaluate again
  eval                           success rate of a model on held-out tasks
  make-tiny-model OUT_DIR        a tiny Qwen2 model + tokenizer, format-warmed on random episodes
  make-model smollm2 OUT_DIR     a packaged pretrained model (SmolLM2-135M-Instruct) as a Hugging Face checkpoint
  import-gguf FILE OUT_DIR       a GGUF model file as a Hugging Face checkpoint
  make-warmup-data CONFIG OUT    random-policy episodes as SFT data for a format warm-up (horizonrl sft)
  sft | dpo CONFIG [key=value ...]
                                 offline SFT / DPO on AgentGym trajectories (docs/offline.md)
  make-expert-data OUT           Signpost expert trajectories / pairs in AgentGym's format
  make-corpus OUT_DIR            SearchQA's synthetic corpus and questions
  make-webarena-tasks            the bundled WebArena sites' tasks and expert plans
  bench [--quick] [--parts ...]  throughput benchmarks, async vs synchronous (docs/benchmarks.md)
  chaos CONFIG --kill ROLE|...   a run under one kind of fault at random times: kill -9, SIGSTOP of an engine,
                                 a hostile-message storm, a full disk (docs/faults.md)
  accounting RUN_DIR             where every trajectory of a run went (docs/durability.md)
  import-agentgym-rl SCRIPT.sh   an AgentGym-RL training script as a horizonrl config (docs/agentgym-rl.md)
  view RUN_DIR                   browse a run's recorded episodes in the browser, live (docs/episodes.md)
  report RUN_DIR [RUN_DIR ...]   learning curves of runs from their TensorBoard events: PNG + table (docs/learning.md)
  env ...                        list / check / serve environments
  endpoint --model DIR           the OpenAI-compatible endpoint alone in front of one engine (docs/agents.md)
  agent-eval CONFIG              held-out success of the config's agent program through the endpoint
  coordinator | buffer | learner | actor --config RESOLVED.yaml
                                 one process of a run, started alone (for debugging)
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
from pathlib import Path


def _add_train(sub) -> None:
    p = sub.add_parser("train", help="launch a training run from a YAML config",
                       description="Launch a training run. Overrides use dotted keys, e.g. "
                                   "algorithm.rounds_ctrl.rounds=[10,20,30] learner.total_steps=200; "
                                   "resume=PATH|auto continues from a checkpoint (auto: the newest in "
                                   "run.output_dir)")
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted.key=value (values parsed as YAML)")
    p.add_argument("--tensorboard", action="store_true", help="also start TensorBoard on 127.0.0.1 and print its URL")
    p.add_argument("--dry-run", action="store_true", help="print the resolved config and the device placement "
                                                          "(which GPUs each learner rank and engine gets), and exit")
    p.add_argument("--verbose", action="store_true",
                   help="show every line the run's processes write (vLLM's included; they always go to "
                        "<output_dir>/logs/) and one plain line per step, instead of the status block")
    p.set_defaults(func=_cmd_train)


def _cmd_train(args) -> int:
    from horizonrl.core.config import dump_config, load_config
    from horizonrl.launcher import launch

    # `resume=PATH|auto` is short for learner.resume=...
    overrides = [f"learner.{o}" if o.startswith("resume=") else o for o in args.overrides]
    config = load_config(args.config, overrides)
    if args.dry_run:
        from horizonrl.launcher import resolve_placement

        print(dump_config(config), end="")
        if config.launcher.type not in ("local", "inline"):
            # On a cluster the scheduler picks the GPUs: show the bundles it is asked for.
            from horizonrl.core.placement import cluster_bundles

            gpus = config.resources.device != "cpu" and config.launcher.ray.gpus is not False
            bundles = cluster_bundles(config, gpus=gpus, cpus_per_process=config.launcher.ray.cpus_per_process)
            print(f"\n# {config.launcher.type}: one bundle per process" + (" (GPU bundles where the cluster has GPUs)"
                                                                         if gpus else ""))
            print("\n".join(f"#   {b.name}: {b.resources}" for b in bundles))
            return 0
        # The device plan as `train` would use it on this host, as YAML comments (the output stays loadable
        # YAML); a placement `train` would refuse is refused the same way (a ConfigError naming the fix).
        plan = resolve_placement(config)
        print("\n" + "\n".join(f"# {line}" for line in plan.table().splitlines()))
        return 0
    if config.launcher.type == "inline":
        from horizonrl.apps.inline_run import launch_inline
        from horizonrl.core.runtime import exit_skipping_finalization

        if args.tensorboard:
            print("--tensorboard is not started by launcher.type=inline: run tensorboard --logdir "
                  f"{config.run_dir.tensorboard}", file=sys.stderr)
        # As the roles' own processes do: the learner's gloo threads and what vLLM imported can abort or stall the
        # interpreter's finalization after a clean end.
        exit_skipping_finalization(launch_inline(config, verbose=args.verbose))
    return launch(config, tensorboard=args.tensorboard, verbose=args.verbose)


def _add_slurm(sub) -> None:
    p = sub.add_parser("slurm", help="the run as a Slurm batch script: horizonrl slurm CONFIG > job.sbatch",
                       description="Write the run as one Slurm batch job to stdout: one `srun --exact` step per "
                                   "process (the learner's ranks under torchrun), restarts of actors and the buffer, "
                                   "the coordinator on the job's first node (docs/cluster.md). Submit it with "
                                   "`sbatch job.sbatch`. Settings: launcher.slurm.* (nodes, gpus_per_node, partition, "
                                   "time, setup lines...).")
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted.key=value (values parsed as YAML)")
    p.add_argument("--prepare", action="store_true",
                   help="(run by the job itself) write <output_dir>/config.yaml for the coordinator at "
                        "--coordinator-host and print its path")
    p.add_argument("--coordinator-host", default=None, help="with --prepare: the first node's address")
    p.set_defaults(func=_cmd_slurm)


def _cmd_slurm(args) -> int:
    from horizonrl.core.config import load_config
    from horizonrl.launcher.slurm import prepare_slurm_run, sbatch_script

    overrides = [f"learner.{o}" if o.startswith("resume=") else o for o in args.overrides]
    config = load_config(args.config, ["launcher.type=slurm", *overrides])
    if args.prepare:
        if not args.coordinator_host:
            print("error: --prepare needs --coordinator-host", file=sys.stderr)
            return 2
        print(prepare_slurm_run(config, args.coordinator_host))
        return 0
    script = sbatch_script(config)
    # Slurm opens the job's output file (#SBATCH --output=<output_dir>/logs/...) before the script runs.
    config.run_dir.logs.mkdir(parents=True, exist_ok=True)
    sys.stdout.write(script)
    return 0


def _add_role(sub, role: str, help_text: str, indexed: bool = False) -> None:
    p = sub.add_parser(role, help=help_text, description=f"{help_text}. Reads the resolved config that "
                                                         "`horizonrl train` writes to <output_dir>/config.yaml.")
    p.add_argument("--config", type=Path, required=True)
    if indexed:
        p.add_argument("--index", type=int, default=0, help="which actor (0-based)")
    if role == "learner":
        p.add_argument("--resume", default=None, metavar="PATH|auto",
                       help="resume from this checkpoint, or the newest complete one (the launcher restarts a "
                            "learner with --resume auto); overrides learner.resume")
    p.set_defaults(func=_cmd_role, role=role)


def _cmd_role(args) -> int:
    from horizonrl.apps.roles import run_role
    from horizonrl.core.config import load_config

    config = load_config(args.config, [f"learner.resume={args.resume}"] if getattr(args, "resume", None) else [])
    return run_role(args.role, config, getattr(args, "index", 0))


def _add_eval(sub) -> None:
    p = sub.add_parser("eval", help="success rate of a model on held-out tasks")
    p.add_argument("--model", required=True, help="Hugging Face model directory")
    p.add_argument("--env", required=True)
    p.add_argument("--env-settings", default="{}", help="JSON settings for the environment")
    p.add_argument("--split", default="test")
    p.add_argument("--episodes", type=int, default=100)
    p.add_argument("--max-turns", type=int, default=20)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens-per-turn", type=int, default=64)
    p.add_argument("--max-context-tokens", type=int, default=2048)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=("auto", "float32", "bfloat16", "float16"), default="auto",
                   help="the engine's dtype (rollout.engine.dtype; auto: bfloat16 on a GPU, float32 on the CPU)")
    p.add_argument("--system-prompt", default=None, help="a system prompt, as rollout.system_prompt in training")
    p.add_argument("--context", choices=("cut", "window", "summarize"), default="cut",
                   help="past the context, as rollout.context.policy in training: end the episode (cut), go on "
                        "with the oldest turns dropped (window) or with the model's summary of them (summarize)")
    p.add_argument("--window-fill", type=float, default=0.5, help="rollout.context.window_fill (window)")
    p.add_argument("--max-segments", type=int, default=4, help="rollout.context.max_segments (window, summarize)")
    p.add_argument("--summary-tokens", type=int, default=128, help="rollout.context.summary_tokens (summarize)")
    p.add_argument("--kv-cache-gib", type=float, default=None,
                   help="the engine's KV cache on the CPU (rollout.engine.kv_cache_gib; default 1)")
    p.add_argument("--ids", type=Path, default=None, help="file of task ids (one per line, or a JSON list); "
                                                        "default: the first --episodes ids of --split")
    p.add_argument("--k", type=int, default=1, help="report pass@1 and pass@K (unbiased, Chen et al. 2021)")
    p.add_argument("--samples", type=int, default=None, help="episodes per task (>= K; default K)")
    p.add_argument("--json", type=Path, default=None, help="also write the JSON result to this file")
    p.add_argument("--record", type=Path, default=None,
                   help="also record every episode as text in this directory (docs/episodes.md; e.g. "
                        "<output_dir>/episodes of a run, so that `horizonrl view` shows them beside its training)")
    p.set_defaults(func=_cmd_eval)


def _cmd_eval(args) -> int:
    from horizonrl.actors.context import ContextPolicy
    from horizonrl.actors.evaluate import EvalSpec, evaluate, format_table
    from horizonrl.core.config import EngineConfig
    from horizonrl.core.runtime import setup_logging
    from horizonrl.envs import make_env

    if args.k < 1 or (args.samples is not None and args.samples < args.k):
        print("error: need --k >= 1 and --samples >= --k", file=sys.stderr)
        return 2
    if not 0 < args.window_fill < 1 or args.max_segments < 2 or args.summary_tokens < 8:
        print("error: need 0 < --window-fill < 1, --max-segments >= 2 and --summary-tokens >= 8", file=sys.stderr)
        return 2
    setup_logging("eval", "WARNING")
    spec = EvalSpec(env=args.env, env_settings=json.loads(args.env_settings), split=args.split,
                    episodes=args.episodes, max_turns=args.max_turns, temperature=args.temperature,
                    max_tokens_per_turn=args.max_tokens_per_turn, max_context_tokens=args.max_context_tokens,
                    seed=args.seed, task_ids=_read_ids(args.ids, args.env) if args.ids else None, k=args.k,
                    samples=args.samples, system_prompt=args.system_prompt,
                    context=ContextPolicy(args.context, args.window_fill, args.max_segments, args.summary_tokens))
    engine = EngineConfig(dtype=args.dtype, **({"kv_cache_gib": args.kv_cache_gib} if args.kv_cache_gib else {}))
    result = evaluate(args.model, spec, make_env, engine_config=engine, record_dir=args.record)
    print(format_table(result))
    print(json.dumps(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


def _read_ids(path: Path, env: str) -> tuple[int, ...]:
    """Task ids from a file: a JSON list of integers, one integer per line (blank lines and # comments
    ignored), or AgentGym-RL's id files (``[{"item_id": "babyai_12"}, ...]``, or JSON Lines), whose
    environment must be ``env``."""
    from horizonrl.core.config import ConfigError
    from horizonrl.envs.ids import read_ids

    text = path.read_text().strip()
    if text.startswith("["):
        values = json.loads(text)
        if all(isinstance(x, int) for x in values):
            return tuple(values)
    else:
        lines = [line.split("#", 1)[0].strip() for line in text.splitlines()]
        if all(line.isdigit() for line in lines if line):
            return tuple(int(line) for line in lines if line)
    rows = read_ids(path)
    others = sorted({name for name, _ in rows if name != env})
    if others:
        raise ConfigError(f"{path}: ids of {others}, but --env is {env!r}")
    return tuple(index for _, index in rows)


def _add_demo(sub) -> None:
    p = sub.add_parser("demo", help="train the tiny model on the CPU and show success rising")
    p.add_argument("--config", type=Path, default=None, help="default: configs/demo.yaml")
    p.add_argument("overrides", nargs="*", help="dotted.key=value")
    p.add_argument("--tensorboard", action="store_true")
    p.add_argument("--verbose", action="store_true",
                   help="show every line the run's processes write (vLLM's included; they always go to "
                        "<output_dir>/logs/) and one plain line per step, instead of the status block")
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args) -> int:
    from horizonrl.apps.demo import run_demo

    return run_demo(args.config, args.overrides, tensorboard=args.tensorboard, verbose=args.verbose)


def _add_tiny(sub) -> None:
    # Listed for --help; main() hands its arguments to horizonrl.apps.tiny_model.main.
    sub.add_parser("make-tiny-model", help="build a tiny Qwen2 model and tokenizer for CPU runs "
                                           "(see `horizonrl make-tiny-model --help`)")
    sub.add_parser("make-model", help="a packaged pretrained model (smollm2: SmolLM2-135M-Instruct) as a Hugging Face "
                                      "checkpoint (see `horizonrl make-model --help`)")
    sub.add_parser("make-warmup-data", help="random-policy episodes of a config's environments as SFT data for a "
                                            "format warm-up (see `horizonrl make-warmup-data --help`)")
    sub.add_parser("import-gguf", help="a GGUF model file as a Hugging Face checkpoint (see `horizonrl import-gguf "
                                       "--help`)")
    sub.add_parser("endpoint", help="the OpenAI-compatible endpoint alone in front of one engine (see `horizonrl "
                                    "endpoint --help`)")
    sub.add_parser("agent-eval", help="held-out success of a config's agent program (rollout.agent) through the "
                                      "endpoint (see `horizonrl agent-eval --help`)")


def _add_env(sub) -> None:
    p = sub.add_parser("env", help="list, check and serve environments")
    env_sub = p.add_subparsers(dest="env_command", required=True)
    from horizonrl.apps.env_cli import add_env_commands

    add_env_commands(env_sub)


def _add_offline(sub) -> None:
    for name, what in (("sft", "supervised fine-tuning on AgentGym trajectories (loss on the gpt turns)"),
                       ("dpo", "DPO on pairs of trajectories (chosen, rejected) against the starting model")):
        p = sub.add_parser(name, help=what, description=f"{what}, on FSDP; writes a Hugging Face checkpoint to "
                           "<output_dir>/final that `horizonrl train ... model.path=` starts from (docs/offline.md)")
        p.add_argument("config", type=Path)
        p.add_argument("overrides", nargs="*",
                       help="dotted.key=value (values parsed as YAML), e.g. lr=1e-5 num_ranks=2")
        p.add_argument("--dry-run", action="store_true", help="print the resolved config and exit")
        p.set_defaults(func=_cmd_offline, paradigm=name)
    from horizonrl.apps import env_data

    p = sub.add_parser("make-expert-data", help="write Signpost expert trajectories (sft) or pairs (dpo) in "
                                                "AgentGym's format")
    env_data.add_expert_data_arguments(p)
    p.set_defaults(func=env_data.run_expert_data)
    p = sub.add_parser("make-corpus", help="write SearchQA's synthetic corpus and questions (corpus.jsonl, "
                                           "train.jsonl, test.jsonl)")
    env_data.add_corpus_arguments(p)
    p.set_defaults(func=env_data.run_corpus)
    p = sub.add_parser("make-webarena-tasks", help="write the bundled WebArena sites' tasks and expert plans")
    p.set_defaults(func=env_data.run_webarena_tasks)


def _cmd_offline(args) -> int:
    from horizonrl.core.offline_config import dump_offline_config, load_offline_config
    from horizonrl.core.runtime import setup_logging

    config = load_offline_config(args.config, args.overrides)
    if args.dry_run:
        print(dump_offline_config(config), end="")
        return 0
    setup_logging(args.paradigm, config.log_level)
    from horizonrl.learner.offline import run_offline
    from horizonrl.core.agentgym_records import OfflineDataError

    try:
        summary = run_offline(config, args.paradigm)
    except (OfflineDataError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: summary.get(k) for k in ("checkpoint", "steps", "before", "after")}))
    return 0


def _add_run_tools(sub) -> None:
    p = sub.add_parser("accounting", help="where every trajectory of a run went (trained, dropped, held, lost)",
                       description="Read a run directory (the buffer's write-ahead log, the checkpoints, the actors' "
                                   "outboxes) and print, as JSON, how many trajectories were trained once, left out "
                                   "or dropped (by reason), or are still held — and any lost or trained twice.")
    p.add_argument("run_dir", type=Path)
    p.set_defaults(func=_cmd_accounting)
    p = sub.add_parser("chaos", help="a training run under one kind of fault fired at random times",
                       description="Start `horizonrl train CONFIG`, fire one kind of fault at random times (0.5-1.5 x "
                                   "--every) for --duration seconds from its first learner step — kill -9 of a "
                                   "process, SIGSTOP of an engine, a storm of hostile messages, a full disk, a squat "
                                   "of the coordinator's ports, keyless joins of the weight hub — stop the run "
                                   "(Ctrl-C), and print what was fired, deaths, restarts, time to recover and "
                                   "the accounting of every trajectory (docs/faults.md).")
    p.add_argument("config", type=Path)
    p.add_argument("overrides", nargs="*", help="dotted.key=value (values parsed as YAML)")
    fault = p.add_mutually_exclusive_group(required=True)
    fault.add_argument("--kill", choices=["actor", "buffer", "learner", "env-server", "coordinator"],
                       help="kill -9 a process of this kind")
    fault.add_argument("--freeze-engine", type=float, metavar="SECONDS",
                       help="SIGSTOP an actor's vLLM EngineCore, SIGCONT it this long after")
    fault.add_argument("--storm", type=int, metavar="N",
                       help="send N malformed or hostile messages to each socket of the run (none can be trained on "
                            "or change its state; the run's processes count them)")
    fault.add_argument("--fill-disk", type=float, metavar="SECONDS",
                       help="fill the run directory's file system to the last byte for this long, then free it "
                            "(refused when it has more than --fill-max-gb free: give the run a small file system)")
    fault.add_argument("--squat-coordinator", type=float, metavar="SECONDS",
                       help="kill -9 the coordinator and bind its two ports before its replacement can, holding them "
                            "this long: forged Controls out, every report swallowed (the local launcher holds the "
                            "ports for the run: nothing is left to bind)")
    fault.add_argument("--fake-join", type=int, metavar="N",
                       help="N joins of the learner's weight hub without the run's key (one as actor 0) that never "
                            "receive")
    p.add_argument("--fill-max-gb", type=float, default=4.0, help="with --fill-disk: the most it may write")
    p.add_argument("--every", type=float, default=30.0, help="mean seconds between faults")
    p.add_argument("--duration", type=float, default=300.0,
                   help="seconds from the run's first learner step until it is stopped")
    p.add_argument("--from-start", action="store_true",
                   help="fire from the launch on (start-up included) and count --duration from it")
    p.add_argument("--seed", type=int, default=0, help="the faults' random times and victims")
    p.add_argument("--baseline", action="store_true",
                   help="first run the same config for the same time without kills (into OUTPUT_DIR-baseline) "
                        "and print the throughput ratio")
    p.set_defaults(func=_cmd_chaos)
    p = sub.add_parser("keys", help="make CurveZMQ keys for a run whose processes talk across machines",
                       description="Write a server and a client key pair into DIR (0700; key files 0600). Point "
                                   "every process at it with network.curve_keys_dir=DIR; runs off loopback refuse "
                                   "to start without it.")
    p.add_argument("dir", type=Path)
    p.set_defaults(func=_cmd_keys)


def _cmd_accounting(args) -> int:
    from horizonrl.buffer.accounting import account

    result = account(args.run_dir)
    print(json.dumps(result, indent=1))
    return 0 if not result["lost"] and not result["trained_twice"] and not result["in_two_fates"] else 1


def _cmd_chaos(args) -> int:
    from horizonrl.apps.chaos import main as chaos_main

    return chaos_main(args.config, args.overrides, every_s=args.every, duration_s=args.duration, seed=args.seed,
                      baseline=args.baseline, from_start=args.from_start, kill=args.kill,
                      freeze_engine_s=args.freeze_engine, storm=args.storm, fill_disk_s=args.fill_disk,
                      fill_max_gb=args.fill_max_gb, squat_coordinator_s=args.squat_coordinator,
                      fake_join=args.fake_join)


def _cmd_keys(args) -> int:
    from horizonrl.protocol.transport import generate_keys

    print(f"CurveZMQ keys in {generate_keys(args.dir)}; use network.curve_keys_dir={args.dir}")
    return 0


def _add_import_agentgym_rl(sub) -> None:
    p = sub.add_parser("import-agentgym-rl", help="convert an AgentGym-RL training script into a horizonrl config",
                       description="Read an AgentGym-RL training script (shell variables, `python3 -m "
                                   "verl.agent_trainer.main_ppo key=value ...`), print the horizonrl config it maps "
                                   "to on stdout and every setting not mapped, with why, on stderr "
                                   "(docs/agentgym-rl.md). Example: horizonrl import-agentgym-rl babyai_train.sh > "
                                   "config.yaml")
    p.add_argument("script", type=Path)
    p.add_argument("--var", action="append", default=[], metavar="NAME=VALUE",
                   help="a shell variable the script uses but does not set (its arguments: 1=...); repeatable")
    p.add_argument("--data-root", type=Path, default=None,
                   help="where the script's relative data.train_file is (default: the current directory and the "
                        "script's, after the script's own cd)")
    p.add_argument("--train-items", type=int, default=None,
                   help="ids in data.train_file, when the file is not at hand (sets learner.total_steps)")
    p.add_argument("--full", action="store_true", help="print every setting, horizonrl's defaults included")
    p.add_argument("--explain", action="store_true", help="also list every mapping made, on stderr")
    p.set_defaults(func=_cmd_import_agentgym_rl)


def _cmd_import_agentgym_rl(args) -> int:
    from horizonrl.apps.import_agentgym_rl import main as import_main

    return import_main(args.script, variables=args.var, data_root=args.data_root, train_items=args.train_items,
                       full=args.full, explain=args.explain)


def _add_view(sub) -> None:
    p = sub.add_parser("view", help="browse a run's recorded episodes in the browser (docs/episodes.md)",
                       description="Serve a local web page of the episodes recorded under RUN_DIR/episodes (or a "
                                   "directory `horizonrl eval --record` wrote): filters, search, turn-by-turn "
                                   "replays with BabyAI's grid, the same task early vs late, the episodes each "
                                   "learner step trained on. New episodes appear while the run goes on.")
    p.add_argument("run_dir", type=Path)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    p.add_argument("--port", type=int, default=8787, help="0 picks a free port; the URL is printed")
    p.add_argument("--env-settings", action="append", default=[], metavar="NAME=JSON",
                   help="settings to replay NAME's episodes with (default: the run's config.yaml, then the "
                        "environment's defaults); repeatable")
    p.set_defaults(func=_cmd_view)


def _cmd_view(args) -> int:
    from horizonrl.apps.viewer.server import main as view_main

    return view_main(args.run_dir, host=args.host, port=args.port, env_settings=args.env_settings)


def _add_report(sub) -> None:
    p = sub.add_parser("report", help="learning curves of one or several runs: a PNG and a markdown table "
                                      "(docs/learning.md)",
                       description="Read each run's TensorBoard events (RUN_DIR/tensorboard/events.*) and draw reward, "
                                   "held-out success (eval.every), rollout success, turns, the max-turn budget, "
                                   "entropy and KL against the learner step, one panel per quantity and one line per "
                                   "run, into OUT/learning.png; print the table (per run: steps, wall time, first -> "
                                   "last of each quantity, held-out before -> after) and write it to OUT/learning.md "
                                   "(values in OUT/learning.json).")
    p.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR")
    p.add_argument("--out", type=Path, default=None, help="directory for the chart and table (default: RUN_DIR/report "
                                                          "of the first run)")
    p.add_argument("--smooth", type=int, default=1, metavar="N",
                   help="trailing mean over N learner steps on the chart; the table's first -> last are then means "
                        "of the first / last N points (held-out success and the budget as logged)")
    p.add_argument("--label", action="append", default=None, metavar="NAME",
                   help="a run's name on the chart and in the table, once per RUN_DIR in order (default: the "
                        "directory's name)")
    p.set_defaults(func=_cmd_report)


def _cmd_report(args) -> int:
    from horizonrl.apps.report import main as report_main

    return report_main(args.run_dirs, args.out, smooth=args.smooth, labels=args.label)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="horizonrl", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train(sub)
    _add_slurm(sub)
    _add_demo(sub)
    _add_eval(sub)
    _add_tiny(sub)
    _add_offline(sub)
    _add_run_tools(sub)
    _add_view(sub)
    _add_report(sub)
    _add_import_agentgym_rl(sub)
    from horizonrl.apps.bench.cli import add_bench_command

    add_bench_command(sub)
    try:
        _add_env(sub)
    except ImportError:
        pass  # environment commands arrive with apps/env_cli.py
    _add_role(sub, "coordinator", "run the coordinator process")
    _add_role(sub, "buffer", "run the buffer process")
    _add_role(sub, "learner", "run one learner rank (RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT from the environment)")
    _add_role(sub, "actor", "run one actor process", indexed=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny-model"]:
        # Its own parser (argparse.REMAINDER would swallow neither --help nor flags reliably).
        from horizonrl.apps.tiny_model import main as tiny_main

        return tiny_main(argv[1:]) or 0
    if argv[:1] == ["make-warmup-data"]:
        from horizonrl.apps.warmup_data import main as warmup_main

        return warmup_main(argv[1:])
    if argv[:1] == ["endpoint"]:
        from horizonrl.apps.endpoint import main as endpoint_main

        return endpoint_main(argv[1:])
    if argv[:1] == ["agent-eval"]:
        from horizonrl.apps.agent_eval import main as agent_eval_main

        return agent_eval_main(argv[1:])
    if argv[:1] in (["make-model"], ["import-gguf"]):
        from horizonrl.apps.model_import import import_gguf_main, make_model_main

        return (make_model_main if argv[0] == "make-model" else import_gguf_main)(argv[1:])
    args = build_parser().parse_args(argv)
    from horizonrl.core.config import ConfigError

    previous = signal.signal(signal.SIGTERM, _interrupt)
    _terminated.clear()
    try:
        rc = args.func(args)
        # A command whose event loop took the cancellation and returned normally was still interrupted: say so in
        # the exit code (seen in a full suite run: `horizonrl eval` exited 0 after a SIGTERM mid-evaluation).
        return 128 + signal.SIGTERM if _terminated else rc
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)


_terminated: set[int] = set()  # the SIGTERMs this command received (main() returns 143 after one)


def _interrupt(signum: int, _frame) -> None:
    """SIGTERM unwinds the command like Ctrl-C, so its ``finally`` blocks run: killed outright, ``horizonrl eval``
    (or the demo's evaluation) left its vLLM engine's processes running with no parent. Commands with a stop flag of
    their own (a run's processes, the launcher) install their handler over this one.

    It is delivered as a SIGINT where Python handles one: inside ``asyncio.run`` that cancels the main task, which
    unwinds at an await. A KeyboardInterrupt raised here instead lands at whatever bytecode runs — once in an
    evaluation's event loop the command then went on playing and never exited (seen once, in a full suite run)."""
    _terminated.add(signum)
    if callable(signal.getsignal(signal.SIGINT)):
        signal.raise_signal(signal.SIGINT)
        return
    raise KeyboardInterrupt(signal.Signals(signum).name)
