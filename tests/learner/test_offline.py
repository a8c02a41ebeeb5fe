"""Offline paradigms: AgentGym data → the actor's token layout; SFT and DPO on FSDP; checkpoints RL starts from."""

from __future__ import annotations

import asyncio
import json
import logging
import math
import os
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import suite_models

from horizonrl.core.agentgym_records import (
    OfflineDataError,
    conversation_record,
    parse_conversation,
    read_sft_conversations,
    write_records,
)
from horizonrl.core.chat import ChatTokenizer
from horizonrl.core.offline_config import load_offline_config
from horizonrl.envs.signpost_expert import expert_reply, read_sign, signpost_records
from horizonrl.learner.offline_data import conversation_ids, load_dpo_data, load_sft_data
from horizonrl.protocol.transport import free_port

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return suite_models.signpost_cached_model()  # shared with the other suites, built once


@pytest.fixture(scope="module")
def chat(model_dir) -> ChatTokenizer:
    from transformers import AutoTokenizer

    return ChatTokenizer(AutoTokenizer.from_pretrained(model_dir))


def offline_config(model_dir: Path, data: Path, out: Path, *overrides: str):
    return load_offline_config(None, [f"model.path={model_dir}", f"data={data}", f"output_dir={out}", "num_threads=1",
                                      "log_every=1000", *overrides])


# ---------------------------------------------------------------------------- (a) data and tokenisation


class ReplayEngine:
    """Generates the given replies as the model would: tokenize(reply) + end-of-turn."""

    def __init__(self, chat: ChatTokenizer, replies: list[str]) -> None:
        self.chat, self.replies = chat, list(replies)

    async def generate(self, prompt_ids, *, max_tokens, temperature, top_p, stop_token_ids):
        from horizonrl.actors.engine import Generation

        ids = self.chat.assistant_ids(self.replies.pop(0))
        return Generation(ids, [0.0] * len(ids), "stop")


def test_token_layout_and_loss_mask_equal_the_actor_episode(chat):
    """The offline sequence of a conversation is exactly the sequence the actor builds when the model
    produces the same replies: same ids, loss mask 1 on exactly the generated tokens."""
    from horizonrl.actors.episode import SamplingSettings, run_episode
    from horizonrl.envs.signpost import SignpostEnv

    records = signpost_records("sft", 3, length=3, seed=1)
    records += [pair["rejected"] | {"item_id": pair["item_id"]} for pair in signpost_records("dpo", 3, length=3, seed=2)]
    sampling = SamplingSettings(temperature=1.0, top_p=1.0, max_tokens_per_turn=64, max_context_tokens=4096)
    for record in records:
        conversation = parse_conversation(record, "test")
        replies = [m.value for m in conversation.messages if m.role == "gpt"]
        task_id = int(record["item_id"].split("_")[1])
        episode = asyncio.run(run_episode(ReplayEngine(chat, replies), SignpostEnv(length=3), chat, task_id,
                                          max_turns=len(replies), sampling=sampling))
        assert episode.num_turns == len(replies)
        ids, mask = conversation_ids(chat, conversation)
        assert ids == episode.token_ids[: len(ids)]
        assert mask == episode.loss_mask[: len(ids)]
        if episode.success:
            assert len(ids) == len(episode.token_ids)
        else:  # out of turns: the actor appended the last observation, which the record leaves out (mask 0 anyway)
            assert not any(episode.loss_mask[len(ids):]) and len(episode.token_ids) > len(ids)


def test_loss_mask_covers_exactly_the_trained_gpt_turns(chat):
    conversation = parse_conversation({"conversations": [
        {"from": "system", "value": "Be brief."},
        {"from": "human", "loss": None, "value": "A sign points left."},
        {"from": "gpt", "loss": False, "value": "OK"},  # AgentGym's untrained acknowledgement turn
        {"from": "human", "value": "A sign points right."},
        {"from": "gpt", "loss": True, "value": "Thought: The sign points right.\nAction: go right"},
        {"from": "human", "value": "A sign points straight."},
        {"from": "gpt", "value": "Action: go straight"},  # no "loss": trained
        {"from": "human", "value": "You reached the exit."},  # trailing observation: dropped
    ]}, "test")
    assert conversation.system == "Be brief." and conversation.messages[-1].role == "gpt"
    ids, mask = conversation_ids(chat, conversation)
    trained = chat.assistant_ids("Thought: The sign points right.\nAction: go right") + chat.assistant_ids(
        "Action: go straight")
    assert [t for t, m in zip(ids, mask) if m] == trained
    # The untrained turn is in the sequence, with mask 0, right after the prompt.
    prompt = chat.prompt_ids("A sign points left.", "Be brief.")
    ok = chat.assistant_ids("OK")
    assert ids[: len(prompt) + len(ok)] == prompt + ok and not any(mask[: len(prompt) + len(ok)])
    assert chat.decode(ids, skip_special_tokens=False).endswith("Action: go straight<|im_end|>")
    # Every gpt turn ends with the end-of-turn token, trained with it.
    assert sum(1 for t, m in zip(ids, mask) if m and t == chat.end_of_turn_id) == 2


