"""An episode as the messages that leave the actor: the trajectory the learner trains on (:func:`to_trajectory`),
its texts for the buffer's recording (:func:`episode_text`, for the groups :func:`recorded` picks), and the
transcript a person reads (:func:`episode_sample`). Shared by the actor's loop and the evaluations."""

from __future__ import annotations

import zlib

from horizonrl.actors.episode import Episode
from horizonrl.protocol import MAX_SAMPLE_TEXT, EpisodeSample, EpisodeText, Trajectory
from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack


def to_trajectory(ep: Episode, *, run_id: str, trajectory_id: str, group_id: str, group_size: int, env: str,
                  task_id: int, actor_id: int, max_turns: int, category: str, with_text: bool = False) -> Trajectory:
    return Trajectory(
        run_id=run_id,
        trajectory_id=trajectory_id,
        group_id=group_id,
        group_size=group_size,
        env=env,
        task_id=task_id,
        actor_id=actor_id,
        token_ids=pack(ep.token_ids, TOKEN_DTYPE),
        loss_mask=pack(ep.loss_mask, MASK_DTYPE),
        logprobs=pack(ep.logprobs, LOGPROB_DTYPE),
        prompt_length=ep.prompt_length,
        turn_spans=ep.turn_spans,
        turn_versions=ep.turn_versions,
        turn_epochs=ep.turn_epochs,
        version_spans=ep.version_spans,
        sample_starts=ep.sample_starts,
        hidden_turns=[ep.hidden_turns_at.get(start, 0) for start in ep.sample_starts] if ep.hidden_turns_at else [],
        summary_turns=ep.summary_turns,
        turn_rewards=ep.turn_rewards,
        reward=ep.reward,
        success=ep.success,
        score=ep.score,
        num_turns=ep.num_turns,
        max_turns=max_turns,
        stop_reason=ep.stop_reason,
        failure=ep.failure,
        failure_message=ep.failure_message,
        category=category,
        timings={"generate_s": ep.generate_s, "env_s": ep.env_s},
        text=episode_text(ep) if with_text else None,
    )


def episode_text(ep: Episode) -> EpisodeText:
    """The episode's texts for the buffer's recording, each cut to MAX_SAMPLE_TEXT characters."""
    def cut(texts: list[str]) -> list[str]:
        return [t[:MAX_SAMPLE_TEXT] for t in texts]

    return EpisodeText(first_observation=(ep.observations or [""])[0][:MAX_SAMPLE_TEXT], replies=cut(ep.replies),
                       actions=cut(ep.actions), observations=cut(ep.observations[1:]))


def recorded(group_id: str, fraction: float) -> bool:
    """Whether the actor sends this group's texts to be recorded: a fixed share of groups, picked
    by a hash of the id (the same on every actor and after a restart), whole groups at a time so
    that the episodes of one task under one policy can be compared."""
    return zlib.crc32(group_id.encode()) < fraction * 2**32


def episode_sample(ep: Episode, *, run_id: str, env: str, task_id: int, actor_id: int,
                   max_turns: int) -> EpisodeSample:
    """The episode as text for a person to read (each text cut to MAX_SAMPLE_TEXT characters)."""
    return EpisodeSample(
        run_id=run_id, env=env, task_id=task_id, actor_id=actor_id, weight_version=min(ep.turn_versions, default=0),
        max_turns=max_turns, reward=ep.reward, success=ep.success, score=ep.score, num_turns=ep.num_turns,
        stop_reason=ep.stop_reason, failure=ep.failure,
        transcript=[(role, text[:MAX_SAMPLE_TEXT]) for role, text in ep.transcript()],
    )
