"""``rollout.agent``: episodes played by an agent program of the user's through the OpenAI-compatible endpoint
(``actors/openai_endpoint/``, docs/agents.md). Bottom layer, like ``config.py`` (which holds it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class AgentEndpointConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    host: str = Field("127.0.0.1", description="where each actor's endpoint listens (loopback unless set; any other "
                                               "address needs api_key_file)")
    port: int = Field(0, ge=0, le=65535, description="0: a free port (each actor its own); the agent gets the URL")
    api_key_file: str | None = Field(None, description="a file holding the key agents must send; default: a new "
                                                       "random key per actor, handed to its agents (OPENAI_API_KEY)")
    tool_call_format: Literal["hermes", "llama3_json"] = Field(
        "hermes", description="how tool calls are read from completions (hermes: <tool_call> JSON blocks, as "
                              "Qwen2.5/Qwen3 write them; llama3_json: Llama 3.1's JSON calls)")
    tool_prompt: Literal["hermes", "refuse"] = Field(
        "hermes", description="for a chat template that cannot render tools: describe them in hermes style in the "
                              "system turn, or refuse requests with tools (HTTP 400)")
    max_body_bytes: int = Field(4 << 20, ge=1024, description="larger requests get HTTP 413")


class AgentConfig(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    command: list[str] = Field(..., min_length=1, description="the agent program, started once per episode with "
                               "OPENAI_BASE_URL / OPENAI_API_KEY naming its session, HORIZONRL_SESSION_URL (the "
                               "session's environment and close), HORIZONRL_ENV and HORIZONRL_TASK_ID; relative "
                               "paths are relative to where `horizonrl train` runs, and a first word `python` is "
                               "the interpreter that runs horizonrl")
    env: dict[str, str] = Field({}, description="more environment variables for the agent program")
    endpoint: AgentEndpointConfig = AgentEndpointConfig()
    stop_grace_s: float = Field(5.0, gt=0, description="after its session ends, how long the program may take to "
                                                       "exit before it is killed")
