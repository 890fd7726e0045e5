"""Warm start: a source creates at init every process group its gathers use (so a first sync costs what the next
ones do), and engine ranks interleave packed pulls across trainer ranks (v3 overlap)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from kvmove.models import resolve_model
from kvmove.models.layout import TrainerLayout
from kvmove.ports import free_port
from kvmove.sync.planning.schedule import Pull
from kvmove.sync.ranks.control import Address
from kvmove.sync.ranks.engine import interleaved
from kvmove.sync.ranks.source import SourceContext, seeded_source
from kvmove.sync.strategies import Gather


@pytest.mark.parametrize("scope", [Gather.STAGE, Gather.GLOBAL, Gather.ROOT])
def test_warm_creates_every_group_a_sync_then_uses(scope: Gather) -> None:
    cfg, layout = resolve_model("qwen3-moe-tiny"), TrainerLayout.parse("tp=2,pp=2")
    store = Address("127.0.0.1", free_port())
    out: dict[int, Any] = {}
    errors: list[BaseException] = []
    done = threading.Barrier(layout.world)

    def rank(r: int) -> None:
        source = None
        try:
            source = seeded_source(SourceContext(cfg, layout, r, "cpu", 0, store, 60.0))
            source.warm({scope})
            warmed = set(source.coll._groups)  # type: ignore[attr-defined]
            calls = source.collective_calls
            names = [m.name for m in source.metadata()]
            for _ in source.materialize(names, scope):
                pass
            out[r] = (warmed, set(source.coll._groups), calls, source.collective_calls)  # type: ignore[attr-defined]
        except BaseException as exc:
            errors.append(exc)
        finally:  # NOTE: rank 0's source hosts the store: it stays alive until every rank is done with it
            done.wait(120)
            del source

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(layout.world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for warmed, used, calls_at_init, calls in out.values():
        assert used <= warmed  # materializing created no group the warm start had not
        assert calls_at_init == 0 and calls > 0  # warm-up collectives are not counted as a sync's
    assert any(warmed for warmed, *_ in out.values())


def _pull(group: int, trainer: int) -> Pull:
    return Pull(group, trainer, (), 1, ())


def test_interleaved_alternates_trainer_ranks_keeping_each_ranks_group_order() -> None:
    pulls = [_pull(0, 0), _pull(1, 0), _pull(2, 0), _pull(3, 1), _pull(4, 1)]  # stage 0's groups, then stage 1's
    order = interleaved(pulls, range(5))
    assert order == [0, 3, 1, 4, 2]
    for t in (0, 1):
        mine = [pulls[i].group for i in order if pulls[i].trainer == t]
        assert mine == sorted(mine)


def test_trainer_builds_and_runs_its_pack_programs_at_init() -> None:
    """Pulls served from raw shards get their programs at init, one per slot (a Triton kernel compiles there, in
    the warm-up run): every cover quantizes straight into the slot, a few launches for a whole layer's experts."""
    import torch

    from kvmove.models.layout import EngineLayout
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.dryrun import build_plans
    from kvmove.sync.planning.blueprint import Blueprint
    from kvmove.sync.ranks.source import ShardedSource
    from kvmove.sync.ranks.trainer import TrainerRank
    from kvmove.sync.strategies import STRATEGIES

    v3 = STRATEGIES["v3"]
    config = SyncConfig(resolve_model("qwen3-moe-fp8-tiny"), TrainerLayout(), EngineLayout(), (v3,))
    plans, _ = build_plans(config)
    blueprint = Blueprint(config.model, config.trainer, config.engine, plans, [v3], config.options)
    specs = blueprint.specs("v3", 0)[0]
    source = ShardedSource(config.model, config.trainer, 0, None)  # type: ignore[arg-type]  # one rank: no gathers
    source.step(0)
    count, nbytes = blueprint.slot_sizes()[0]["v3"]
    rank = TrainerRank(source, {"v3": [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]}, 0)
    rank.register_pulls("v3", 0, specs)
    assert set(rank._programs) == {("v3", 0, p, s) for p in specs for s in range(count)}
    covers = sum(len(s) for _, s in specs.values())
    launches = sum(p.program.launches for p in rank._programs.values()) // count
    assert all(not p.program.scratch_bytes for p in rank._programs.values()) and 2 * launches < covers
    assert all(slot.any() for slot in rank.slots["v3"])  # warmed on every slot (and its stream on CUDA)


