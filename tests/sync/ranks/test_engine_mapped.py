"""Mapped pulls on the engine side, in one process (the fast CPU twin of the one-GPU FP8 sync): the engine rank maps
a trainer rank's arena through the shm transport, builds and warms at init the programs quantizing its covers into
the parameters (leaving them bit for bit), and a sync replays exactly those programs, lands every FP8 weight and
scale bit-exact with the engine's own loader, and asks the trainer to pack nothing."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from kvmove.engines import get_engine, reference_models
from kvmove.models import resolve_model
from kvmove.models.layout import EngineLayout, TrainerLayout
from kvmove.models.weights import seeded_checkpoint
from kvmove.quant import NonFiniteWeightError
from kvmove.sync.config import Placement, SyncConfig
from kvmove.sync.driver.dryrun import build_plans
from kvmove.sync.planning.blueprint import Blueprint
from kvmove.sync.planning.placement import DeviceMap
from kvmove.sync.ranks.control import TrainerEndpoint
from kvmove.sync.ranks.engine import EngineRank
from kvmove.sync.ranks.puller import ByteReader, mapped_arenas, register_params
from kvmove.sync.ranks.source import ShardedSource
from kvmove.sync.strategies import STRATEGIES
from kvmove.sync.verify import bits_equal
from kvmove.transport.local import LocalTransport
from kvmove.transport.shm import ShmTransport

MODEL, VERSION = "qwen3-moe-fp8-tiny", 1


def mapped_entries(pulls: Any) -> list[int]:
    return [m.entry for p in pulls.pulls for m in p.mapped]


class NoPacking:
    """A trainer client that reads arenas but was never meant to pack: a packed request fails the test."""

    def __init__(self, reader: ByteReader) -> None:
        self.reader = reader

    def start_direct(self, pulls: Any) -> Any:
        return self.reader.start_direct(pulls)

    def wait_direct(self, handle: Any) -> float:
        return float(handle.wait().seconds)

    def request(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("a mapped cover went back to the slot path (a pack request)")

    wait = read = finish = request


def _engine(strategy: str = "v3", device: str = "cpu") -> tuple[Blueprint, EngineRank, NoPacking, ShardedSource, Any]:
    """Trainer rank 0's seeded arena registered with one endpoint; engine rank 0 (colocated) mapping it through
    another, its parameters holding random bits (NaN payloads included). On CPU over shm; on CUDA over ``local``
    (one process: its mapped view is the arena itself, as cuda-ipc's is the same memory)."""
    cfg, placement = resolve_model(MODEL), Placement("processes", colocated=True)
    config = SyncConfig(cfg, TrainerLayout(), EngineLayout(), (STRATEGIES[strategy],), placement=placement)
    plans, _ = build_plans(config)
    devices = DeviceMap.of(placement, 1, 1)
    bp = Blueprint(
        cfg, config.trainer, config.engine, plans, config.strategies, config.options, devices=devices, mapped=True
    )
    no_gathers = SimpleNamespace(collective_calls=0)  # one rank: no collectives
    source = ShardedSource(cfg, config.trainer, 0, no_gathers, device=device)  # type: ignore[arg-type]
    source.step(VERSION)
    kind = ShmTransport if device == "cpu" else LocalTransport
    server, reader = kind(), kind()
    arena = server.register(source.arena()[0])
    endpoint = TrainerEndpoint(server.endpoint_info(), {}, arena)
    reader.connect(endpoint.info)
    model = get_engine("reference").build(cfg, config.engine, config.engine.coord(0), device=device)
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.view(torch.uint8).copy_(torch.randint(0, 256, p.data.view(torch.uint8).shape, generator=gen))
    assert all(p.device.type == torch.device(device).type for p in model.parameters())
    params = register_params(reader, model, bp.direct_params(0))
    rank = EngineRank(model, bp.plan_of(0), {})
    rank.map_arenas(mapped_arenas(reader, {0: endpoint}, [bp.pulls[strategy][0]]))
    return bp, rank, NoPacking(ByteReader(reader, {0: endpoint}, {}, params)), source, server


@pytest.mark.parametrize(
    ("strategy", "device"),
    [
        ("v3", "cpu"),  # queued ahead (on CUDA: on a stream of their own)
        ("v2", "cpu"),  # inline, each in its turn
        pytest.param("v3", "cuda", marks=pytest.mark.gpu),  # Triton into the parameters, streams, warm-up on CUDA
    ],
)
def test_mapped_pulls_are_warm_from_init_and_land_bit_exact(
    runs: dict[str, list[int]], strategy: str, device: str
) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    bp, rank, client, _, _ = _engine(strategy, device)
    pulls = bp.pulls[strategy][0]
    mapped = [i for i, p in enumerate(pulls.pulls) if p.mapped]
    assert mapped and not any(p.packed for p in pulls.pulls)  # every FP8 cover mapped, the rest direct
    before = {n: p.data.view(torch.uint8).clone() for n, p in rank.params.items()}
    rank.prepare(strategy, pulls)
    assert all(torch.equal(p.data.view(torch.uint8), before[n]) for n, p in rank.params.items())
    programs = {id(rank.mapped_program(strategy, pulls, i)) for i in mapped}
    assert sorted(runs["warm"]) == sorted(programs) and not runs["run"]  # each once, at init
    quantized = [q for i in mapped for q in rank.mapped_program(strategy, pulls, i).quantize]
    assert 2 * len(quantized) < len(mapped_entries(pulls))  # experts quantize in batched launches
    rank.take_mapped_bytes()
    rank.run_sync(1, STRATEGIES[strategy], pulls, client)  # type: ignore[arg-type]
    assert sorted(runs["run"]) == sorted(programs)  # replayed, nothing first-run in the sync
    assert rank.take_mapped_bytes() == bp.mapped_bytes(strategy) > 0
    weights = {n: t.cpu() for n, t in seeded_checkpoint(bp.cfg, 0, VERSION, device).items()}  # the trainer's bits
    (want,) = reference_models(get_engine("reference"), bp.cfg, bp.engine, weights)  # quantized on CPU torch
    expected = dict(want.named_parameters())
    assert [n for n, p in rank.params.items() if not bits_equal(p.data.cpu(), expected[n].data)] == []


def test_a_mapped_cover_holding_nan_is_refused_by_name() -> None:
    bp, rank, client, source, _ = _engine()
    pulls = bp.pulls["v3"][0]
    rank.prepare("v3", pulls)
    arena, layout = source.arena()
    name = next(n for n in layout.offsets if n.endswith("experts.3.down_proj.weight"))
    arena[layout.offsets[name] : layout.offsets[name] + 2].view(torch.bfloat16).fill_(float("nan"))
    with pytest.raises(NonFiniteWeightError, match="inf or NaN"):
        rank.run_sync(2, STRATEGIES["v3"], pulls, client)  # type: ignore[arg-type]
