"""The RL loop: train on the last rollouts, sync the new weights into the live engines (verified), roll out from
them, score; once per step, ``RlConfig.steps`` times.

The trainer ranks are ``kvmove.rl.learner``'s FSDP2 policy (2 processes on CPU, gloo); the engines are vLLM
replicas (``engine_kind="vllm"``), each in kvmove's engine host. Everything the loop asks of the engines goes
through :class:`EngineSeam`: ``update`` (today kvmove's sync driver, whose vLLM engine host calls vLLM's own RL
API -- ``init_weight_transfer_engine`` once, then ``start_weight_update`` / ``update_weights`` /
``finish_weight_update`` with the ``kvmove`` backend -- inside the engine's process) and ``rollout``.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvmove.errors import KvmoveError
from kvmove.layout import EngineLayout, TrainerLayout
from kvmove.models import resolve_model
from kvmove.rl.learner import RlTrainer, TrainReport
from kvmove.rl.rollouts import Rollouts, TokenPatternReward, score
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.cluster import Cluster
from kvmove.sync.driver.faults import FaultHooks
from kvmove.sync.driver.result import SyncResult
from kvmove.sync.driver.run import start
from kvmove.sync.driver.step import run_sync
from kvmove.sync.ranks.control import Completion, Generate, Sampling, TrainStep
from kvmove.sync.strategies import Strategy, parse_strategies

Progress = Callable[[str], None]
DEFAULT_PROMPTS = ("the hot", "a of to", "and in it", "that was for")
WORK_TIMEOUT_S = 600.0
"""A training step or a rollout may take minutes on a loaded CPU (vLLM compiles its CPU kernels at first use)."""


@dataclass(frozen=True)
class RlConfig:
    """One RL run (built at the edge: the example's flags)."""

    model: str = "qwen3-moe-vllm"
    steps: int = 4
    trainers: int = 2
    engines: int = 2
    strategy: str = "v3"
    transport: str = "auto"
    launcher: str = "processes"
    """How the ranks start (``processes``, or ``ray``: the same hosts as Ray actors)."""
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    samples: int = 4
    """Sampled completions per prompt (one group: their mean reward is the baseline)."""
    max_tokens: int = 8
    temperature: float = 1.0
    lr: float = 1e-3
    reward_pattern: str = r"^ [a-z]+$"
    """A token is rewarded when its text matches this (default: a whole word)."""
    seed: int = 0
    work_dir: str | None = None
    """Where the trainer's checkpoints and the tokenizer go (None: a temporary directory)."""
    engine_kind: str = "vllm"
    deadline_s: float = 300.0
    """Seconds a sync waits without progress before a peer counts as gone (2 shared cores can be very slow)."""


class RlStep(NamedTuple):
    """One step of the loop, as the example prints it."""

    step: int
    loss: float | None
    """Mean over trainer ranks of the REINFORCE loss on the previous step's rollouts (None: step 1 trains not)."""
    logprob_gap: float | None
    train_seconds: float
    sync: SyncResult
    reward: float
    """Mean reward of this step's sampled rollouts (from the weights just synced)."""
    rollout_seconds: float
    greedy: tuple[str, ...]
    """Greedy continuation of each prompt, decoded."""
    greedy_tokens: tuple[tuple[int, ...], ...]


class EngineSeam:
    """What the loop asks of the engines. ``update``: bring the trainer's step ``version`` into every live engine
    (verified); ``rollout``: completions of the prompts, split over the live engine replicas."""

    def __init__(self, cluster: Cluster, strategy: Strategy) -> None:
        self.cluster, self.strategy = cluster, strategy
        self.hooks = FaultHooks((), cluster.config.engine)

    def update(self, version: int) -> SyncResult:
        return run_sync(self.cluster, self.hooks, self.strategy, version, version)

    def rollout(self, prompts: Sequence[tuple[int, ...]], sampling: Sampling) -> list[list[Completion]]:
        """Per prompt (in order), its ``sampling.n`` completions."""
        c = self.cluster
        live = c.live_engines()
        parts = [tuple(prompts[i :: len(live)]) for i in range(len(live))]
        used = [k for k, p in enumerate(parts) if p]
        calls = [c.engines[live[k]].submit(Generate(parts[k], sampling)) for k in used]
        outs: list[list[Completion]] = c.launcher.gather(calls, WORK_TIMEOUT_S)
        per_prompt: list[list[Completion]] = [[] for _ in prompts]
        for k, done in zip(used, outs, strict=True):
            for j, completion in enumerate(done):
                per_prompt[k + (j // sampling.n) * len(live)].append(completion)
        return per_prompt


def sync_config(config: RlConfig, checkpoints: Path) -> SyncConfig:
    """The sync half of the run: the FSDP2 policy as the source, the engines, verification against the
    checkpoint the policy saves at each step."""
    return SyncConfig(
        model=resolve_model(config.model),
        trainer=TrainerLayout(dp=config.trainers),
        engine=EngineLayout.parse("tp=1", config.engines),
        strategies=tuple(parse_strategies(config.strategy)),
        transport=config.transport,
        verify=True,
        seed=config.seed,
        placement=Placement(launcher=config.launcher),
        engine_kind=config.engine_kind,
        source=RlTrainer(str(checkpoints), config.lr),
        reference=str(checkpoints / "step-{version}"),
        deadline_s=config.deadline_s,
    )


def check(config: RlConfig) -> None:
    """Bad settings, refused before anything starts."""
    for name in ("steps", "trainers", "engines", "samples", "max_tokens"):
        if getattr(config, name) < 1:
            raise KvmoveError(f"--{name.replace('_', '-')} must be at least 1")
    if config.temperature <= 0:
        raise KvmoveError("--temperature must be above 0: REINFORCE needs sampled rollouts")
    if (len(config.prompts) * config.samples) % config.trainers:
        n = len(config.prompts) * config.samples
        raise KvmoveError(
            f"{n} rollouts ({len(config.prompts)} prompts x {config.samples}) do not split evenly over "
            f"{config.trainers} trainer ranks"
        )
    if len(parse_strategies(config.strategy)) != 1:
        raise KvmoveError("the RL loop syncs with one strategy (e.g. --strategy v3)")


def run_rl(config: RlConfig, progress: Progress | None = None) -> Iterator[RlStep]:
    """Start the trainer ranks and engines, then ``config.steps`` steps (see module docstring); a sync that does
    not verify ends the run after its step is reported."""
    check(config)
    with ExitStack() as stack:
        work = Path(config.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmove-rl-")))
        tokenizer = load_tokenizer(work / "tokenizer", resolve_model(config.model).vocab_size)
        texts = token_texts(tokenizer, resolve_model(config.model).vocab_size)
        reward = TokenPatternReward(texts, config.reward_pattern)
        prompts = [tuple(tokenizer.encode(p).ids) for p in config.prompts]
        sc = sync_config(config, work / "checkpoints")
        cluster = start(sc, progress)
        stack.callback(cluster.close)
        seam = EngineSeam(cluster, sc.strategies[0])
        rollouts: Rollouts | None = None
        for step in range(1, config.steps + 1):
            result, rollouts = _step(config, seam, step, rollouts, prompts, reward, texts)
            yield result
            if not result.sync.verified:
                return


def _step(
    config: RlConfig,
    seam: EngineSeam,
    step: int,
    rollouts: Rollouts | None,
    prompts: list[tuple[int, ...]],
    reward: TokenPatternReward,
    texts: list[str],
) -> tuple[RlStep, Rollouts]:
    t0 = time.perf_counter()
    reports = train(seam.cluster, rollouts) if rollouts is not None else []
    t1 = time.perf_counter()
    synced = seam.update(step)
    t2 = time.perf_counter()
    sampling = Sampling(config.max_tokens, config.samples, config.temperature, config.seed * 1000 + step)
    fresh = score([c for group in seam.rollout(prompts, sampling) for c in group], reward)
    t3 = time.perf_counter()
    greedy = [group[0].tokens for group in seam.rollout(prompts, Sampling(config.max_tokens))]
    loss = sum(r.loss for r in reports) / len(reports) if reports else None
    gap = sum(r.logprob_gap for r in reports) / len(reports) if reports else None
    text = tuple("".join(texts[t] for t in g) for g in greedy)
    result = RlStep(step, loss, gap, t1 - t0, synced, fresh.mean_reward, t3 - t2, text, tuple(greedy))
    return result, fresh


def train(cluster: Cluster, rollouts: Rollouts) -> list[TrainReport]:
    """One training step on every trainer rank (each takes its share of ``rollouts``)."""
    calls = [t.submit(TrainStep(rollouts)) for t in cluster.trainers]
    reports: list[TrainReport] = cluster.launcher.gather(calls, WORK_TIMEOUT_S)
    return reports


def token_texts(tokenizer: Any, vocab_size: int) -> list[str]:
    """Each token id's text; ids the tokenizer leaves unused (the model's vocabulary is larger) as ``<id>``."""
    return [tokenizer.decode([i]) or f"<{i}>" for i in range(vocab_size)]


def load_tokenizer(directory: Path, vocab_size: int) -> Any:
    """The tokenizer the engines are started with (kvmove.engines.vllm.checkpoint: deterministic, local)."""
    from tokenizers import Tokenizer

    from kvmove.engines.vllm.checkpoint import write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, vocab_size)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))
