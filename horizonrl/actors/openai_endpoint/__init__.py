"""An OpenAI-compatible endpoint in front of an actor's engine: agents written against the ``openai`` client
play episodes through it, recorded token for token (docs/agents.md).

- ``wire.py``: the chat API's requests (validated) and errors;
- ``tool_calls.py``: tool calls parsed from completions (hermes, llama3_json) and written into prompts;
- ``rendering.py``: a conversation as the model's chat template renders it;
- ``session.py``: one session = one episode: prompts as appends, extensions or branches of the tokens held;
- ``endpoint.py``: sessions and calls, no HTTP;
- ``http_app.py``: the HTTP routes (aiohttp), keys, errors;
- ``agent_runs.py``: the actor's episodes played by an agent program, one session each.

``horizonrl endpoint`` (``apps/endpoint.py``) serves it alone in front of one engine; ``horizonrl agent-eval``
(``apps/agent_eval.py``) measures an agent's held-out success through it.
"""