@pytest.mark.parametrize("text, line, phrase", [
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n\n{"conversations": [}\n',
     3, "not valid JSON"),
    ('{"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}\n'
     '{"conversations": [{"from": "human", "value": "hi"}, {"from": "bot", "value": "yo"}]}\n', 2, "'from' is 'bot'"),
    ('{"conversations": [{"from": "gpt", "value": "yo"}]}\n', 1, "expected a 'human' message"),
    ('{"conversations": [{"from": "human", "value": "a"}, {"from": "human", "value": "b"}]}\n', 1, "expected a 'gpt'"),
    ('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": 3}]}\n', 1, "'value' must be a string"),
    ('{"conversations": [{"from": "human", "value": "a", "loss": true}, {"from": "gpt", "value": "b"}]}\n', 1,
     "never trained on"),
    ('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b", "loss": "yes"}]}\n', 1,
     "'loss' must be"),
    ('{"conversations": [{"from": "human", "value": "a"}]}\n', 1, "no 'gpt' message"),
    ('{"messages": []}\n', 1, "no 'conversations'"),
    ('[1, 2]\n', 1, "must be a JSON object"),
])
def test_malformed_sft_records_name_the_file_and_line(tmp_path, text, line, phrase):
    path = tmp_path / "bad.jsonl"
    path.write_text(text)
    with pytest.raises(OfflineDataError) as info:
        list(read_sft_conversations([path]))
    assert f"{path}:{line}:" in str(info.value) and phrase in str(info.value), str(info.value)


def test_json_list_errors_name_the_line_where_the_record_starts(tmp_path):
    good = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}
    bad = {"conversations": [{"from": "human", "value": "a"}, {"from": "gpt"}]}
    path = tmp_path / "data.json"
    path.write_text(json.dumps([good, good, bad], indent=1))
    starts = [i + 1 for i, text in enumerate(path.read_text().splitlines()) if text == " {"]  # where records open
    assert len(starts) == 3
    with pytest.raises(OfflineDataError, match=rf"{path}:{starts[2]}: conversations\[1\]: 'value' must be a string"):
        list(read_sft_conversations([path]))
    (tmp_path / "broken.json").write_text("[\n" + json.dumps(good) + ',\n {"conversations": [\n')
    with pytest.raises(OfflineDataError, match=r"broken.json:3: the record starting here is not valid JSON \(.* at line 4, column 1\)"):
        list(read_sft_conversations([tmp_path / "broken.json"]))


def test_json_list_and_json_lines_read_the_same(tmp_path, chat):
    records = signpost_records("sft", 5, length=2)
    a = load_sft_data([write_records(tmp_path / "a.json", records)], chat, 512)
    b = load_sft_data([write_records(tmp_path / "b.jsonl", records)], chat, 512)
    assert len(a) == len(b) == 5
    assert (a.sequences.tokens == b.sequences.tokens).all() and (a.sequences.mask == b.sequences.mask).all()


