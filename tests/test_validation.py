"""Semantic checks at the door (protocol/validation.py): each inconsistency is named, the valid passes."""

import math

import msgspec
import numpy as np
import pytest
from helpers import make_trajectory

from horizonrl.protocol.arrays import LOGPROB_DTYPE, MASK_DTYPE, TOKEN_DTYPE, pack
from horizonrl.protocol.validation import trajectory_problem

GOOD = make_trajectory("g", 0, reward=1.0, tokens=12)  # prompt 6 tokens, one turn of 6


def broken(**changes):
    return msgspec.structs.replace(GOOD, **changes)


def test_a_consistent_trajectory_passes():
    assert trajectory_problem(GOOD, vocab_size=12) is None


@pytest.mark.parametrize("changes, reason", [
    (dict(trajectory_id=""), "ids"),
    (dict(group_size=0), "fields"),
    (dict(failure="meteor"), "fields"),
    (dict(token_ids=GOOD.token_ids[:-1]), "array_lengths"),  # not a whole number of int32
    (dict(loss_mask=GOOD.loss_mask + b"\x01"), "array_lengths"),
    (dict(logprobs=GOOD.logprobs[:-4]), "array_lengths"),
    (dict(prompt_length=13), "array_lengths"),
    (dict(loss_mask=pack([0] * 6 + [2] * 6, MASK_DTYPE)), "loss_mask"),
    (dict(token_ids=pack(list(range(11)) + [-3], TOKEN_DTYPE)), "token_out_of_vocab"),
    (dict(logprobs=pack([0] * 6 + [-0.5] * 5 + [math.nan], LOGPROB_DTYPE)), "logprobs"),
    (dict(logprobs=pack([0] * 6 + [-0.5] * 5 + [0.7], LOGPROB_DTYPE)), "logprobs"),  # a probability above 1
    (dict(logprobs=pack([-0.1] + [0] * 5 + [-0.5] * 6, LOGPROB_DTYPE)), "logprobs"),  # on a prompt token
    (dict(reward=math.nan), "non_finite_number"),
    (dict(turn_rewards=[math.inf]), "non_finite_number"),
    (dict(turn_versions=[0, 0]), "turns"),
    (dict(turn_epochs=[]), "turns"),
    (dict(turn_rewards=[]), "turns"),
    (dict(turn_versions=[-1]), "turns"),
    (dict(turn_spans=[(6, 13)]), "turn_spans"),  # past the end
    (dict(turn_spans=[(4, 12)]), "turn_spans"),  # inside the prompt
    (dict(turn_spans=[(7, 12)]), "turn_spans"),  # the mask says token 6 was generated too
    # the span covers token 9, which the mask says was not generated: an observation folded into a turn
    (dict(loss_mask=pack([0] * 6 + [1] * 3 + [0] + [1] * 2, MASK_DTYPE),
          logprobs=pack([0] * 6 + [-0.5] * 3 + [0] + [-0.5] * 2, LOGPROB_DTYPE)), "turn_spans"),
    (dict(loss_mask=pack([0] * 6 + [1] * 5 + [0], MASK_DTYPE),  # ... or the last token, an observation's
          logprobs=pack([0] * 6 + [-0.5] * 5 + [0], LOGPROB_DTYPE)), "turn_spans"),
    # version spans (a turn cut by a weight update): they tile the turn, start with its tag, go forward
    (dict(version_spans=[(6, 9, 0, 0), (10, 12, 0, 1)]), "turn_spans"),  # a gap
    (dict(version_spans=[(6, 9, 0, 0), (8, 12, 0, 1)]), "turn_spans"),  # an overlap
    (dict(version_spans=[(6, 9, 0, 0)]), "turn_spans"),  # ends before the turn
    (dict(version_spans=[(6, 12, 0, 0), (12, 13, 0, 1)]), "turn_spans"),  # past the last turn
    (dict(version_spans=[(6, 9, 0, 1), (9, 12, 0, 2)]), "turn_spans"),  # the turn is tagged with version 0
    (dict(version_spans=[(6, 9, 0, 0), (9, 12, 0, 0)]), "turn_spans"),  # not newer weights
    (dict(version_spans=[(6, 9, 0, 0), (9, 12, -1, 3)]), "turn_spans"),  # a negative epoch
])
def test_each_inconsistency_is_named(changes, reason):
    problem = trajectory_problem(broken(**changes), vocab_size=12)
    assert problem is not None and problem[0] == reason, problem


def test_token_ids_are_checked_against_the_vocabulary_when_known():
    t = broken(token_ids=pack(np.arange(12) + 300, TOKEN_DTYPE))
    assert trajectory_problem(t, vocab_size=None) is None
    assert trajectory_problem(t, vocab_size=312) is None  # ids 300..311
    assert trajectory_problem(t, vocab_size=311)[0] == "token_out_of_vocab"


def test_a_failed_episode_may_lack_the_reward_of_its_last_turn():
    assert trajectory_problem(broken(failure="environment", turn_rewards=[])) is None


def test_an_episode_that_failed_at_reset_passes_with_no_tokens_and_a_played_one_does_not():
    empty = dict(token_ids=b"", loss_mask=b"", logprobs=b"", prompt_length=0, turn_spans=[], turn_versions=[],
                 turn_epochs=[], turn_rewards=[], num_turns=0, version_spans=[])
    assert trajectory_problem(broken(failure="environment", **empty), vocab_size=12) is None
    assert trajectory_problem(broken(**empty), vocab_size=12)[0] == "array_lengths"


def test_a_turn_cut_by_a_weight_update_passes():
    assert trajectory_problem(broken(version_spans=[(6, 9, 0, 0), (9, 12, 0, 1)]), vocab_size=12) is None
    assert trajectory_problem(broken(version_spans=[(6, 12, 0, 0)]), vocab_size=12) is None
    assert broken(version_spans=[(6, 9, 0, 0), (9, 12, 1, 1)]).weight_keys() == [(0, 0), (1, 1)]
    assert GOOD.weight_keys() == [(0, 0)]  # without spans: the turns' tags