# -- a first sync does no init work: every program and read it runs ran (or was prepared) at init ----------------
def _fp8_blueprint() -> Any:
    from kvmove.models.layout import EngineLayout
    from kvmove.sync.config import SyncConfig
    from kvmove.sync.driver.dryrun import build_plans
    from kvmove.sync.planning.blueprint import Blueprint
    from kvmove.sync.strategies import STRATEGIES

    v3 = STRATEGIES["v3"]
    config = SyncConfig(resolve_model("qwen3-moe-fp8-tiny"), TrainerLayout(), EngineLayout(), (v3,))
    plans, _ = build_plans(config)
    return Blueprint(config.model, config.trainer, config.engine, plans, [v3], config.options)


def test_a_first_sync_runs_no_pack_program_for_the_first_time(runs: dict[str, list[int]]) -> None:
    """Each (pull, slot) program runs once at init; a sync whose pulls use every slot then only replays them."""
    import torch

    from kvmove.sync.ranks.source import ShardedSource
    from kvmove.sync.ranks.trainer import TrainerRank
    from kvmove.sync.strategies import STRATEGIES

    blueprint = _fp8_blueprint()
    specs = blueprint.specs("v3", 0)[0]
    from types import SimpleNamespace

    no_gathers = SimpleNamespace(collective_calls=0)  # one rank: no collectives
    source = ShardedSource(blueprint.cfg, blueprint.trainer, 0, no_gathers)  # type: ignore[arg-type]
    source.step(0)
    count, nbytes = blueprint.slot_sizes()[0]["v3"]
    rank = TrainerRank(source, {"v3": [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]}, 0, 30.0)
    rank.register_pulls("v3", 0, specs)
    programs = {id(p.program) for p in rank._programs.values()}
    assert count > 1 and len(programs) == count * len(specs)
    assert sorted(runs["warm"]) == sorted(programs) and not runs["run"]  # each once, at init
    (sync,) = blueprint.trainer_syncs(STRATEGIES["v3"], 1, 1, {0})
    thread = threading.Thread(target=rank.run_sync, args=(sync,))
    thread.start()
    used, inflight = set(), []
    for pull_id in sorted(specs, key=lambda i: specs[i][0]):  # two pulls in flight: both slots serve
        inflight.append((specs[pull_id][0], rank.pack(1, "v3", 0, pull_id, 30.0)))
        if len(inflight) == count or pull_id == max(specs):
            for group, packed in inflight:
                used.add(packed.slot)
                rank.release_slot("v3", packed.slot)
                rank.done(1, group, 0)
            inflight = []
    thread.join(60)
    assert used == set(range(count)) and len(runs["run"]) == len(specs)
    assert set(runs["run"]) <= programs and len(runs["warm"]) == len(programs)  # nothing first-run in the sync