def test_truncated_and_dropped_records_are_counted_and_logged(tmp_path, chat, caplog):
    records = signpost_records("sft", 4, length=3)
    untrained = conversation_record([("human", "A sign points left."), ("gpt", "OK")], untrained=[1])
    path = write_records(tmp_path / "d.jsonl", records + [untrained])
    full = load_sft_data([path], chat, 4096)
    assert full.stats.read == 5 and full.stats.kept == 4 and full.stats.truncated == 0
    assert sum(full.stats.dropped.values()) == 1
    prompt_length = len(chat.prompt_ids(records[0]["conversations"][0]["value"]))
    max_length = prompt_length + 3  # keeps 3 tokens of the first reply
    with caplog.at_level(logging.INFO, logger="horizonrl"):
        cut = load_sft_data([path], chat, max_length)
    assert cut.stats.kept == 4 and cut.stats.truncated == 4
    assert all(cut.sequences.num_tokens(i) == max_length and cut.sequences.num_loss_tokens(i) == 3 for i in range(4))
    assert "5 records read, 4 kept (4 cut to" in caplog.text and "1 with no trained gpt message" in caplog.text
    # Cut so short that no gpt token is left: dropped and counted, never silently.
    none_left = load_sft_data([path], chat, prompt_length)
    assert len(none_left) == 0 and none_left.stats.read == 5 and sum(none_left.stats.dropped.values()) == 5


def test_dpo_pairs_share_the_prompt_and_accept_both_layouts(tmp_path, chat):
    pairs = signpost_records("dpo", 3, length=2)
    as_lists = [{"chosen": p["chosen"]["conversations"], "rejected": p["rejected"]["conversations"]} for p in pairs]
    a = load_dpo_data([write_records(tmp_path / "a.jsonl", pairs)], chat, 512)
    b = load_dpo_data([write_records(tmp_path / "b.jsonl", as_lists)], chat, 512)
    assert len(a) == len(b) == 3 and (a.rejected.tokens == b.rejected.tokens).all()
    for i, pair in enumerate(pairs):  # the same prompt; the rejected side ends with its wrong move
        chosen, rejected = a.chosen.get(i)[0].tolist(), a.rejected.get(i)[0].tolist()
        assert chosen[:20] == rejected[:20] and len(rejected) <= len(chosen) and chosen[: len(rejected)] != rejected
        observation, reply = (m["value"] for m in pair["rejected"]["conversations"][-2:])
        assert reply.split("Action: ")[1] != f"go {read_sign(observation)}"
    mismatched = dict(pairs[0], rejected=signpost_records("sft", 1, length=2, seed=5)[0])
    path = write_records(tmp_path / "bad.jsonl", pairs[:1] + [mismatched])
    with pytest.raises(OfflineDataError, match=rf"{path}:2: chosen and rejected must share the prompt"):
        load_dpo_data([path], chat, 512)
    path = write_records(tmp_path / "bad2.jsonl", [{"chosen": pairs[0]["chosen"]}])
    with pytest.raises(OfflineDataError, match=rf"{path}:1: record has no 'rejected'"):
        load_dpo_data([path], chat, 512)


def test_expert_replies_follow_the_sign_in_the_warm_up_format():
    from horizonrl.envs import extract_react_action

    reply = expert_reply("Dead end. You walk back. A sign points straight.")
    assert reply == "Thought: The sign points straight.\nAction: go straight"
    assert extract_react_action(reply) == "go straight" and read_sign("A sign points left.") == "left"
    for record in signpost_records("sft", 20, length=3, seed=3):
        conversation = parse_conversation(record, "x")
        assert all(m.trained for m in conversation.messages if m.role == "gpt")
        assert sum(m.role == "gpt" for m in conversation.messages) == 3  # the expert never errs
        assert int(record["item_id"].split("_")[1]) % 5 != 0  # train-split tasks only; eval uses the rest


# ---------------------------------------------------------------------------- the losses (pure)


def test_dpo_loss_by_hand():
    import torch

    from horizonrl.learner.offline import dpo_loss

    loss, r_c, r_r = dpo_loss(torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, -2.0]), torch.tensor([-2.0, -2.0]),
                              torch.tensor([-2.0, -2.0]), beta=0.5)
    # r_c = 0.5 (−1 + 2) = 0.5, r_r = 0.5 (−3 + 2) = −0.5: loss = log(1 + e^{−1}); equal policy and reference: log 2
    assert r_c.tolist() == [0.5, 0.0] and r_r.tolist() == [-0.5, 0.0]
    assert loss.tolist() == pytest.approx([math.log(1 + math.exp(-1.0)), math.log(2.0)], abs=1e-7)


