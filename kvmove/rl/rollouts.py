"""Rollouts: completions an engine sampled, scored by a reward, with group-relative advantages (REINFORCE with
the mean reward of the prompt's group as baseline); what each trainer rank trains on."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import NamedTuple

from kvmove.errors import KvmoveError
from kvmove.sync.ranks.control import Completion


class Sample(NamedTuple):
    """One scored completion: the prompt, the sampled tokens and the engine's log-probability of each."""

    prompt: tuple[int, ...]
    tokens: tuple[int, ...]
    engine_logprobs: tuple[float, ...]
    reward: float
    advantage: float


class Rollouts(NamedTuple):
    """One step's scored samples (a trainer rank trains on ``share(rank, world)``)."""

    samples: tuple[Sample, ...]

    @property
    def mean_reward(self) -> float:
        return sum(s.reward for s in self.samples) / max(1, len(self.samples))

    def share(self, rank: int, world: int) -> Rollouts:
        """Trainer rank ``rank``'s data-parallel share: every ``world``-th sample from ``rank`` on."""
        if len(self.samples) % world:
            raise KvmoveError(f"{len(self.samples)} samples do not split evenly over {world} trainer ranks")
        return Rollouts(self.samples[rank::world])


Reward = Callable[[Completion], float]
"""Scores one completion (higher is better)."""


class TokenPatternReward:
    """The fraction of a completion's tokens whose text matches ``pattern`` (by default: a whole word, a space
    then letters): a dense reward a tiny random model can learn in a few steps, and one a reader sees."""

    def __init__(self, token_texts: Sequence[str], pattern: str = r"^ [a-z]+$") -> None:
        try:
            regex = re.compile(pattern)
        except re.error as exc:
            raise KvmoveError(f"reward pattern {pattern!r} is not a regular expression: {exc}") from None
        self.rewarded = frozenset(i for i, text in enumerate(token_texts) if regex.search(text))
        if not self.rewarded:
            raise KvmoveError(f"reward pattern {pattern!r} matches no token of the vocabulary")

    def __call__(self, completion: Completion) -> float:
        if not completion.tokens:
            return 0.0
        return sum(t in self.rewarded for t in completion.tokens) / len(completion.tokens)


def score(completions: Sequence[Completion], reward: Reward) -> Rollouts:
    """Score every completion; its advantage is its reward minus the mean reward of the completions of the same
    prompt (a group's samples sharing one reward teach nothing, as they should)."""
    rewards = [reward(c) for c in completions]
    groups: dict[tuple[int, ...], list[float]] = {}
    for c, r in zip(completions, rewards, strict=True):
        groups.setdefault(c.prompt, []).append(r)
    baseline = {p: sum(rs) / len(rs) for p, rs in groups.items()}
    return Rollouts(
        tuple(
            Sample(c.prompt, c.tokens, c.logprobs, r, r - baseline[c.prompt])
            for c, r in zip(completions, rewards, strict=True)
        )
    )
