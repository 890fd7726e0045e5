"""Fixtures for the rollout-worker tests: a worker factory that checks integrity at teardown."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
from engine_helpers import weights

from kvmove.models import resolve_model
from kvmove.reference import RolloutWorker, WorkerConfig


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    """Tiny tensors: intra-op threads only add overhead (and spin when the machine is loaded)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def make_worker() -> Iterator[Callable[..., RolloutWorker]]:
    """Builds workers on seeded tiny models; at teardown each passes ``check_integrity`` and, if idle, holds no lock."""
    made: list[RolloutWorker] = []

    def make(model: str = "qwen3-tiny", seed: int = 1, **config: object) -> RolloutWorker:
        config.setdefault("page_size", 4)
        config.setdefault("num_pages", 64)
        w = RolloutWorker(resolve_model(model), weights(model, seed).items(), WorkerConfig(**config))  # type: ignore[arg-type]
        made.append(w)
        return w

    yield make
    for w in made:
        w.check_integrity()
        if w.is_idle:
            assert w.kv.tree.protected_pages == 0, "locks balanced when idle"
            assert w.pool.used_pages == w.kv.tree.total_pages + w.kv.import_pages