def test_engine_warms_its_landing_programs_leaving_its_parameters_bit_for_bit(runs: dict[str, list[int]]) -> None:
    """Each (pull, receive slot) landing program runs once at init, round trip (the slot takes the parameters'
    bytes, then lands them back): parameters holding any bits, NaN payloads included, end unchanged."""
    import torch

    from kvmove.engines import get_engine
    from kvmove.sync.ranks.engine import EngineRank

    blueprint = _fp8_blueprint()
    engine = get_engine("reference")
    model = engine.build(blueprint.cfg, blueprint.engine, blueprint.engine.coord(0))
    gen = torch.Generator().manual_seed(0)
    for p in model.parameters():
        p.data.view(torch.uint8).copy_(torch.randint(0, 256, p.data.view(torch.uint8).shape, generator=gen))
    before = {n: p.data.view(torch.uint8).clone() for n, p in model.named_parameters()}
    count, nbytes = blueprint.recv_sizes(0)["v3"]
    recv = [torch.zeros(nbytes, dtype=torch.uint8) for _ in range(count)]
    rank = EngineRank(model, blueprint.plan_of(0), {"v3": recv})
    pulls = blueprint.pulls["v3"][0]
    rank.prepare("v3", pulls)
    assert all(torch.equal(p.data.view(torch.uint8), before[n]) for n, p in model.named_parameters())
    lander = rank.lander("v3", pulls)
    packed = [i for i, p in enumerate(pulls.pulls) if not p.direct]
    assert packed and sorted(runs["warm"]) == sorted(id(p) for p in lander._programs.values())
    assert len(runs["warm"]) == count * len(packed) and not runs["run"]
    for i in packed:  # a sync's landings replay them
        entries = [pulls.plan.entries[k] for k in pulls.pulls[i].entries]
        lander.land(entries, rank.recv["v3"][i % count], (i, i % count))
    assert set(runs["run"]) <= set(runs["warm"]) and len(runs["run"]) == len(packed)


def test_packed_reads_are_prepared_at_init_and_then_reused() -> None:
    """The engine prepares the read of each packed pull's bytes from each serve slot into each receive slot (on
    cuda-ipc: its copy plan and executor), and a sync's reads hand the transport those very ranges."""
    from types import SimpleNamespace

    import numpy as np
    import torch

    from kvmove.sync.ranks.control import TrainerEndpoint
    from kvmove.sync.ranks.puller import ByteReader
    from kvmove.transport.local import LocalTransport

    class Recording(LocalTransport):
        def __init__(self) -> None:
            super().__init__()
            self.prepared: list[np.ndarray] = []
            self.read_spans: list[np.ndarray] = []

        def _prepare(self, items: list[Any]) -> None:
            self.prepared += [i.spans for i in items]

        def _read(self, peer: Any, remote: Any, local: torch.Tensor, spans: np.ndarray) -> None:
            self.read_spans.append(spans)
            super()._read(peer, remote, local, spans)

    blueprint = _fp8_blueprint()
    pulls = blueprint.pulls["v3"][0]
    pulls = pulls._replace(pulls=tuple(p for p in pulls.pulls if not p.direct))  # the packed ones (no arena here)
    (slots, slot_bytes), (recvs, recv_bytes) = blueprint.slot_sizes()[0]["v3"], blueprint.recv_sizes(0)["v3"]
    server, reader = LocalTransport(), Recording()
    serve = [torch.randint(0, 256, (slot_bytes,), dtype=torch.uint8) for _ in range(slots)]
    recv = [torch.zeros(recv_bytes, dtype=torch.uint8) for _ in range(recvs)]
    endpoint = TrainerEndpoint(server.endpoint_info(), {"v3": [server.register(t) for t in serve]}, None)
    reader.connect(endpoint.info)
    byte_reader = ByteReader(reader, {0: endpoint}, {"v3": [reader.register(t) for t in recv]}, {})
    byte_reader.prepare(SimpleNamespace(pulls={"v3": pulls}))  # type: ignore[arg-type]
    sizes = {blueprint.pull_bytes(p, pulls) for p in pulls.pulls if not p.direct}
    assert len(reader.prepared) == slots * recvs * len(sizes)
    for n in sizes:
        for s in range(slots):
            for r in range(recvs):
                byte_reader.read("v3", 0, s, r, n)
                assert torch.equal(recv[r][:n], serve[s][:n])
    assert len(reader.read_spans) == slots * recvs * len(sizes)
    assert all(any(s is p for p in reader.prepared) for s in reader.read_spans)  # checked and planned at init