def test_sequence_logprobs_sum_the_gpt_tokens_of_each_row(model_dir, chat):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from horizonrl.learner.offline import collate, sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    records = signpost_records("sft", 2, length=2) + signpost_records("sft", 1, length=3)
    rows = [tuple(np.array(x) for x in conversation_ids(chat, parse_conversation(r, "x"))) for r in records]
    input_ids, loss_mask = collate(rows, torch.device("cpu"))
    with torch.no_grad():
        tokens, sums = sequence_logprobs(model, input_ids, loss_mask)
        for row, (ids, mask) in enumerate(rows):  # one sequence at a time, no padding, the obvious way
            logp = torch.log_softmax(model(input_ids=torch.from_numpy(ids)[None]).logits[0].double(), -1)
            expected = sum(float(logp[t - 1, ids[t]]) for t in range(1, len(ids)) if mask[t])
            assert float(sums[row]) == pytest.approx(expected, abs=1e-4)
    assert tokens.numel() == sum(int(m[1:].sum()) for _, m in rows) and float(tokens.sum()) == pytest.approx(float(sums.sum()))


def test_every_rank_gets_a_disjoint_share_and_the_same_number_of_micro_batches():
    import numpy as np

    from horizonrl.learner.offline import epoch_batches, rank_chunks

    batches = epoch_batches(13, 5, epochs=2, seed=0, max_steps=None)
    assert [len(b) for b in batches] == [5, 5, 3, 5, 5, 3]
    assert sorted(np.concatenate(batches[:3]).tolist()) == list(range(13))  # each epoch sees every item once
    for world in (1, 2, 3):
        for batch in batches:
            chunks = [rank_chunks(batch, r, world, micro_batch_size=2) for r in range(world)]
            assert len({len(c) for c in chunks}) == 1  # FSDP collectives: same count on every rank
            flat = [int(i) for c in chunks for chunk in c for i in chunk]
            assert sorted(flat) == sorted(batch.tolist())


# ---------------------------------------------------------------------------- (b) SFT, (c) DPO on one rank


@pytest.fixture(scope="module")
def expert_files(tmp_path_factory):
    out = tmp_path_factory.mktemp("expert")
    return (write_records(out / "sft.jsonl", signpost_records("sft", 96, length=2, seed=0)),
            write_records(out / "dpo.jsonl", signpost_records("dpo", 48, length=2, seed=0)))


