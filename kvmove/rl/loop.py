"""The RL loop: train on the last rollouts, sync the new weights into the live engines (verified), roll out from
them, score; once per step, ``RlConfig.steps`` times.

Wired as an RL framework wires kvmove, through vLLM's own RL API alone: the trainer ranks are
``kvmove.rl.learner``'s FSDP2 policy (2 processes on CPU, gloo), each building kvmove's trainer-side engine with
``WeightTransferTrainerFactory.trainer_init`` (``kvmove.rl.trainer_rank``); the engines are plain ``vllm.LLM``
objects in the driver (``kvmove.rl.engines``, vLLM's default multi-process mode, backend ``kvmove``). A sync is
``send_weights()`` on every trainer rank, whose rank 0 calls ``init_weight_transfer_engine`` once, then
``start_weight_update`` / ``update_weights`` / ``finish_weight_update`` on every engine; each vLLM worker pulls
its share with v3 from the trainer ranks. Everything the loop asks of the engines goes through
:class:`EngineSeam`: ``update`` (then a bit-exact check in every worker against the checkpoint the trainer saved)
and ``rollout`` (from the same ``LLM`` objects).
"""

from __future__ import annotations

import secrets
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from kvmove.engines import get_engine
from kvmove.errors import KvmoveError
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.rl.engines import VllmEngines
from kvmove.rl.learner import RlTrainer, TrainReport
from kvmove.rl.rollouts import Rollouts, TokenPatternReward, score
from kvmove.rl.trainer_rank import JoinEngines, RlTrainerHost, SendReport, SendWeights
from kvmove.sync.config import Placement, Side, SyncConfig
from kvmove.sync.launchers import get_launcher
from kvmove.sync.launchers.base import Launcher, RankHandle
from kvmove.sync.ranks.control import Completion, PickAddress, Sampling, TrainStep
from kvmove.sync.ranks.host import RankSpec
from kvmove.sync.strategies import parse_strategies

Progress = Callable[[str], None]
DEFAULT_PROMPTS = ("the hot", "a of to", "and in it", "that was for")
WORK_TIMEOUT_S = 600.0
"""A training step, a sync or a rollout may take minutes on a loaded CPU (vLLM compiles its CPU kernels at first
use)."""


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
    """How the trainer ranks start (``processes``, or ``ray``: the same hosts as Ray actors)."""
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    samples: int = 4
    """Sampled completions per prompt (one group: their mean reward is the baseline)."""
    max_tokens: int = 8
    temperature: float = 1.0
    lr: float = 1e-3
    master: bool = False
    """FP32 master weights with a BF16 image (mixed precision, as RL trainers run it; False: BF16 parameters)."""
    delta: bool = False
    """Delta syncs (docs/delta-sync.md): after the first, each sync moves only the words the step changed."""
    reward_pattern: str = r"^ [a-z]+$"
    """A token is rewarded when its text matches this (default: a whole word)."""
    seed: int = 0
    work_dir: str | None = None
    """Where the trainer's checkpoints and the tokenizer go (None: a temporary directory)."""
    deadline_s: float = 300.0
    """Seconds a sync waits without progress before a peer counts as gone (2 shared cores can be very slow)."""


class SyncReport(NamedTuple):
    """One sync of the loop: the trainer's weights of ``version`` into every engine, checked in every worker."""

    version: int
    strategy: str
    seconds: float
    """Wall time of ``send_weights`` on the trainer ranks (start, update, finish on every engine)."""
    bytes: int
    """Bytes the engines' workers pulled into their staging models."""
    verified: bool
    mismatches: tuple[str, ...]
    """``engine e: key`` for every key an engine computes with other bits than the trainer's checkpoint."""
    live_engines: int
    weight_versions: tuple[str | None, ...]
    """What each engine reports (``LLM.get_weight_version``) after the sync."""


class RlStep(NamedTuple):
    """One step of the loop, as the example prints it."""

    step: int
    loss: float | None
    """Mean over trainer ranks of the REINFORCE loss on the previous step's rollouts (None: step 1 trains not)."""
    logprob_gap: float | None
    train_seconds: float
    sync: SyncReport
    reward: float
    """Mean reward of this step's sampled rollouts (from the weights just synced)."""
    rollout_seconds: float
    greedy: tuple[str, ...]
    """Greedy continuation of each prompt, decoded."""
    greedy_tokens: tuple[tuple[int, ...], ...]


class EngineSeam:
    """What the loop asks of the trainer ranks and the engines. ``update``: bring the trainer's step ``version``
    into every live engine through vLLM's weight-transfer API (verified); ``rollout``: completions of the prompts,
    split over the engines; ``train``: one step on every trainer rank."""

    def __init__(self, launcher: Launcher, trainers: Sequence[RankHandle], engines: VllmEngines, config: SyncConfig):
        self.launcher, self.trainers, self.engines, self.config = launcher, list(trainers), engines, config
        self.strategy = config.strategies[0].name

    def join(self) -> None:
        """Every trainer rank builds its policy and kvmove's trainer engine; rank 0 inits the engines' side."""
        (store,) = self.launcher.call(self.trainers[:1], PickAddress(), WORK_TIMEOUT_S)
        join = JoinEngines(store, self.engines.address, self.strategy, self.config.transport)
        self.launcher.call(self.trainers, join, WORK_TIMEOUT_S)

    def update(self, version: int) -> SyncReport:
        start = time.perf_counter()
        sent: list[SendReport] = self.launcher.call(self.trainers, SendWeights(version), WORK_TIMEOUT_S)
        assert all(r.version == version for r in sent)
        seconds = time.perf_counter() - start
        assert self.config.reference is not None
        checks = self.engines.check(self.config.reference.format(version=version))
        bad = tuple(f"engine {c.engine}: {key}" for c in checks for key in c.mismatches)
        verified = not bad and all(c.compared > 0 for c in checks)
        nbytes = sum(stats.bytes_received for stats in self.engines.received())
        versions = tuple(self.engines.versions())
        return SyncReport(version, self.strategy, seconds, nbytes, verified, bad, len(checks), versions)

    def rollout(self, prompts: Sequence[tuple[int, ...]], sampling: Sampling) -> list[list[Completion]]:
        """Per prompt (in order), its ``sampling.n`` completions."""
        return self.engines.generate(prompts, sampling)

    def train(self, rollouts: Rollouts) -> list[TrainReport]:
        """One training step on every trainer rank (each takes its share of ``rollouts``)."""
        reports: list[TrainReport] = self.launcher.call(self.trainers, TrainStep(rollouts), WORK_TIMEOUT_S)
        return reports


