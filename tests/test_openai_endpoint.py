"""The OpenAI endpoint's core without an engine (a scripted generator): how a session's prompts relate to the
tokens it holds (append, extend, branch), choices, stop strings, tool calls, budgets, rewards, and the requests
it refuses. ``tests/integration/test_openai_endpoint_live.py`` runs the real ``openai`` client against a live
vLLM engine."""

from __future__ import annotations

import asyncio
import copy
import json

import pytest

from horizonrl.actors.episode_messages import to_trajectory
from horizonrl.actors.openai_endpoint.endpoint import AgentEndpoint, EndpointSettings, cut_at_stop
from horizonrl.actors.openai_endpoint.session import PLAN_APPEND, PLAN_BRANCH, PLAN_EXTEND, PLAN_FIRST
from horizonrl.actors.openai_endpoint.tool_calls import parse_reply
from horizonrl.actors.openai_endpoint.wire import RequestError, parse_chat_request
from horizonrl.apps.tiny_model import THINKING_CHAT_TEMPLATE, build_tokenizer
from horizonrl.core.chat import ChatTokenizer
from horizonrl.protocol.validation import trajectory_problem
from openai_endpoint_helpers import HERMES_TOOLS_TEMPLATE, ScriptedGenerator

TOOLS = [{"type": "function", "function": {"name": "act", "description": "do an action in the world",
                                           "parameters": {"type": "object",
                                                          "properties": {"action": {"type": "string"}},
                                                          "required": ["action"]}}},
         {"type": "function", "function": {"name": "look", "description": "see the room",
                                           "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def tokenizer():
    texts = ["You are in a room. Go to the red ball.", "Action: turn left", "<tool_call>", '{"name": "act"}',
             "tool_response", "arguments", "The ball is 3 steps forward."] * 20
    return build_tokenizer(texts, vocab_size=400)


def chat_of(tokenizer, template: str | None = None) -> ChatTokenizer:
    tok = copy.deepcopy(tokenizer)
    if template is not None:
        tok.chat_template = template
    return ChatTokenizer(tok)


def endpoint_of(chat, replies, **settings) -> tuple[AgentEndpoint, ScriptedGenerator]:
    generator = ScriptedGenerator(chat, replies)
    defaults = dict(model_name="tiny", max_context_tokens=2048, default_max_tokens=256)
    return AgentEndpoint(generator, chat, EndpointSettings(**{**defaults, **settings})), generator


def request(messages, **extra):
    return parse_chat_request({"model": "tiny", "messages": messages, **extra})


def assistant(choice) -> dict:
    """The assistant message as an agent appends it to its history (what the openai client sends back)."""
    message = {"role": "assistant", "content": choice.message.content or None}
    if choice.message.tool_calls:
        message["tool_calls"] = [{"id": i, "type": "function", "function": {"name": c.name,
                                                                            "arguments": c.arguments_json()}}
                                 for i, c in zip(choice.tool_call_ids, choice.message.tool_calls)]
    return message


CALL_ACT = '<tool_call>\n{"name": "act", "arguments": {"action": "turn left"}}\n</tool_call>'


async def play_tool_episode(chat, replies, turns: int = 3):
    """An agent loop with tools: every reply's tool call is answered with a tool message."""
    endpoint, generator = endpoint_of(chat, replies)
    session = endpoint.open_session(max_turns=10)
    messages = [{"role": "system", "content": "You are in a room."},
                {"role": "user", "content": "Go to the red ball."}]
    results = []
    for turn in range(turns):
        result = await endpoint.complete(session, request(messages, tools=TOOLS))
        results.append(result)
        choice = result.choices[0]
        messages.append(assistant(choice))
        for call_id in choice.tool_call_ids:
            messages.append({"role": "tool", "tool_call_id": call_id, "content": f"The ball is {turn} steps away."})
        if not choice.tool_call_ids:
            messages.append({"role": "user", "content": "Use a tool."})
    episode = await endpoint.close(session.session_id)
    return endpoint, generator, results, episode, messages


# ------------------------------------------------------------------ token-exact appends


@pytest.mark.parametrize("template", [None, HERMES_TOOLS_TEMPLATE], ids=["hermes-prompt", "template-renders-tools"])
async def test_a_tool_episode_appends_the_generated_tokens_and_the_templates_text_for_the_rest(tokenizer, template):
    chat = chat_of(tokenizer, template)
    endpoint, generator, results, episode, messages = await play_tool_episode(chat, [CALL_ACT] * 3)
    assert endpoint.renderer.native_tools is (template is not None)
    assert [r.plan.kind for r in results] == [PLAN_FIRST, PLAN_APPEND, PLAN_APPEND]
    assert all(r.choices[0].message.tool_calls[0].arguments == {"action": "turn left"} for r in results)
    # Each prompt is the previous prompt, then what was generated, then the template's text for what is new.
    for before, after, result in zip(generator.prompts, generator.prompts[1:], results):
        assert after[:len(before) + len(result.choices[0].ids)] == before + result.choices[0].ids
    # The episode is the last prompt and the last reply, in one sample; the loss mask marks the replies exactly.
    assert episode.token_ids == generator.prompts[-1] + results[-1].choices[0].ids and not episode.sample_starts
    assert [episode.token_ids[s:e] for s, e in episode.turn_spans] == [r.choices[0].ids for r in results]
    assert sum(episode.loss_mask) == sum(len(r.choices[0].ids) for r in results)
    # Here the model's tokens are the tokenizer's own, so the template's full rendering of the conversation is the
    # same sequence: nothing was dropped, doubled or re-rendered differently.
    full = chat.encode(endpoint.renderer.render(request(messages[:-1], tools=TOOLS).messages, TOOLS, False))
    assert episode.token_ids == full[:len(episode.token_ids)]


async def test_the_models_own_tokens_are_kept_where_the_text_would_tokenize_otherwise(tokenizer):
    chat = chat_of(tokenizer, HERMES_TOOLS_TEMPLATE)
    canonical = chat.encode(CALL_ACT)
    odd = [i for piece in CALL_ACT for i in chat.encode(piece)]  # the same text, one character at a time
    assert odd != canonical and chat.decode(odd) == CALL_ACT
    endpoint, generator, results, episode, _ = await play_tool_episode(chat, [odd + [chat.end_of_turn_id]] * 2, 2)
    assert results[1].plan.kind == PLAN_APPEND
    first_turn = episode.token_ids[slice(*episode.turn_spans[0])]
    assert first_turn == odd + [chat.end_of_turn_id]  # as generated, not as the text re-tokenizes
    assert generator.prompts[1][:len(generator.prompts[0]) + len(first_turn)] == generator.prompts[0] + first_turn


async def test_a_reply_cut_by_max_tokens_is_closed_with_the_end_of_turn_token(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, generator = endpoint_of(chat, ["Action: turn left and then go forward", "Action: go"])
    session = endpoint.open_session()
    messages = [{"role": "user", "content": "Go."}]
    first = await endpoint.complete(session, request(messages, max_tokens=3))
    assert first.choices[0].finish_reason == "length" and len(first.choices[0].ids) == 3
    messages += [assistant(first.choices[0]), {"role": "user", "content": "Again."}]
    second = await endpoint.complete(session, request(messages))
    held = generator.prompts[0] + first.choices[0].ids
    assert second.plan.kind == PLAN_APPEND and second.plan.prompt_ids[len(held)] == chat.end_of_turn_id


# ------------------------------------------------------------------ branches


async def test_an_agent_that_rewrites_its_history_branches_the_episode(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, generator = endpoint_of(chat, ["Action: turn left", "Action: go", "Action: stop"])
    session = endpoint.open_session()
    messages = [{"role": "user", "content": "Go to the red ball."}]
    first = await endpoint.complete(session, request(messages))
    messages += [assistant(first.choices[0]), {"role": "user", "content": "The ball is ahead."}]
    second = await endpoint.complete(session, request(messages))
    assert second.plan.kind == PLAN_APPEND
    summary = [{"role": "user", "content": "Summary: you turned left. The ball is ahead."}]  # history dropped
    third = await endpoint.complete(session, request(summary))
    assert third.plan.kind == PLAN_BRANCH
    episode = await endpoint.close(session.session_id)
    start, = episode.sample_starts
    assert episode.token_ids[:start] == generator.prompts[1] + second.choices[0].ids  # the first sample, whole
    assert episode.token_ids[start:] == chat.encode(endpoint.renderer.render(request(summary).messages, (), True)) + (
        third.choices[0].ids)
    assert episode.num_turns == 3 and session.branches == 1
    trajectory = to_trajectory(episode, run_id="r", trajectory_id="t", group_id="g", group_size=1, env="agent",
                               task_id=0, actor_id=0, max_turns=10, category="", with_text=True)
    assert trajectory_problem(trajectory, chat.vocab_size, max_tokens=2048) is None


async def test_a_template_that_rewrites_history_branches_at_every_call(tokenizer):
    chat = chat_of(tokenizer, THINKING_CHAT_TEMPLATE)
    endpoint, generator = endpoint_of(chat, ["<think>\nleft\n</think>\n\nAction: turn left"] * 3)
    session = endpoint.open_session()
    messages = [{"role": "user", "content": "Go."}]
    kinds = []
    for _ in range(3):
        result = await endpoint.complete(session, request(messages))
        kinds.append(result.plan.kind)
        messages += [assistant(result.choices[0]), {"role": "user", "content": "Next."}]
    assert kinds == [PLAN_FIRST, PLAN_BRANCH, PLAN_BRANCH]
    episode = await endpoint.close(session.session_id)
    assert len(episode.sample_starts) == 2
    bounds = list(zip([0, *episode.sample_starts], [*episode.sample_starts, len(episode.token_ids)]))
    for (start, end), prompt, (turn_start, turn_end) in zip(bounds, generator.prompts, episode.turn_spans):
        assert episode.token_ids[start:turn_start] == prompt and turn_end == end


async def test_a_reply_sent_back_changed_extends_when_the_rendering_begins_with_the_tokens_held(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, generator = endpoint_of(chat, ["Action: go", "Action: stop"])
    session = endpoint.open_session()
    first = await endpoint.complete(session, request([{"role": "user", "content": "Go."}]))
    # a framework that names the assistant: not the message it was given, but this template does not render names,
    # so the conversation still renders as the tokens held (the reply's text tokenizes as generated here)
    named = {**assistant(first.choices[0]), "name": "bot"}
    second = await endpoint.complete(session, request([{"role": "user", "content": "Go."}, named,
                                                       {"role": "user", "content": "More."}]))
    assert second.plan.kind == PLAN_EXTEND and second.plan.adopted is None
    assert second.plan.prompt_ids[:len(generator.prompts[0]) + len(first.choices[0].ids)] == (
        generator.prompts[0] + first.choices[0].ids)


# ------------------------------------------------------------------ choices, stops, tool calls


async def test_n_choices_the_one_the_agent_keeps_is_the_turn(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, generator = endpoint_of(chat, ["Action: one", "Action: two", "Action: three", "Action: next"])
    session = endpoint.open_session()
    messages = [{"role": "user", "content": "Pick."}]
    first = await endpoint.complete(session, request(messages, n=3))
    assert len(first.choices) == 3 and len(generator.prompts) == 3
    kept = first.choices[2]
    messages += [assistant(kept), {"role": "user", "content": "Go on."}]
    second = await endpoint.complete(session, request(messages))
    assert second.plan.kind == PLAN_APPEND and second.plan.adopted == 2
    episode = await endpoint.close(session.session_id)
    assert episode.token_ids[slice(*episode.turn_spans[0])] == kept.ids
    assert session.unadopted_choices == 2 and episode.num_turns == 2


async def test_a_stop_string_ends_the_reply_and_its_tokens(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, _ = endpoint_of(chat, ["Thought: left.\nAction: turn left\nObservation: none"])
    session = endpoint.open_session()
    result = await endpoint.complete(session, request([{"role": "user", "content": "Go."}], stop=["Observation:"]))
    choice = result.choices[0]
    assert choice.message.content == "Thought: left.\nAction: turn left\n" and choice.finish_reason == "stop"
    assert "Observation:" in chat.decode(choice.ids) and "Observation:" not in chat.decode(choice.ids[:-1])
    assert len(choice.logprobs) == len(choice.ids) and choice.version_spans[-1][0] == len(choice.ids)


def test_cut_at_stop_finds_the_fewest_tokens(tokenizer):
    chat = chat_of(tokenizer)
    ids = chat.encode("abc STOP def")
    keep, text = cut_at_stop(ids, ("STOP",), chat.decode)
    assert text == "abc " and chat.decode(ids[:keep]).endswith("STOP") and cut_at_stop(ids, ("xyz",), chat.decode) \
        is None


async def test_a_tool_call_that_does_not_parse_is_content_counted_and_kept(tokenizer):
    chat = chat_of(tokenizer)
    broken = '<tool_call>\n{"name": "act", "arguments": {"action": }\n</tool_call>'
    endpoint, _ = endpoint_of(chat, [broken])
    session = endpoint.open_session()
    result = await endpoint.complete(session, request([{"role": "user", "content": "Go."}], tools=TOOLS))
    choice = result.choices[0]
    assert choice.message.content == broken and not choice.message.tool_calls and choice.parse_error
    assert endpoint.stats.tool_parse_failures == 1
    episode = await endpoint.close(session.session_id)
    assert episode.token_ids[slice(*episode.turn_spans[0])] == choice.ids and episode.invalid_actions == 1


async def test_tool_call_markup_that_the_tokenizer_makes_special_is_still_parsed(tokenizer):
    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>", "<tool_call>",
                                                              "</tool_call>"]})
    chat = ChatTokenizer(special)
    assert chat.tokenizer.convert_tokens_to_ids("<tool_call>") in chat.encode(CALL_ACT)
    endpoint, _ = endpoint_of(chat, [CALL_ACT])
    result = await endpoint.complete(endpoint.open_session(), request([{"role": "user", "content": "Go."}],
                                                                      tools=TOOLS))
    assert result.choices[0].message.tool_calls[0].arguments == {"action": "turn left"}


def test_tool_call_formats():
    hermes = parse_reply("Let me act.\n" + CALL_ACT + "\n<tool_call>\n{\"name\": \"look\", \"arguments\": {}}\n"
                         "</tool_call>", "hermes")
    assert hermes.content == "Let me act." and [c.name for c in hermes.tool_calls] == ["act", "look"]
    assert parse_reply(CALL_ACT, "hermes", tools_allowed=False).content == CALL_ACT
    llama = parse_reply('{"name": "act", "parameters": {"action": "go"}}; {"name": "look", "parameters": {}}',
                        "llama3_json")
    assert llama.content is None and [(c.name, c.arguments) for c in llama.tool_calls] == [
        ("act", {"action": "go"}), ("look", {})]
    assert parse_reply("I think we should go.", "llama3_json").tool_calls == []
    for bad in ('{"name": "act", "parameters": [1]}', '{"nam": "act"}', '{"name": "act", "parameters": {'):
        parsed = parse_reply(bad, "llama3_json")
        assert parsed.parse_error and parsed.content == bad and not parsed.tool_calls
    unclosed = parse_reply('<tool_call>\n{"name": "act", "arguments": {"action": "go"}}', "hermes")
    assert unclosed.tool_calls[0].arguments == {"action": "go"}  # stopped at the end of turn before the tag


# ------------------------------------------------------------------ budget, context, rewards, sampling


async def test_the_turn_budget_caps_model_calls(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, _ = endpoint_of(chat, ["Action: a"] * 3)
    session = endpoint.open_session(max_turns=2)
    messages = [{"role": "user", "content": "Go."}]
    for _ in range(2):
        result = await endpoint.complete(session, request(messages))
        messages += [assistant(result.choices[0]), {"role": "user", "content": "More."}]
    with pytest.raises(RequestError) as refused:
        await endpoint.complete(session, request(messages))
    assert refused.value.status == 400 and refused.value.code == "turn_budget_exhausted"
    episode = await endpoint.close(session.session_id)
    assert episode.num_turns == 2 and episode.stop_reason == "max_turns"


async def test_a_prompt_over_the_context_is_refused_and_changes_nothing(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, generator = endpoint_of(chat, ["Action: a"], max_context_tokens=64)
    session = endpoint.open_session()
    with pytest.raises(RequestError) as refused:
        await endpoint.complete(session, request([{"role": "user", "content": "Go to the red ball. " * 40}]))
    assert refused.value.code == "context_length_exceeded" and not generator.prompts
    result = await endpoint.complete(session, request([{"role": "user", "content": "Go."}]))
    assert result.plan.kind == PLAN_FIRST
    assert generator.sampled[0][2] <= 64 - len(result.plan.prompt_ids)  # max_tokens fits the context


async def test_rewards_from_the_agent_or_the_environment_land_on_the_turns(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, _ = endpoint_of(chat, ["Action: a"] * 4)
    agent = endpoint.open_session()
    messages = [{"role": "user", "content": "Go."}]
    for _ in range(2):
        result = await endpoint.complete(agent, request(messages))
        messages += [assistant(result.choices[0]), {"role": "user", "content": "More."}]
    agent.set_agent_reward(1.0, None, None)
    episode = await endpoint.close(agent.session_id)
    assert episode.turn_rewards == [0.0, 1.0] and episode.success and episode.reward == 1.0
    verified = endpoint.open_session(first_observation="You see a ball.")
    verified.add_env_reward(0.25, False, False, 0.0)  # before any call: the first turn's
    result = await endpoint.complete(verified, request([{"role": "user", "content": "You see a ball."}]))
    verified.add_env_reward(0.5, True, True, 1.0)
    with pytest.raises(RequestError) as over:
        await endpoint.complete(verified, request([{"role": "user", "content": "x"}]))
    assert over.value.code == "episode_over"
    episode = await endpoint.close(verified.session_id)
    assert episode.turn_rewards == [0.75] and episode.success and episode.stop_reason == "done"
    assert episode.observations[0] == "You see a ball." and result.plan.kind == PLAN_FIRST
    empty = endpoint.open_session()
    assert (await endpoint.close(empty.session_id)).failure == "environment"  # no call: nothing to train on


async def test_training_samples_at_the_runs_temperature_whatever_the_agent_asks(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, generator = endpoint_of(chat, ["Action: a"] * 2, temperature=0.9, top_p=1.0)
    session = endpoint.open_session()
    await endpoint.complete(session, request([{"role": "user", "content": "Go."}], temperature=0.2))
    assert generator.sampled[0][:2] == (0.9, 1.0) and endpoint.stats.temperature_overridden == 1
    free, free_generator = endpoint_of(chat, ["Action: a"])
    await free.complete(free.open_session(), request([{"role": "user", "content": "Go."}], temperature=0.2))
    assert free_generator.sampled[0][0] == 0.2


async def test_concurrent_sessions_hold_only_their_own_tokens(tokenizer):
    chat = chat_of(tokenizer)
    endpoint, _ = endpoint_of(chat, [f"Action: reply {i}" for i in range(200)])
    sessions = [endpoint.open_session() for _ in range(20)]

    async def play(k: int, session):
        messages = [{"role": "user", "content": f"session {k}"}]
        answers = []
        for turn in range(3):
            result = await endpoint.complete(session, request(messages))
            answers.append(result.choices[0].ids)
            messages += [assistant(result.choices[0]), {"role": "user", "content": f"session {k} turn {turn}"}]
            await asyncio.sleep(0)
        return answers

    answers = await asyncio.gather(*(play(k, s) for k, s in enumerate(sessions)))
    for k, session in enumerate(sessions):
        episode = await endpoint.close(session.session_id)
        assert [episode.token_ids[s:e] for s, e in episode.turn_spans] == answers[k]
        assert chat.decode(episode.token_ids).count(f"session {k}") == 3 and not episode.sample_starts


# ------------------------------------------------------------------ requests refused


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "wizard", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "a", "arguments": "{"}}]}]},
     "messages[0].tool_calls"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools[0]"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": {"function": {"name": "fly"}}},
     "tool_choice"),
    ({"messages": [{"role": "user", "content": "x"}], "n": 0}, "n"),
    ({"messages": [{"role": "user", "content": "x"}], "temperature": 3}, "temperature"),
    ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "x"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": [{"role": "user", "content": "x"}], "presence_penalty": 0.5}, "presence_penalty"),
    ({"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_object"}}, "response_format"),
])
def test_malformed_requests_say_what_is_wrong(body, param):
    with pytest.raises(RequestError) as refused:
        parse_chat_request(body)
    assert refused.value.status == 400 and refused.value.param == param and refused.value.message


async def test_a_template_that_cannot_render_the_request_is_a_400(tokenizer):
    chat = chat_of(tokenizer, "{{ raise_exception('no tools here') if tools else '' }}{% for m in messages %}"
                              "{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
                              "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    endpoint, _ = endpoint_of(chat, ["Action: a"], tool_prompt="refuse")
    with pytest.raises(RequestError) as refused:
        await endpoint.complete(endpoint.open_session(), request([{"role": "user", "content": "Go."}], tools=TOOLS))
    assert refused.value.status == 400 and refused.value.code == "unsupported_tools"
    assert json.dumps(refused.value.body())