def test_sft_lowers_nll_and_the_checkpoint_loads_with_the_same_logits(model_dir, expert_files, tmp_path):
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from horizonrl.learner.offline import fit, load_data

    config = offline_config(model_dir, expert_files[0], tmp_path / "sft", "lr=1e-3", "batch_size=16",
                            "micro_batch_size=8", "epochs=2")
    config.out.mkdir(parents=True)
    data = load_data(config, "sft")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1,
                            timeout=timedelta(seconds=120))
    try:
        summary, model = fit(config, "sft", data, torch.device("cpu"))
        probe = torch.tensor([data.sequences.get(0)[0].tolist()])
        model.eval()
        with torch.no_grad():
            in_memory = model(input_ids=probe).logits
    finally:
        dist.destroy_process_group()
        torch.set_num_threads(threads)
    before, after = summary["before"]["nll"], summary["after"]["nll"]
    print(f"sft nll {before:.4f} -> {after:.4f} in {summary['steps']} steps ({summary['times']['train_s']:.1f} s)")
    assert summary["steps"] == 12 and after < 0.5 * before
    steps = [json.loads(line) for line in (config.out / "metrics.jsonl").read_text().splitlines()]
    assert len(steps) == 12 and steps[0]["loss"] == pytest.approx(before, rel=0.2)  # the first batch starts where all data starts

    checkpoint = Path(summary["checkpoint"])
    assert checkpoint == config.out / "final"
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {p.name for p in checkpoint.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    with torch.no_grad():
        reloaded = loaded(input_ids=probe).logits
    assert torch.allclose(reloaded, in_memory, atol=1e-5), (reloaded - in_memory).abs().max()
    start = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        assert (start(input_ids=probe).logits - in_memory).abs().max() > 1e-2  # it did train
    assert loaded.config.use_cache
    ChatTokenizer(AutoTokenizer.from_pretrained(checkpoint))  # the chat template came along


@pytest.mark.parametrize("sft_weight", [0.0, 1.0])
def test_dpo_starts_at_log_2_and_learns_the_preference(model_dir, expert_files, tmp_path, sft_weight):
    from horizonrl.learner.offline import run_offline

    config = offline_config(model_dir, expert_files[1], tmp_path / "dpo", "lr=5e-4", "beta=0.5", "batch_size=8",
                            "micro_batch_size=4", "epochs=3", f"sft_weight={sft_weight}")
    summary = run_offline(config, "dpo")
    steps = [json.loads(line) for line in (config.out / "metrics.jsonl").read_text().splitlines()]
    print("dpo:", json.dumps({"before": summary["before"], "after": summary["after"],
                              "losses": [round(s["loss"], 4) for s in steps],
                              "accuracy": [s["reward_accuracy"] for s in steps]}))
    # π = π_ref before the first update: every implicit reward is 0, the loss log 2, no pair ranked right.
    assert summary["before"]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert summary["before"]["reward_accuracy"] == 0.0 and summary["before"]["reward_margin"] == 0.0
    assert abs(steps[0]["reward_margin"]) < 1e-5  # the first step's batches are cut differently: equal up to rounding
    assert len(steps) == 18
    assert steps[-1]["loss"] < 0.5 * math.log(2) and steps[-1]["reward_accuracy"] >= 0.75
    assert summary["after"]["reward_accuracy"] >= 0.9 and summary["after"]["reward_margin"] > 0
    assert (config.out / "final" / "model.safetensors").is_file()
    if sft_weight:  # the NLL term keeps the chosen replies likely (pure DPO lets them fall with the rejected ones)
        assert summary["after"]["chosen_nll"] < 0.5 * summary["before"]["chosen_nll"]


# ---------------------------------------------------------------------------- (d) 2 ranks == 1 rank


@pytest.mark.slow  # two gloo ranks: a process group (~10 s each when idle)
@pytest.mark.parametrize("paradigm", ["sft", "dpo"])
def test_two_gloo_ranks_give_the_losses_of_one_rank(model_dir, expert_files, tmp_path, paradigm):
    """13 items in batches of 5 (the last one 3): rank 1's share is smaller and pads with an empty micro-batch."""
    from horizonrl.learner.offline import run_offline

    data = expert_files[0] if paradigm == "sft" else expert_files[1]
    subset = tmp_path / f"{paradigm}.jsonl"
    subset.write_text("".join(data.read_text().splitlines(keepends=True)[:13]))
    runs = {}
    for ranks in (1, 2):
        config = offline_config(model_dir, subset, tmp_path / f"w{ranks}", "lr=1e-3", "batch_size=5",
                                "micro_batch_size=2", "epochs=1", f"num_ranks={ranks}")
        summary = run_offline(config, paradigm)
        steps = [json.loads(line) for line in (config.out / "metrics.jsonl").read_text().splitlines()]
        runs[ranks] = summary, steps
    (one, steps1), (two, steps2) = runs[1], runs[2]
    assert two["world_size"] == 2 and len(steps1) == len(steps2) == 3
    for a, b in zip(steps1, steps2):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-5)
    key = "nll" if paradigm == "sft" else "loss"
    assert two["after"][key] == pytest.approx(one["after"][key], abs=1e-5)
    assert abs(two["after"][key] - two["before"][key]) > 1e-3  # the weights did change, the same way on both