def sync_config(config: RlConfig, checkpoints: Path) -> SyncConfig:
    """What the trainer ranks start from: the FSDP2 policy (its factory), the layouts, the strategy, and where
    the policy saves the checkpoint of each synced step (what every sync is verified against)."""
    return SyncConfig(
        model=resolve_model(config.model),
        trainer=TrainerLayout(dp=config.trainers),
        engine=EngineLayout.parse("tp=1", config.engines),
        strategies=tuple(parse_strategies(config.strategy)),
        transport=config.transport,
        verify=True,
        seed=config.seed,
        placement=Placement(launcher=config.launcher),
        engine_kind="vllm",
        source=RlTrainer(str(checkpoints), config.lr, config.master),
        delta=config.delta,
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
    get_engine("vllm").check_dtype(resolve_model(config.model))
    if len(parse_strategies(config.strategy)) != 1:
        raise KvmoveError("the RL loop syncs with one strategy (e.g. --strategy v3)")


def run_rl(config: RlConfig, progress: Progress | None = None) -> Iterator[RlStep]:
    """Start the trainer ranks and engines, then ``config.steps`` steps (see module docstring); a sync that does
    not verify ends the run after its step is reported."""
    check(config)
    say = progress or (lambda _m: None)
    with ExitStack() as stack:
        work = Path(config.work_dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="kvmove-rl-")))
        seam, texts, prompts, reward = _start(config, work, stack, say)
        rollouts: Rollouts | None = None
        for step in range(1, config.steps + 1):
            result, rollouts = _step(config, seam, step, rollouts, prompts, reward, texts)
            yield result
            if not result.sync.verified:
                return


class Started(NamedTuple):
    """What the loop runs on: the joined trainers and engines, each token's text, the prompts' ids, the reward."""

    seam: EngineSeam
    texts: list[str]
    prompts: list[tuple[int, ...]]
    reward: TokenPatternReward


def _start(config: RlConfig, work: Path, stack: ExitStack, say: Progress) -> Started:
    """The tokenizer and reward, the trainer processes, the engines, and the trainer engines joined to them."""
    cfg = resolve_model(config.model)
    tokenizer = load_tokenizer(work / "tokenizer", cfg.vocab_size)
    texts = token_texts(tokenizer, cfg.vocab_size)
    reward = TokenPatternReward(texts, config.reward_pattern)
    prompts = [tuple(tokenizer.encode(p).ids) for p in config.prompts]
    sc = sync_config(config, work / "checkpoints")
    authkey = secrets.token_bytes(32)
    launcher = get_launcher(config.launcher)(sc)
    stack.callback(launcher.close)
    say(f"starting {config.trainers} trainer processes ({config.launcher}) and {config.engines} vLLM engines")
    specs = [RankSpec(Side.TRAINER, r, sc, "cpu", authkey) for r in range(config.trainers)]
    trainers = launcher.start([(RlTrainerHost, spec) for spec in specs])
    engines = VllmEngines(cfg, config.engines, authkey, config.seed)
    stack.callback(engines.close)
    seam = EngineSeam(launcher, trainers, engines, sc)
    say("trainer ranks: trainer_init (kvmove backend); engines: init_weight_transfer_engine")
    seam.join()
    return Started(seam, texts, prompts, reward)


class Stepped(NamedTuple):
    """One step's result and the scored rollouts the next step trains on."""

    result: RlStep
    rollouts: Rollouts


def _step(
    config: RlConfig,
    seam: EngineSeam,
    step: int,
    rollouts: Rollouts | None,
    prompts: list[tuple[int, ...]],
    reward: TokenPatternReward,
    texts: list[str],
) -> Stepped:
    t0 = time.perf_counter()
    reports = seam.train(rollouts) if rollouts is not None else []
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
    return Stepped(result, fresh)


def token_texts(tokenizer: Any, vocab_size: int) -> list[str]:
    """Each token id's text; ids the tokenizer leaves unused (the model's vocabulary is larger) as ``<id>``."""
    return [tokenizer.decode([i]) or f"<{i}>" for i in range(vocab_size)]


def load_tokenizer(directory: Path, vocab_size: int) -> Any:
    """The tokenizer the engines are started with (kvmove.models.directory: deterministic, local)."""
    from tokenizers import Tokenizer

    from kvmove.models.directory import write_tokenizer

    directory.mkdir(parents=True, exist_ok=True)
    write_tokenizer(directory, vocab_size)
    return Tokenizer.from_file(str(directory / "tokenizer.json"))
