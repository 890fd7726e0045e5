"""kvmove's trainer-side engine for vLLM's weight-transfer API: ``WeightTransferTrainerFactory.trainer_init``.

An RL framework uses kvmove through vLLM's documented calls alone::

    engine = WeightTransferTrainerFactory.trainer_init(
        init_info=KvmoveTrainerInitInfo(rank=rank, strategy="v3", transport="nixl"),
        client=client,                 # any VLLMWeightSyncClient: HTTP, Ray, or kvmove.vllm.clients
        source=ModuleSource(model),    # vLLM's WeightSource (or a kvmove WeightSource with ``layout``)
    )
    engine.send_weights()              # once per sync, on every trainer rank

Every trainer rank hosts its kvmove trainer rank in its own process (:class:`~kvmove.sync.embedded.trainer.
EmbeddedTrainer`): rank 0 opens the engine registry and sends the workers its join info through
``client.init_weight_transfer_engine``; each vLLM worker plans, registers and later pulls by address
(:mod:`kvmove.vllm.join`). ``send_weights`` runs one sync: rank 0 drives ``start_weight_update``,
``update_weights`` (concurrently with the trainer's serving) and ``finish_weight_update``.
Importing this module registers the engine under ``"kvmove"`` (vLLM processes also do it through the plugin).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Self

from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine

from kvmove.models.layout import TrainerLayout
from kvmove.sync.embedded.trainer import EmbeddedTrainer, TrainerSettings
from kvmove.sync.ranks.control import TrainerStats
from kvmove.vllm import BACKEND, register_trainer


@dataclass
class KvmoveTrainerInitInfo(TrainerInitInfo):
    """How the trainer side syncs (the same on every rank; ``rank`` is this process's trainer rank)."""

    backend: ClassVar[str] = BACKEND

    strategy: str = "v3"
    """v1, v2 or v3 (kvmove's pull strategies)."""
    transport: str = "nixl"
    """nixl (or http, cuda-ipc): a transport each vLLM worker opens on its own."""
    host: str = "127.0.0.1"
    """Address this rank's control server and the registry listen on: the vLLM workers must reach it."""
    device: str = "cpu"
    """Where this rank's serve slots live."""
    deadline_s: float = 60.0
    layout: TrainerLayout | None = None
    """The trainer layout of a kvmove ``WeightSource`` (None for vLLM's WeightSource: data parallel)."""
    delta: bool = False
    """Delta syncs (docs/delta-sync.md): after a completed sync, the next moves only the changed words."""

    def settings(self) -> TrainerSettings:
        return TrainerSettings(
            self.strategy, self.transport, self.device, self.host, self.deadline_s, layout=self.layout, delta=self.delta
        )


class KvmoveTrainerEngine(TrainerWeightTransferEngine[KvmoveTrainerInitInfo]):
    """One trainer rank of kvmove's pull-based sync into vLLM workers (see the module docstring)."""

    init_info_cls = KvmoveTrainerInitInfo

    def __init__(self, *, client: Any, source: Any, trainer: EmbeddedTrainer) -> None:
        super().__init__(client=client, source=source, is_sender=trainer.rank == 0)
        self.trainer = trainer
        self.last_stats: TrainerStats | None = None
        """This rank's serving stats of the last sync."""

    @classmethod
    def trainer_init(cls, init_info: KvmoveTrainerInitInfo, *, client: Any, source: Any = None) -> Self:
        if source is None:
            raise ValueError("kvmove's trainer engine needs a WeightSource (e.g. ModuleSource(model))")
        trainer = EmbeddedTrainer(init_info.rank, source, client, init_info.settings())
        return cls(client=client, source=source, trainer=trainer)

    def send_weights(self, weight_version: str | None = None) -> None:
        """One sync (every rank): the vLLM workers hold the source's current weights when it returns."""
        self.last_stats = self.trainer.sync(weight_version)

    def shutdown(self) -> None:
        """Release this rank's serving side and registry (the workers keep their weights; call the inference
        side's ``shutdown_weight_transfer_engine`` to release theirs)."""
        self.trainer.close()


register_trainer()