@pytest.mark.slow  # two gloo ranks under `horizonrl sft`, its first process killed
def test_a_killed_sft_process_takes_its_ranks_with_it(model_dir, expert_files, tmp_path):
    """``kill -9`` of the `horizonrl sft` process that started two ranks (each in a session of its own): the
    ranks see their parent gone and stop (core/runtime.py stop_when_launcher_dies), none left running."""
    import signal
    import subprocess
    import sys
    import time

    import psutil

    from horizonrl.core.programs import OFFLINE_RANK_MODULE

    config = tmp_path / "sft.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ndata: {expert_files[0]}\noutput_dir: {tmp_path / 'out'}\n"
                      "num_threads: 1\nnum_ranks: 2\nepochs: 1000\nbatch_size: 4\nmicro_batch_size: 2\n")
    parent = subprocess.Popen([sys.executable, "-m", "horizonrl", "sft", str(config)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, start_new_session=True)
    ranks: list[psutil.Process] = []
    try:
        deadline = time.monotonic() + 120
        while len(ranks) < 2 and time.monotonic() < deadline and parent.poll() is None:
            ranks = [p for p in psutil.Process(parent.pid).children() if OFFLINE_RANK_MODULE in " ".join(p.cmdline())]
            time.sleep(0.2)
        assert len(ranks) == 2, f"the ranks never started (exit code {parent.poll()})"
        time.sleep(3)  # into their process group's set-up
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        gone, alive = psutil.wait_procs(ranks, timeout=90)
        assert alive == [], [p.pid for p in alive]
    finally:
        for rank in ranks:
            if rank.is_running():
                os.killpg(rank.pid, signal.SIGKILL)


# ---------------------------------------------------------------------------- entry points


def test_cli_dry_run_and_expert_data(model_dir, tmp_path, capsys):
    from horizonrl.apps.cli import main

    out = tmp_path / "expert.json"
    assert main(["make-expert-data", str(out), "--kind", "dpo", "--episodes", "4", "--length", "2"]) == 0
    assert len(json.loads(out.read_text())) == 4
    for paradigm in ("sft", "dpo"):
        config = REPO / "configs" / f"{paradigm}_signpost.yaml"
        assert main([paradigm, str(config), f"model.path={model_dir}", "beta=0.2", "--dry-run"]) == 0
        assert "beta: 0.2" in capsys.readouterr().out
    assert main(["sft", str(REPO / "configs" / "sft_signpost.yaml"), "no_such_key=1", "--dry-run"]) == 2


def test_offline_config_is_bottom_layer_and_takes_one_data_file():
    code = "import sys, horizonrl.core.offline_config; assert 'torch' not in sys.modules"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0
    config = load_offline_config(None, ["model.path=m", "data=one.jsonl"])
    assert config.data == ["one.jsonl"] and config.checkpoint_dir == Path("runs/offline/final")


def held_out(model: Path, tmp_path: Path, label: str) -> dict:
    """Success on 100 test-split Signpost tasks (length 2, 2 turns), as tests/integration/test_learning.py measures it."""
    out = subprocess.run([sys.executable, "-m", "horizonrl", "eval", "--model", str(model), "--env", "signpost",
                          "--env-settings", '{"length": 2}', "--episodes", "100", "--max-turns", "2",
                          "--max-tokens-per-turn", "24", "--max-context-tokens", "512"],
                         capture_output=True, text=True, timeout=600)
    (tmp_path / f"eval-{label}.log").write_text(out.stdout + out.stderr)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_sft_on_signpost_expert_data_raises_held_out_success(model_dir, tmp_path):
    """The whole offline flow through the CLI: expert data → `horizonrl sft` → `horizonrl eval` on
    test-split tasks the data never covered, against the starting model on the same tasks."""
    data = tmp_path / "expert.jsonl"
    run = subprocess.run([sys.executable, "-m", "horizonrl", "make-expert-data", str(data), "--episodes", "400",
                          "--length", "2"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    out = tmp_path / "sft"
    run = subprocess.run([sys.executable, "-m", "horizonrl", "sft", str(REPO / "configs" / "sft_signpost.yaml"),
                          f"model.path={model_dir}", f"data={data}", f"output_dir={out}", "num_threads=1"],
                         capture_output=True, text=True, timeout=600)
    (tmp_path / "sft.log").write_text(run.stdout + run.stderr)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads(run.stdout.strip().splitlines()[-1])
    before, after = held_out(model_dir, tmp_path, "before"), held_out(Path(summary["checkpoint"]), tmp_path, "after")
    report = {"nll": [summary["before"]["nll"], summary["after"]["nll"]],
              "success": [before["success_rate"], after["success_rate"]]}
    print("offline sft:", json.dumps(report))
    assert after["success_rate"] >= before["success_rate"] + 0.5, report


def test_offline_runs_take_the_learners_precision_policy():
    import torch

    from horizonrl.core.config import ConfigError
    from horizonrl.learner.offline import offline_precision

    config = load_offline_config(None, ["model.path=unused", "data=unused.json"])
    cpu = offline_precision(config, torch.device("cpu"))
    assert (cpu.param_dtype, cpu.compute_dtype, cpu.reduce_dtype, cpu.attention) == ("float32", "float32", "float32",
                                                                                       "sdpa")
    cuda = offline_precision(config, torch.device("cuda", 0))  # a pure function of the device type: no GPU needed
    assert (cuda.param_dtype, cuda.compute_dtype, cuda.reduce_dtype) == ("float32", "bfloat16", "float32")
    assert cuda.mixed
    bad = load_offline_config(None, ["model.path=unused", "data=unused.json", "param_dtype=bfloat16"])
    with pytest.raises(ConfigError, match="param_dtype"):
        offline_precision(bad, torch.device("cpu"))  # bf16 master weights under an fp32 compute
