"""Rollouts: rewards, group-relative advantages, each trainer rank's share, and the loop's refusals."""

from __future__ import annotations

import pytest

from kvmove.errors import KvmoveError
from kvmove.rl.loop import RlConfig, check
from kvmove.rl.rollouts import Rollouts, TokenPatternReward, score
from kvmove.sync.ranks.control import Completion

TEXTS = ["", "a", " the", " hot", "th", " of"]


def _c(prompt: tuple[int, ...], tokens: tuple[int, ...]) -> Completion:
    return Completion(prompt, tokens, tuple(-1.0 for _ in tokens))


def test_the_reward_is_the_fraction_of_word_tokens() -> None:
    reward = TokenPatternReward(TEXTS)
    assert reward.rewarded == {2, 3, 5}
    assert reward(_c((1,), (2, 3, 4, 0))) == 0.5
    assert reward(_c((1,), ())) == 0.0
    assert TokenPatternReward(TEXTS, r"hot")(_c((1,), (3, 2))) == 0.5


def test_bad_reward_patterns_are_refused() -> None:
    with pytest.raises(KvmoveError, match="not a regular expression"):
        TokenPatternReward(TEXTS, "(")
    with pytest.raises(KvmoveError, match="matches no token"):
        TokenPatternReward(TEXTS, "zebra")


def test_advantages_are_relative_to_the_prompts_group() -> None:
    completions = [_c((1,), (2, 2)), _c((1,), (4, 4)), _c((7, 8), (2, 4)), _c((7, 8), (2, 4))]
    rollouts = score(completions, TokenPatternReward(TEXTS))
    assert [s.reward for s in rollouts.samples] == [1.0, 0.0, 0.5, 0.5]
    assert [s.advantage for s in rollouts.samples] == [0.5, -0.5, 0.0, 0.0]  # a uniform group teaches nothing
    assert rollouts.mean_reward == 0.5
    assert rollouts.samples[0].engine_logprobs == (-1.0, -1.0)


def test_each_trainer_rank_takes_its_share() -> None:
    rollouts = score([_c((i,), (2,)) for i in range(4)], TokenPatternReward(TEXTS))
    assert [s.prompt for s in rollouts.share(1, 2).samples] == [(1,), (3,)]
    with pytest.raises(KvmoveError, match="do not split evenly over 3 trainer ranks"):
        rollouts.share(0, 3)
    assert Rollouts(()).mean_reward == 0.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"steps": 0}, "--steps must be at least 1"),
        ({"samples": 0}, "--samples must be at least 1"),
        ({"temperature": 0.0}, "sampled rollouts"),
        ({"prompts": ("a",), "samples": 3}, "do not split evenly over 2 trainer ranks"),
        ({"strategy": "v2,v3"}, "one strategy"),
    ],
)
def test_bad_loop_settings_are_refused_up_front(change: dict[str, object], message: str) -> None:
    with pytest.raises(KvmoveError, match=message):
        check(RlConfig(**change))  # type: ignore[arg-type]
